"""Planner figures against values computed here from the reference formulas
(TensorRT-LLM docs/source/legacy/reference/memory.md): Llama-3-8B at TP1, Llama-3-70B at TP4 x PP2,
the byte cost of each weight format, KV duplication, and the verdict."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from toolchain.archs.layout import Layout
from toolchain.plan import memory as mem
from toolchain.gpus import GIB, lookup, resolve
from toolchain.plan.model import kv_dtype_bytes, load_model
from toolchain.quant.view import Quantization
from toolchain.plan.plan import DraftModel, plan_memory
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "build" / "configs"
L3_8B = dict(V=128256, H=4096, I=14336, L=32, nh=32, nkv=8, hd=128)
L3_70B = dict(V=128256, H=8192, I=28672, L=80, nh=64, nkv=8, hd=128)


def spec_for(tmp_path: Path, config_dir: Path, **sections):
    data = {"name": "p", "target": "trtllm", "model": {"checkpoint": str(config_dir), "dtype": "float16"},
            "gpu": {"name": "H100 80GB"}, "build": {"host_memory_gib": 1024}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def layer_linear_params(m: dict, t: int) -> int:
    """qkv + dense + fc + gate + proj parameters of one layer on one of t ranks."""
    nkv_r = max(1, m["nkv"] // t)
    qkv = (m["nh"] // t + 2 * nkv_r) * m["hd"] * m["H"]
    dense = m["H"] * m["nh"] * m["hd"] // t
    mlp = 3 * (m["I"] // t) * m["H"]
    return qkv + dense + mlp


def plan(spec, quant=Quantization(), device=None):
    model = load_model(spec.model.checkpoint)
    return plan_memory(spec, model, quant, device or lookup(spec.gpu.name))


def test_llama3_8b_tp1_figures(tmp_path):
    m = L3_8B
    p = plan(spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct"))
    rank = p.ranks[0]
    assert rank.kv_bytes_per_token == 2 * m["L"] * m["nkv"] * m["hd"] * 2 == 131072  # 128 KiB
    embed_and_head = 2 * m["V"] * m["H"] * 2
    assert embed_and_head == pytest.approx(2.1e9, rel=0.01)
    norms = (2 * m["L"] + 1) * m["H"] * 2
    assert rank.weights_bytes == m["L"] * layer_linear_params(m, 1) * 2 + embed_and_head + norms
    assert rank.layers == (0, 31) and p.fits


def test_llama3_8b_fp8_kv_halves_and_tp2_splits(tmp_path):
    spec = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", parallelism={"tp": 2})
    assert plan(spec, Quantization(kv_cache="fp8")).ranks[0].kv_bytes_per_token == 131072 // 2 // 2


def test_llama3_70b_tp4_pp2_per_rank(tmp_path):
    m = L3_70B
    spec = spec_for(tmp_path, CONFIGS / "llama-3-70b", parallelism={"tp": 4, "pp": 2})
    p = plan(spec)
    assert len(p.ranks) == 8
    per_layer = layer_linear_params(m, 4) * 2
    stage_layers = m["L"] // 2
    vp = math.ceil(m["V"] / 4) * 4
    first = stage_layers * per_layer + m["V"] * m["H"] * 2 + stage_layers * 2 * m["H"] * 2
    last = stage_layers * per_layer + vp // 4 * m["H"] * 2 + (stage_layers * 2 + 1) * m["H"] * 2
    for r in p.ranks:
        assert (r.tp_rank, r.pp_rank) == (r.rank % 4, r.rank // 4)  # rank = pp_rank * tp + tp_rank
        assert r.kv_bytes_per_token == 2 * stage_layers * (m["nkv"] // 4) * m["hd"] * 2 == 40960
        assert r.weights_bytes == (first if r.pp_rank == 0 else last)
    assert p.ranks[0].layers == (0, 39) and p.ranks[4].layers == (40, 79)
    assert p.kv_tokens_capacity == min(r.kv_tokens_capacity for r in p.ranks)


def test_format_bytes_per_linear():
    out, inp, g = 4096, 1024, 128
    n = out * inp
    assert mem.linear_bytes(out, inp, Quantization(), 2) == 2 * n
    assert mem.linear_bytes(out, inp, Quantization(), 4) == 4 * n
    assert mem.linear_bytes(out, inp, Quantization(method="fp8"), 2) == n + 8
    assert mem.linear_bytes(out, inp, Quantization(method="int8_wo"), 2) == n + out * 2
    assert mem.linear_bytes(out, inp, Quantization(method="int4_wo"), 2) == n / 2 + out * 2
    assert mem.linear_bytes(out, inp, Quantization(method="smoothquant"), 2) == n + out * 4 + 4 + inp * 2
    assert mem.linear_bytes(out, inp, Quantization(method="awq", group_size=g), 2) == n * (0.5 + 2 / g) + inp * 2
    assert mem.linear_bytes(out, inp, Quantization(method="awq", group_size=64), 2) > mem.linear_bytes(
        out, inp, Quantization(method="awq", group_size=128), 2)
    # Weight-only checkpoints are written unquantized; trtllm-build quantizes.
    assert mem.linear_bytes(out, inp, Quantization(method="int8_wo"), 2, stored=True) == 2 * n


def test_embedding_and_lm_head_stay_16_bit_under_awq(tmp_path):
    m = L3_8B
    p = plan(spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct"), Quantization(method="awq"))
    per_layer = sum(mem.linear_bytes(o, i, Quantization(method="awq"), 2)
                    for o, i in [(6144, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)])
    expected = m["L"] * per_layer + 2 * m["V"] * m["H"] * 2 + (2 * m["L"] + 1) * m["H"] * 2
    assert p.ranks[0].weights_bytes == int(expected)


def test_draft_logits_add_the_draft_engines_step_cache(tmp_path):
    """use_draft_logits builds the draft with gather_generation_logits: its executor keeps 8 steps of
    fp32 logits for every sequence plus their transpose, 8 x (batch + 1) x V x 4 bytes
    (runtimeBuffers.cpp), on rank 0's GPU next to the draft."""
    cfg = CONFIGS / "llama-3-8b-instruct"
    draft = DraftModel(load_model(cfg))

    def draft_bytes(**extra):
        spec = spec_for(tmp_path, cfg, limits={"max_batch_size": 16},
                        speculative={"mode": "draft_target", "max_draft_len": 4, "draft_model": str(cfg), **extra})
        p = plan_memory(spec, load_model(cfg), Quantization(), lookup(spec.gpu.name), draft)
        assert p.ranks[0].draft_bytes > 0
        return p.ranks[0].draft_bytes

    assert draft_bytes(use_draft_logits=True) - draft_bytes() == 8 * 17 * L3_8B["V"] * 4


