"""Gemma 3 (text) on the engine path: the converter's table and config.json (archs/gemma3.py), the refusals,
and the CPU engine's Gemma 3 features each shown to matter against transformers' Gemma3ForCausalLM (greedy and
logit parity at tp 1, tp 2 and pp 2 are in test_parity_families.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_engine_cpu_util import _one_thread, hf_logits  # noqa: F401
from test_gemma import LONG, _edited
from test_parity_families import FP32_REF_ATOL, GEMMA3, NEW, engine_path, hf_dir, reference

from toolchain.archs import load_params
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.errors import ToolchainError

FAMILY = "gemma3-local-rope"
REPO = Path(__file__).resolve().parents[1]
assert len(LONG) > GEMMA3["sliding_window"]  # the window must cut into the prompt


def published_1b(**over) -> dict:
    """Gemma-3-1B-it's config.json as published (transformers 4.x spelling)."""
    cfg = json.loads((REPO / "build" / "configs" / "gemma-3-1b-it" / "config.json").read_text())
    cfg.update(over)
    return cfg


def test_config_fields_of_the_published_1b():
    family, p = load_params(published_1b())
    extra = family.config_extra(p)
    assert p.qk_layernorm and p.rope_theta == 1_000_000.0 and p.rotary_scaling is None
    windows = extra.pop("runtime_defaults")["max_attention_window"]
    assert extra == {"query_pre_attn_scalar": 256, "final_logit_softcapping": None, "_sliding_window_pattern": 6,
                     "rope_local_base_freq": 10000, "sliding_window": 512, "inter_layernorms": True,
                     "hidden_act": "gelu"}
    # every sixth layer (5, 11, 17, 23) attends fully, the other 22 see 512 tokens
    assert [i for i, w in enumerate(windows) if w != 512] == [5, 11, 17, 23] and len(windows) == 26
    assert {windows[i] for i in (5, 11, 17, 23)} == {32768}


def test_transformers5_rope_parameters_read_back():
    """transformers 5 nests both rope bases under rope_parameters; the tiny model's config is written that way."""
    nested = published_1b(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        del nested[key]
    family, p = load_params(nested)
    assert (p.rope_theta, family.config_extra(p)["rope_local_base_freq"]) == (1e6, 1e4)
    # a config with layer_types only: the pattern is the one they follow (here every fourth layer full)
    del nested["sliding_window_pattern"]
    types = (["sliding_attention"] * 3 + ["full_attention"]) * 2
    _, p = load_params({**nested, "num_hidden_layers": 8, "layer_types": types})
    assert family.config_extra(p)["_sliding_window_pattern"] == 4


@pytest.mark.parametrize("over,words", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope scaling"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"layer_types": ["full_attention"] * 26}, "layer_types do not follow sliding_window_pattern 6"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ({"rope_local_base_freq": None}, "rope_local_base_freq null"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "on its sliding layers"),
])
def test_refusals_are_one_line(over, words):
    with pytest.raises(ToolchainError) as err:
        load_params(published_1b(**over))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_checkpoint_layout(tmp_path_factory, tmp_path):
    """q/k norms stored as 1 + w like every Gemma norm (upstream's load_gemma_weights), full on every rank;
    config.json carries the Gemma3ConfigGroup fields."""
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    hf = load_file(str(path / "model.safetensors"))
    config = convert_checkpoint(path, tmp_path, tp=2, pp=1, dtype="float32")
    assert config["architecture"] == "Gemma3ForCausalLM" and config["qk_layernorm"] is True
    assert (config["_sliding_window_pattern"], config["rope_local_base_freq"], config["rotary_base"],
            config["sliding_window"], config["query_pre_attn_scalar"]) == (3, 100.0, 10000.0, 8, 24)
    assert "attn_logit_softcapping" not in config and config["use_parallel_embedding"] is True
    assert config["runtime_defaults"] == {"max_attention_window": [8, 8, 512, 8]}
    rank1 = load_file(str(tmp_path / "rank1.safetensors"))
    for norm in ("q", "k"):
        assert torch.equal(rank1[f"transformer.layers.2.attention.{norm}_layernorm.weight"],
                           hf[f"model.layers.2.self_attn.{norm}_norm.weight"] + 1.0)


@pytest.mark.parametrize("feature,change", [
    ("window", lambda c: c.pop("runtime_defaults")),
    ("local rope base", lambda c: c.update(rope_local_base_freq=c["rotary_base"])),
    ("local-layer pattern", lambda c: c.update(_sliding_window_pattern=2)),
])
def test_each_feature_matters(tmp_path_factory, tmp_path, feature, change):
    """The engine agrees with HF on a 20-token prompt (window 8); without the feature it must not."""
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    want = hf_logits(reference(path, torch.float32), LONG)
    source = engine_path(tmp_path_factory, path)
    torch.testing.assert_close(CpuEngine.load(source).forward_logits(LONG), want, atol=FP32_REF_ATOL, rtol=0)
    assert (_edited(tmp_path, source, change).forward_logits(LONG) - want).abs().max() > 1e-2


def test_weight_only_int8_runs(tmp_path_factory, tmp_path):
    """W8A16 (upstream's native Gemma flow) converts and runs at pp 2; greedy tokens stay HF's."""
    from test_engine_cpu_util import make_engine_dir
    from test_parity_families import greedy

    from toolchain.quant.view import Quantization

    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    engine = CpuEngine.load(make_engine_dir(path, tmp_path, 1, 2, dtype="float32",
                                            convert_kwargs={"quantization": Quantization(method="int8_wo")}))
    assert engine.config["pretrained_config"]["quantization"]["quant_algo"] == "W8A16"
    got = engine.generate(LONG, SamplingParams(max_new_tokens=NEW))
    want = greedy(path, LONG)
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= NEW - 2  # int8 rounding may flip a late token


def test_llmapi_cpu_stand_in_runs_it(tmp_path_factory, tmp_path):
    """The LLM-API path takes the HF checkpoint as it is (PyTorch backend's modeling_gemma3); its CPU stand-in
    (CpuLLM) generates transformers' greedy tokens on a prompt longer than the window."""
    import shutil
    import threading

    from test_parity_families import greedy
    from triton_helpers import make_tiny_tokenizer

    from toolchain.llmapi.cpu_llm import CpuLLM
    from toolchain.llmapi.cpu_llm import SamplingParams as LlmParams

    hf = tmp_path / "hf"
    shutil.copytree(hf_dir(tmp_path_factory, FAMILY, "float32"), hf)
    make_tiny_tokenizer(hf)
    with CpuLLM(model=str(hf), backend="pytorch", tensor_parallel_size=1, max_batch_size=2, max_seq_len=128,
                max_num_tokens=128, kv_cache_config={"max_tokens": 512}, work_dir=tmp_path / "work") as llm:
        text = " ".join(llm.tokenizer.decode([t]) for t in LONG[1:])
        ids = llm.encode(text)
        assert len(ids) > GEMMA3["sliding_window"]
        done, seen = threading.Event(), []

        def on_output(out):
            if out.finished:
                seen.append(list(out.outputs[0].token_ids))
                done.set()

        llm.generate_async(text, LlmParams.from_kwargs({"max_tokens": NEW, "ignore_eos": True, "top_k": 1}),
                           False, on_output=on_output)
        assert done.wait(60)
    assert seen[0] == greedy(hf_dir(tmp_path_factory, FAMILY, "float32"), ids)
