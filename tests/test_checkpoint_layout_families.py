"""Rank-file layout and config.json of every family x (tp, pp) x dtype against
an expectation table computed here from TensorRT-LLM's rules (models/modeling_utils.py, mapping.py, models/llama/convert.py),
and Qwen2 against NVIDIA modelopt's golden layouts. Nothing here imports the
converter's tables or sharding code: the expectations are written from the
reference text, per family."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model, read_json
from test_checkpoint_layout import LAYOUTS, ST, actual_layout, assert_same_layout, convert

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PARALLEL = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 3)]
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# family -> (HF architecture, HF config overrides); 3 layers so pp 2 and 3 split unevenly or one each.
MODELS = {
    "llama31": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "llama-bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(vocab_size=251, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
}


def expected_layout(arch: str, cfg: dict, tp: int, pp: int, dtype: str,
                    parallel_embedding=False, embedding_dim=0) -> list[dict]:
    """Per rank: name -> (shape, safetensors dtype), from the reference tables."""
    V, H, I, L = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh            # HF head_dim when present (models/llama/config.py)
    qkv_bias = arch == "Qwen2ForCausalLM" or (arch == "LlamaForCausalLM" and cfg.get("attention_bias"))
    dense_bias = arch == "LlamaForCausalLM" and cfg.get("attention_bias")  # Qwen: no o_proj bias (models/qwen/convert.py)
    mlp_bias = bool(cfg.get("mlp_bias"))
    qk_norm = arch == "Qwen3ForCausalLM"
    qkv_r = (nh // tp + 2 * max(1, nkv // tp)) * hd  # fused QKV, KV heads duplicated below tp (models/convert_utils.py dup_kv_weight)
    vp = math.ceil(V / tp) * tp                       # vocab padded to a multiple of tp (_utils.py pad_vocab_size)
    stages = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]  # mapping.py pp_layers (torch.tensor_split)
    dt = ST[dtype]
    emb = (V, H) if not parallel_embedding else (vp // tp, H) if embedding_dim == 0 else (V, H // tp)
    ranks = []
    for stage in range(pp):          # rank = pp_rank * tp + tp_rank (mapping.py)
        for _ in range(tp):
            d = {}
            if stage == 0:
                d["transformer.vocab_embedding.weight"] = (emb, dt)
            for i in range(stages[stage]):  # local numbering
                p = f"transformer.layers.{i}."
                d[p + "input_layernorm.weight"] = ((H,), dt)
                d[p + "post_layernorm.weight"] = ((H,), dt)
                d[p + "attention.qkv.weight"] = ((qkv_r, H), dt)
                d[p + "attention.dense.weight"] = ((H, nh * hd // tp), dt)
                d[p + "mlp.fc.weight"] = ((I // tp, H), dt)
                d[p + "mlp.gate.weight"] = ((I // tp, H), dt)
                d[p + "mlp.proj.weight"] = ((H, I // tp), dt)
                if qkv_bias:
                    d[p + "attention.qkv.bias"] = ((qkv_r,), dt)
                if dense_bias:
                    d[p + "attention.dense.bias"] = ((H,), dt)
                if mlp_bias:
                    d[p + "mlp.fc.bias"] = ((I // tp,), dt)
                    d[p + "mlp.gate.bias"] = ((I // tp,), dt)
                    d[p + "mlp.proj.bias"] = ((H,), dt)
                if qk_norm:
                    d[p + "attention.q_layernorm.weight"] = ((hd,), dt)
                    d[p + "attention.k_layernorm.weight"] = ((hd,), dt)
            if stage == pp - 1:
                d["transformer.ln_f.weight"] = ((H,), dt)
                d["lm_head.weight"] = ((vp // tp, H), dt)  # written even when tied
            ranks.append(d)
    return ranks


def expected_config_fields(arch: str, cfg: dict, tp: int, pp: int, dtype: str) -> dict:
    """The config.json fields TensorRT-LLM 1.2 reads, as PretrainedConfig and Mapping take them (models/modeling_utils.py, mapping.py)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type")
    scaling = None if kind in (None, "default") else {
        "type": kind, "rope_type": kind, **{k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}}
    fields = {
        "architecture": arch, "dtype": dtype, "logits_dtype": "float32", "vocab_size": cfg["vocab_size"],
        "hidden_size": H, "num_hidden_layers": cfg["num_hidden_layers"], "num_attention_heads": nh,
        "num_key_value_heads": cfg["num_key_value_heads"], "head_size": cfg.get("head_dim") or H // nh,
        "intermediate_size": cfg["intermediate_size"], "hidden_act": "silu", "norm_epsilon": cfg["rms_norm_eps"],
        "position_embedding_type": "rope_gpt_neox", "max_position_embeddings": cfg["max_position_embeddings"],
        "rotary_base": rope.get("rope_theta", 10000.0), "rotary_scaling": scaling,
        "attn_bias": arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
        "mlp_bias": bool(cfg.get("mlp_bias")), "tie_word_embeddings": bool(cfg.get("tie_word_embeddings")),
        "qk_layernorm": arch == "Qwen3ForCausalLM",
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1, "moe_tp_size": tp,
                    "moe_ep_size": 1, "moe_cluster_size": 1, "gpus_per_node": 8},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if arch.startswith("Qwen"):
        fields["qwen_type"] = "qwen2" if arch == "Qwen2ForCausalLM" else "qwen3"
        fields["seq_length"] = cfg["max_position_embeddings"]
    if cfg.get("sliding_window") and arch == "MistralForCausalLM":
        fields["runtime_defaults"] = {"max_attention_window": [cfg["sliding_window"]]}
    return fields