def test_stage_layers_follow_tensor_split():
    assert [len(r) for r in Layout(pp=4).stage_layers(30)] == [8, 8, 7, 7]
    assert [(r.start, r.stop) for r in Layout(pp=2).stage_layers(80)] == [(0, 40), (40, 80)]


def test_kv_heads_duplicate_when_tp_exceeds_them(tmp_path):
    spec = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", parallelism={"tp": 16},
                    gpu={"per_node": 16})
    r = plan(spec).ranks[0]
    assert r.kv_bytes_per_token == 2 * 32 * 1 * 128 * 2  # one whole KV head per rank


def test_capacity_is_whole_blocks_and_sequences_include_draft(tmp_path):
    spec = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", build={"tokens_per_block": 64},
                    limits={"max_seq_len": 1000, "max_input_len": 500})
    p = plan(spec)
    r = p.ranks[0]
    assert r.kv_tokens_capacity % 64 == 0
    assert r.kv_tokens_capacity == int(0.9 * r.free_bytes) // r.kv_bytes_per_token // 64 * 64
    assert p.sequence_tokens == 1024
    assert mem.sequence_tokens(1000, 24, 64) == 1024 and mem.sequence_tokens(1000, 25, 64) == 1088
    assert mem.sequence_tokens(8192, 0, 32, window=4096) == 4096


