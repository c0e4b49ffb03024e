"""Rank-file layout of converted checkpoints against an expectation table for
TensorRT-LLM 1.2 computed here from TensorRT-LLM's layout rules (models/llama/convert.py, mapping.py), and
against NVIDIA modelopt's golden layouts. Nothing here imports the
converter's tables or sharding code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import make_hf_llama, read_json
from toolchain.checkpoint.convert import convert_checkpoint

LAYOUTS = Path("/work/shared/reference/layouts")
ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# The fields written for a dense, unquantized Llama (models/modeling_utils.py PretrainedConfig).
CONFIG_KEYS = {
    "architecture", "dtype", "logits_dtype", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_size", "intermediate_size", "hidden_act",
    "norm_epsilon", "position_embedding_type", "max_position_embeddings", "rotary_base", "rotary_scaling",
    "attn_bias", "mlp_bias", "use_parallel_embedding", "embedding_sharding_dim", "tie_word_embeddings",
    "qk_layernorm", "mapping", "quantization",
}


def expected_layout(cfg: dict, tp: int, pp: int, dtype: str, *, parallel_embedding=False, embedding_dim=0,
                    attn_bias=False, mlp_bias=False) -> list[dict[str, tuple[tuple[int, ...], str]]]:
    """Per rank: name -> (shape, safetensors dtype), straight from the reference tables."""
    V, H, I, L = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = H // nh
    nkv_r = max(1, nkv // tp)                 # KV heads duplicated below tp
    qkv_r = (nh // tp + 2 * nkv_r) * hd       # fused QKV rows per rank
    vp = math.ceil(V / tp) * tp               # vocab padded to a multiple of tp
    per_stage = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]  # mapping.py pp_layers (torch.tensor_split)
    dt = ST[dtype]
    if not parallel_embedding or tp == 1:
        emb = (V, H)
    elif embedding_dim == 0:
        emb = (vp // tp, H)
    else:
        emb = (V, H // tp)
    ranks = []
    for stage in range(pp):
        for _ in range(tp):
            d = {}
            if stage == 0:
                d["transformer.vocab_embedding.weight"] = (emb, dt)
            for i in range(per_stage[stage]):  # local numbering from 0
                p = f"transformer.layers.{i}."
                d[p + "input_layernorm.weight"] = ((H,), dt)
                d[p + "attention.qkv.weight"] = ((qkv_r, H), dt)
                d[p + "attention.dense.weight"] = ((H, nh * hd // tp), dt)
                d[p + "post_layernorm.weight"] = ((H,), dt)
                d[p + "mlp.fc.weight"] = ((I // tp, H), dt)
                d[p + "mlp.gate.weight"] = ((I // tp, H), dt)
                d[p + "mlp.proj.weight"] = ((H, I // tp), dt)
                if attn_bias:
                    d[p + "attention.qkv.bias"] = ((qkv_r,), dt)
                    d[p + "attention.dense.bias"] = ((H,), dt)
                if mlp_bias:
                    d[p + "mlp.fc.bias"] = ((I // tp,), dt)
                    d[p + "mlp.gate.bias"] = ((I // tp,), dt)
                    d[p + "mlp.proj.bias"] = ((H,), dt)
            if stage == pp - 1:
                d["transformer.ln_f.weight"] = ((H,), dt)
                d["lm_head.weight"] = ((vp // tp, H), dt)
            ranks.append(d)
    return ranks


def actual_layout(ckpt: Path, world: int) -> list[dict[str, tuple[tuple[int, ...], str]]]:
    files = sorted(p.name for p in ckpt.glob("rank*.safetensors"))
    assert files == sorted(f"rank{r}.safetensors" for r in range(world))
    out = []
    for r in range(world):
        with safe_open(str(ckpt / f"rank{r}.safetensors"), framework="pt") as fh:
            out.append({n: (tuple(fh.get_slice(n).get_shape()), fh.get_slice(n).get_dtype()) for n in fh.keys()})
    return out


def assert_same_layout(actual, expected):
    assert len(actual) == len(expected)
    for rank, (a, e) in enumerate(zip(actual, expected)):
        assert set(a) == set(e), f"rank {rank}: missing {sorted(set(e) - set(a))}, extra {sorted(set(a) - set(e))}"
        for name in e:
            assert a[name] == e[name], f"rank {rank} {name}: {a[name]} != {e[name]}"


def convert(hf: Path, out: Path, **kw) -> dict:
    out.mkdir()
    return convert_checkpoint(hf, out, **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_per_rank(hf_llama, tmp_path, tp, dtype):
    # vocab 250 pads lm_head at tp 4 (252); nkv 2 at tp 4 duplicates KV heads.
    cfg = read_json(hf_llama / "config.json")
    written = convert(hf_llama, tmp_path / "ck", tp=tp, pp=1, dtype=dtype)
    assert_same_layout(actual_layout(tmp_path / "ck", tp), expected_layout(cfg, tp, 1, dtype))
    assert written == read_json(tmp_path / "ck" / "config.json")
    assert set(written) == CONFIG_KEYS
    assert written["dtype"] == dtype and written["vocab_size"] == 250 and written["num_key_value_heads"] == 2
    assert written["mapping"]["world_size"] == tp and written["mapping"]["tp_size"] == tp
    assert written["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}


@pytest.mark.parametrize("tp,pp,layers", [(1, 2, 2), (2, 2, 3), (1, 3, 5)])
def test_layout_pipeline(tmp_path, tp, pp, layers):
    hf = make_hf_llama(tmp_path / "hf", num_hidden_layers=layers)
    cfg = read_json(hf / "config.json")
    written = convert(hf, tmp_path / "ck", tp=tp, pp=pp, dtype="float32")
    assert_same_layout(actual_layout(tmp_path / "ck", tp * pp), expected_layout(cfg, tp, pp, "float32"))
    assert written["num_hidden_layers"] == layers  # full model, not per stage
    assert written["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1,
                                  "moe_tp_size": tp, "moe_ep_size": 1, "moe_cluster_size": 1, "gpus_per_node": 8}


def test_layout_mha_and_biases(tmp_path):
    hf = make_hf_llama(tmp_path / "hf", num_key_value_heads=4, attention_bias=True, mlp_bias=True)
    cfg = read_json(hf / "config.json")
    written = convert(hf, tmp_path / "ck", tp=2, pp=1, dtype="bfloat16")
    assert_same_layout(actual_layout(tmp_path / "ck", 2),
                       expected_layout(cfg, 2, 1, "bfloat16", attn_bias=True, mlp_bias=True))
    assert written["attn_bias"] is True and written["mlp_bias"] is True


def test_layout_gqa_duplication_with_biases(tmp_path):
    hf = make_hf_llama(tmp_path / "hf", num_key_value_heads=2, attention_bias=True)
    cfg = read_json(hf / "config.json")
    convert(hf, tmp_path / "ck", tp=4, pp=1, dtype="float32")
    assert_same_layout(actual_layout(tmp_path / "ck", 4), expected_layout(cfg, 4, 1, "float32", attn_bias=True))


@pytest.mark.parametrize("dim", [0, 1])
def test_layout_parallel_embedding(hf_llama, tmp_path, dim):
    cfg = read_json(hf_llama / "config.json")
    written = convert(hf_llama, tmp_path / "ck", tp=4, pp=1, dtype="float32",
                      use_parallel_embedding=True, embedding_sharding_dim=dim)
    assert_same_layout(actual_layout(tmp_path / "ck", 4),
                       expected_layout(cfg, 4, 1, "float32", parallel_embedding=True, embedding_dim=dim))
    assert written["use_parallel_embedding"] is True and written["embedding_sharding_dim"] == dim


def test_tied_embeddings_still_write_lm_head(hf_llama_tied, tmp_path):
    cfg = read_json(hf_llama_tied / "config.json")
    written = convert(hf_llama_tied, tmp_path / "ck", tp=2, pp=2, dtype="float32")
    assert_same_layout(actual_layout(tmp_path / "ck", 4), expected_layout(cfg, 2, 2, "float32"))
    assert written["tie_word_embeddings"] is True


@pytest.mark.parametrize("hf_dtype,target,want", [
    (torch.float32, "cpu", "float32"),
    (torch.float32, "trtllm", "float16"),   # upstream converters map fp32 to fp16
    (torch.bfloat16, "trtllm", "bfloat16"),
    (torch.float16, "cpu", "float16"),
])
def test_auto_dtype(tmp_path, hf_dtype, target, want):
    hf = make_hf_llama(tmp_path / "hf", dtype=hf_dtype, num_hidden_layers=1)
    written = convert(hf, tmp_path / "ck", tp=1, pp=1, dtype="auto", target=target)
    assert written["dtype"] == want
    with safe_open(str(tmp_path / "ck" / "rank0.safetensors"), framework="pt") as fh:
        assert {fh.get_slice(n).get_dtype() for n in fh.keys()} == {ST[want]}


def test_config_rope_and_hf_fields(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}
    # dict(rope): transformers adds rope_theta to the dict it is given
    hf = make_hf_llama(tmp_path / "hf", rope_scaling=dict(rope), num_hidden_layers=1, rms_norm_eps=1e-5)
    written = convert(hf, tmp_path / "ck", tp=1, pp=1, dtype="float32")
    assert written["rotary_scaling"] == {"type": "llama3", **rope}
    assert written["rotary_base"] == 10000.0 and written["norm_epsilon"] == 1e-5
    assert written["position_embedding_type"] == "rope_gpt_neox" and written["hidden_act"] == "silu"
    assert written["logits_dtype"] == "float32" and written["head_size"] == 16


GOLDEN_FIELDS = ["architecture", "dtype", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_size", "hidden_act", "norm_epsilon",
                 "position_embedding_type", "max_position_embeddings", "use_parallel_embedding",
                 "embedding_sharding_dim", "quantization"]


@pytest.mark.parametrize("tp", [1, 2])
def test_matches_modelopt_golden_layout(tmp_path, tp):
    golden = json.loads((LAYOUTS / f"llama-gqa-fp16-tp{tp}.json").read_text())
    hf_cfg = dict(golden["hf_config"])
    assert hf_cfg.pop("max_position_embeddings") == 512  # make_hf_llama's fixed value
    hf = make_hf_llama(tmp_path / "hf", dtype=torch.float16, **hf_cfg)
    assert read_json(hf / "config.json")["architectures"] == [golden["hf_architecture"]]
    written = convert(hf, tmp_path / "ck", tp=tp, pp=1, dtype="auto", use_parallel_embedding=True)
    want = [{name: (tuple(shape), dt) for name, (shape, dt) in rank.items()} for rank in golden["ranks"]]
    assert_same_layout(actual_layout(tmp_path / "ck", tp), want)
    gc = golden["checkpoint_config"]
    for field in GOLDEN_FIELDS:
        assert written[field] == gc[field], field
    for key, value in gc["mapping"].items():
        assert written["mapping"][key] == value, key
    # logits_dtype differs on purpose: modelopt writes the model dtype, we keep
    # TensorRT-LLM's float32 default (infer_dtype keeps float32).
