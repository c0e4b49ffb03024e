"""Gemma 2 on the engine path: the converter's table and config.json (archs/gemma.py), the refusals,
and the CPU engine's Gemma features each shown to matter against transformers' Gemma2ForCausalLM
(the greedy and logit parity at every layout is in test_parity_families.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_engine_cpu_util import _one_thread, hf_logits  # noqa: F401
from test_parity_families import FP32_REF_ATOL, GEMMA2, NEW, engine_path, hf_dir, reference

from toolchain.archs import load_params
from toolchain.checkpoint.convert import convert_checkpoint, plan_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.errors import ToolchainError

FAMILY = "gemma2-window-softcap"
LONG = [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7, 8, 9, 10, 11, 12, 13]
assert len(LONG) > GEMMA2["sliding_window"]  # the window must cut into the prompt


def gemma_cfg(**over):
    cfg = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24, "sliding_window": 8,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "dtype": "bfloat16"}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def test_config_fields_and_alternating_windows():
    family, p = load_params(gemma_cfg())
    extra = family.config_extra(p)
    assert extra == {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                     "inter_layernorms": True, "hidden_act": "gelu",
                     # Gemma2Config's default layer_types: layers 0 and 2 slide, 1 and 3 attend fully
                     "runtime_defaults": {"max_attention_window": [8, 512, 8, 512]}}
    cfg = gemma_cfg(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=16)
    cfg["attn_logit_softcapping"] = None  # an explicit null turns the cap off (absent: Gemma2Config's 50.0)
    _, p = load_params(cfg)
    extra = family.config_extra(p)
    assert extra["runtime_defaults"] == {"max_attention_window": [512, 16, 512, 16]}
    assert extra["attn_logit_softcapping"] is None
    _, p = load_params(gemma_cfg(layer_types=["full_attention"] * 4))
    assert "runtime_defaults" not in family.config_extra(p)


@pytest.mark.parametrize("over,words", [
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"final_logit_softcapping": "big"}, "final_logit_softcapping"),
])
def test_refusals_are_one_line(over, words):
    with pytest.raises(ToolchainError) as err:
        load_params(gemma_cfg(**over))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_checkpoint_layout(tmp_path_factory, tmp_path):
    """Norms stored as 1 + w (upstream's converter), four per layer; the embedding vocab-sharded at tp 2
    whatever was asked (GemmaConfig forces use_parallel_embedding = tp > 1); lm_head from the embedding."""
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    hf = load_file(str(path / "model.safetensors"))
    config = convert_checkpoint(path, tmp_path, tp=2, pp=1, dtype="float32", use_parallel_embedding=False)
    assert config["architecture"] == "Gemma2ForCausalLM" and config["use_parallel_embedding"] is True
    assert config["hidden_act"] == "gelu" and config["inter_layernorms"] is True  # TensorRT-LLM's tanh GELU
    assert (config["query_pre_attn_scalar"], config["attn_logit_softcapping"],
            config["final_logit_softcapping"]) == (24, 4.0, 3.0)
    assert config["runtime_defaults"] == {"max_attention_window": [8, 512]}
    rank1 = load_file(str(tmp_path / "rank1.safetensors"))
    for hf_name, trt in [("model.layers.1.input_layernorm.weight", "transformer.layers.1.input_layernorm.weight"),
                         ("model.layers.1.post_attention_layernorm.weight",
                          "transformer.layers.1.post_layernorm.weight"),
                         ("model.layers.1.pre_feedforward_layernorm.weight",
                          "transformer.layers.1.pre_feedforward_layernorm.weight"),
                         ("model.layers.1.post_feedforward_layernorm.weight",
                          "transformer.layers.1.post_feedforward_layernorm.weight"),
                         ("model.norm.weight", "transformer.ln_f.weight")]:
        assert torch.equal(rank1[trt], hf[hf_name] + 1.0), trt
    embed = hf["model.embed_tokens.weight"]  # 250 rows: 125 per rank
    assert torch.equal(rank1["transformer.vocab_embedding.weight"], embed[125:])
    assert torch.equal(rank1["lm_head.weight"], embed[125:])
    single = tmp_path / "tp1"
    single.mkdir()
    assert convert_checkpoint(path, single, tp=1, pp=1, dtype="float32")["use_parallel_embedding"] is False


@pytest.mark.parametrize("method,kv,words", [("awq", "none", "quantization awq"),
                                             ("smoothquant", "none", "quantization smoothquant"),
                                             ("none", "int8", "quantization.kv_cache int8")])
def test_calibrated_quantization_refused(tmp_path_factory, method, kv, words):
    from toolchain.quant.view import Quantization

    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    with pytest.raises(ToolchainError) as err:
        plan_checkpoint(path, tp=1, pp=1, quantization=Quantization(method=method, kv_cache=kv))
    assert words in str(err.value) and "Gemma2ForCausalLM" in str(err.value) and "\n" not in str(err.value)


def test_weight_only_int8_runs(tmp_path_factory, tmp_path):
    """W8A16 (upstream's native Gemma flow) converts and runs; greedy tokens stay HF's on a tiny model."""
    from test_engine_cpu_util import make_engine_dir
    from test_parity_families import greedy

    from toolchain.quant.view import Quantization

    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    engine = CpuEngine.load(make_engine_dir(path, tmp_path, 2, 1, dtype="float32",
                                            convert_kwargs={"quantization": Quantization(method="int8_wo")}))
    assert engine.config["pretrained_config"]["quantization"]["quant_algo"] == "W8A16"
    got = engine.generate(LONG, SamplingParams(max_new_tokens=NEW))
    want = greedy(path, LONG)
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= NEW - 2  # int8 rounding may flip a late token


def _edited(tmp_path: Path, source: Path, change) -> CpuEngine:
    """The engine with one pretrained_config feature changed, to show the feature matters."""
    out = tmp_path / "engine"
    shutil.copytree(source, out)
    cfg = json.loads((out / "config.json").read_text())
    change(cfg["pretrained_config"])
    (out / "config.json").write_text(json.dumps(cfg))
    return CpuEngine.load(out)


@pytest.mark.parametrize("feature,change", [
    ("window", lambda c: c.pop("runtime_defaults")),
    ("attention soft-cap", lambda c: c.update(attn_logit_softcapping=None)),
    ("final soft-cap", lambda c: c.update(final_logit_softcapping=None)),
    ("query_pre_attn_scalar", lambda c: c.update(query_pre_attn_scalar=16)),
])
def test_each_feature_matters(tmp_path_factory, tmp_path, feature, change):
    """The engine agrees with HF on a 20-token prompt (window 8); without the feature it must not."""
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    want = hf_logits(reference(path, torch.float32), LONG)
    source = engine_path(tmp_path_factory, path)
    torch.testing.assert_close(CpuEngine.load(source).forward_logits(LONG), want, atol=FP32_REF_ATOL, rtol=0)
    assert (_edited(tmp_path, source, change).forward_logits(LONG) - want).abs().max() > 1e-2