def test_beam_width_multiplies_each_sequences_kv(tmp_path):
    # Every beam keeps its own KV: the executor sizes a sequence's blocks max_beam_width times (the plan's
    # sequence_tokens), so a pool holds a quarter of the sequences at width 4.
    one, four = (plan(spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", build={"max_beam_width": w}))
                 for w in (1, 4))
    assert four.sequence_tokens == 4 * one.sequence_tokens
    # (the pool itself shrinks a little: the per-step buffers grow with the beams too)
    assert one.kv_tokens_capacity * 0.99 < four.kv_tokens_capacity <= one.kv_tokens_capacity
    assert four.concurrency == four.kv_tokens_capacity // (4 * one.sequence_tokens) < one.concurrency / 3.9


def test_too_big_model_does_not_fit_and_names_changes_that_would(tmp_path):
    spec = spec_for(tmp_path, CONFIGS / "llama-3-70b", model={"dtype": "bfloat16"})
    p = plan(spec)
    assert not p.fits and not p.weights_fit
    verdict = p.verdict()
    assert verdict.startswith("does not fit: rank 0 needs") and "--set parallelism.tp=" in verdict
    # 131 GiB of bf16 weights: two H100s hold them with room for KV; so does FP8 on one, or one H200.
    assert p.suggestions == ["parallelism.tp=2", "quantization.method=fp8", "gpu.name='H200 141GB'"]
    cfg = CONFIGS / "llama-3-70b"
    assert plan(spec_for(tmp_path, cfg, model={"dtype": "bfloat16"}, parallelism={"tp": 2})).fits
    assert plan(spec, Quantization(method="fp8")).fits
    assert plan(spec, device=lookup("H200")).fits


def test_kv_shortfall_suggests_the_longest_max_seq_len(tmp_path):
    spec = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", gpu={"name": "L4"},
                    limits={"max_seq_len": 65536, "max_input_len": 4096}, serving={"kv_cache_free_gpu_mem_fraction": 0.1})
    p = plan(spec)
    assert p.weights_fit and not p.fits
    longest = [s for s in p.suggestions if s.startswith("limits.max_seq_len=")]
    assert longest
    value = int(longest[0].split("=")[1])
    ok = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", gpu={"name": "L4"},
                  limits={"max_seq_len": value, "max_input_len": 4096}, serving={"kv_cache_free_gpu_mem_fraction": 0.1})
    too_long = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", gpu={"name": "L4"},
                        limits={"max_seq_len": value + 64, "max_input_len": 4096},
                        serving={"kv_cache_free_gpu_mem_fraction": 0.1})
    assert plan(ok).fits and not plan(too_long).fits


def test_gpu_table_and_overrides(tmp_path):
    assert lookup("h100").sm == 90 and lookup("H200").memory_gib > 140 and lookup("l40s").sm == 89
    assert lookup("RTX-3090").sm == 86 and lookup("a100 40gb").memory_gib == 40
    spec = spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", gpu={"name": "A100", "memory_gib": 20})
    from toolchain.gpus import resolve

    dev = resolve(spec)
    assert dev.name == "A100 80GB" and dev.memory_gib == 20 and dev.sm == 80
    assert dev.memory_bytes == 20 * GIB