_HF: dict = {}


def hf_model(factory, family: str, dtype: str) -> Path:
    if (family, dtype) not in _HF:
        arch, kw = MODELS[family]
        _HF[family, dtype] = make_hf_model(arch, factory.mktemp(f"hf-{family}"), dtype=DTYPES[dtype],
                                           num_hidden_layers=3, **kw)
    return _HF[family, dtype]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("tp,pp", PARALLEL)
@pytest.mark.parametrize("family", sorted(MODELS))
def test_layout_and_config(tmp_path_factory, tmp_path, family, tp, pp, dtype):
    hf = hf_model(tmp_path_factory, family, dtype)
    cfg, arch = read_json(hf / "config.json"), MODELS[family][0]
    written = convert(hf, tmp_path / "ck", tp=tp, pp=pp, dtype="auto")
    assert_same_layout(actual_layout(tmp_path / "ck", tp * pp), expected_layout(arch, cfg, tp, pp, dtype))
    assert written == read_json(tmp_path / "ck" / "config.json")
    want = expected_config_fields(arch, cfg, tp, pp, dtype)
    extra = set(written) - set(want) - {"use_parallel_embedding", "embedding_sharding_dim"}
    assert not extra, f"unexpected config keys {sorted(extra)}"
    for key, value in want.items():
        assert written[key] == value, key
    # TensorRT-LLM 1.x rejects rope type "default" (functional.py RotaryScalingType): no scaling is null.
    assert written["rotary_scaling"] is None or written["rotary_scaling"]["type"] != "default"


@pytest.mark.parametrize("family,dim", [("qwen2", 0), ("qwen3", 1), ("mistral", 0)])
def test_layout_parallel_embedding(tmp_path_factory, tmp_path, family, dim):
    hf = hf_model(tmp_path_factory, family, "float16")
    cfg, arch = read_json(hf / "config.json"), MODELS[family][0]
    written = convert(hf, tmp_path / "ck", tp=4, pp=1, dtype="auto", use_parallel_embedding=True,
                      embedding_sharding_dim=dim)
    assert_same_layout(actual_layout(tmp_path / "ck", 4), expected_layout(arch, cfg, 4, 1, "float16", True, dim))
    assert written["use_parallel_embedding"] is True and written["embedding_sharding_dim"] == dim


def test_llama3_rope_written_whole(tmp_path_factory, tmp_path):
    hf = hf_model(tmp_path_factory, "llama31", "bfloat16")
    written = convert(hf, tmp_path / "ck", tp=2, pp=1, dtype="auto")
    assert written["rotary_scaling"] == {"type": "llama3", "rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}
    assert written["rotary_base"] == 500000.0 and written["head_size"] == 16


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_matches_modelopt_golden_layout(tmp_path, tp):
    golden = json.loads((LAYOUTS / f"qwen2-bias-fp16-tp{tp}.json").read_text())
    assert golden["hf_architecture"] == "Qwen2ForCausalLM"
    hf = make_hf_model("Qwen2ForCausalLM", tmp_path / "hf", dtype=torch.float16, **golden["hf_config"])
    # modelopt shards the embedding over the vocabulary (its convention, see the layouts README).
    written = convert(hf, tmp_path / "ck", tp=tp, pp=1, dtype="auto", use_parallel_embedding=True)
    want = [{name: (tuple(shape), dt) for name, (shape, dt) in rank.items()} for rank in golden["ranks"]]
    assert_same_layout(actual_layout(tmp_path / "ck", tp), want)
    gc = golden["checkpoint_config"]
    for field in ["dtype", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_size", "hidden_act", "norm_epsilon",
                  "position_embedding_type", "max_position_embeddings", "use_parallel_embedding",
                  "embedding_sharding_dim", "quantization"]:
        assert written[field] == gc[field], field
    for key, value in gc["mapping"].items():
        assert written["mapping"][key] == value, key
    # Documented differences: the HF architecture name (TensorRT-LLM's own
    # QWenConfig writes it; MODEL_MAP maps both to QWenForCausalLM) and float32 logits.
    assert (written["architecture"], gc["architecture"]) == ("Qwen2ForCausalLM", "QWenForCausalLM")
    assert written["qwen_type"] == "qwen2" and written["attn_bias"] is True