def test_tied_embedding_shared_only_when_identical(tmp_path):
    cfg = CONFIGS / "qwen2.5-0.5b-instruct"  # tied embeddings
    one = plan(spec_for(tmp_path, cfg)).ranks[0]
    two = plan(spec_for(tmp_path, cfg, parallelism={"tp": 2})).ranks[0]
    v, h = 151936, 896
    b1 = mem.rank_weights(load_model(cfg).params, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2,
                          qkv_bias=True)
    assert b1.lm_head == 0 and b1.embedding == v * h * 2 and one.weights_bytes == b1.total
    b2 = mem.rank_weights(load_model(cfg).params, tp=2, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2,
                          qkv_bias=True)
    assert b2.lm_head == v // 2 * h * 2 and two.weights_bytes == b2.total


def test_sliding_layers_hold_only_their_window_on_a_gpu(tmp_path):
    """Gemma 2 9B: every other layer slides over 4096 tokens, so a 8192-token sequence costs 3/4 of the KV a
    uniform model would (one pool per window, sized window x bytes: resource_manager.py VSWA)."""
    spec = spec_for(tmp_path, CONFIGS / "gemma-2-9b-it", model={"dtype": "bfloat16"},
                    limits={"max_seq_len": 8192, "max_input_len": 4096})
    rank = plan(spec).ranks[0]
    per_layer = 2 * 8 * 256 * 2  # k and v, 8 KV heads of 256, bfloat16
    full = per_layer * 42
    assert rank.kv_bytes_per_token == full * (21 * 4096 + 21 * 8192) // (42 * 8192)
    # A sequence no longer than the window pays for every layer.
    short = plan(spec_for(tmp_path, CONFIGS / "gemma-2-9b-it", model={"dtype": "bfloat16"},
                          limits={"max_seq_len": 4096, "max_input_len": 2048}))
    assert short.ranks[0].kv_bytes_per_token == full
    # The CPU engine keeps every layer's blocks, so its plan does not shrink.
    cpu_spec = spec_for(tmp_path, CONFIGS / "gemma-2-9b-it", target="cpu", gpu={"name": None},
                        model={"dtype": "bfloat16"}, limits={"max_seq_len": 8192, "max_input_len": 4096})
    cpu = plan(cpu_spec, device=resolve(cpu_spec))
    assert cpu.ranks[0].kv_bytes_per_token == full // 2 * kv_dtype_bytes(cpu.kv_dtype)  # every layer, whole


@pytest.mark.parametrize("options,limits,expected", [
    ({}, {}, 128),                                                      # CudaGraphConfig(): max_batch_size 0 -> 128
    ({"cuda_graph_config": {"max_batch_size": 16}}, {}, 16),
    ({"cuda_graph_config": {"batch_sizes": [1, 2, 48]}}, {}, 48),
    ({"cuda_graph_config": None}, {}, 0),                               # graphs off
    ({}, {"max_batch_size": 32}, 32),                                   # the executor's batch caps it
    ({}, {"max_num_tokens": 64, "max_batch_size": 256}, 64),            # a decode step within max_num_tokens
])
def test_cuda_graph_batch_follows_the_pytorch_backend(options, limits, expected):
    lim = {"max_batch_size": 256, "max_num_tokens": 8192, **limits}
    assert mem.cuda_graph_batch(options, draft_len=0, **lim) == expected


def test_llmapi_plan_counts_the_cuda_graph_pool(tmp_path):
    m = L3_8B
    engine = plan(spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", limits={"max_batch_size": 64}))
    llm = plan(spec_for(tmp_path, CONFIGS / "llama-3-8b-instruct", target="llmapi", limits={"max_batch_size": 64}))
    assert engine.ranks[0].cuda_graph_bytes == 0
    graphs = llm.ranks[0].cuda_graph_bytes
    # 64 decode tokens through one layer's widest tensors (fp16) plus their fp32 logits
    qkv = (m["nh"] + 2 * m["nkv"]) * m["hd"]
    width = 2 * m["H"] + qkv + m["nh"] * m["hd"] + 2 * m["I"]
    assert graphs == 64 * width * 2 + 64 * m["V"] * 4
    assert llm.ranks[0].free_bytes == engine.ranks[0].free_bytes - graphs
