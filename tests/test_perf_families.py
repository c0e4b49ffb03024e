"""The performance model's per-family costs (toolchain/plan/perf/attention.py, step.py): multi-head latent
attention's two forms, sliding windows and chunks, active and routed experts, and attention DP's per-rank work
and expert exchange, each against a hand computation on the published configs' shapes (build/configs), with every
efficiency at 1 (a pure roofline) where a time is computed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from toolchain import gpus
from toolchain.plan import perf
from toolchain.plan.model import load_model
from toolchain.plan.perf.attention import Span, layer_caps
from toolchain.plan.perf.step import attention_load, exchange_tokens
from toolchain.quant.view import Quantization

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "build" / "configs"
ROOF = perf.Efficiency(1.0, 1.0, 1.0)
B200 = gpus.lookup("B200")


def _params(name: str):
    return load_model(CONFIGS / name).params


def _cost(p, tp=1, kv=1, **kw):
    return perf.stage_cost(p, tp=tp, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2, kv_bytes=kv, **kw)


@pytest.fixture(scope="module")
def deepseek():
    return _params("deepseek-r1")  # 61 layers (3 dense), 128 heads, MLA 1536/512/128/64/128, 256 experts top 8


@pytest.fixture(scope="module")
def gpt_oss():
    return _params("gpt-oss-120b")  # 36 layers, 64 heads of 64 over 8 KV heads, window 128 on even layers


@pytest.fixture(scope="module")
def scout():
    return _params("llama-4-scout-17b-16e-instruct")  # 48 layers, every 4th NoPE, chunks of 8192 elsewhere


# -- multi-head latent attention ----------------------------------------------------------------------------------

def test_mla_attention_flops_by_hand(deepseek):
    cost = _cost(deepseek, tp=8)  # 16 heads per rank
    # absorbed (generation): scores over the latent and rope key (512 + 64), the sum over the latent (512)
    generation = 2 * 16 * (512 + 64) + 2 * 16 * 512  # 34,816 per layer
    # plain (context): scores over qk_nope + qk_rope (128 + 64), the sum over v_head_dim (128)
    context = 2 * 16 * (128 + 64) + 2 * 16 * 128  # 10,240 per layer
    expand = 2 * 16 * (128 + 128) * 512  # kv_b over one cached latent: 4,194,304 per layer
    assert cost.attention_flops == generation * 61
    assert cost.context_attention_flops == context * 61
    assert cost.expand_flops == expand * 61
    assert cost.kv_bytes_per_token == 61 * 576  # one fp8 latent of 512 + 64 per layer, whole on every rank

    kv, flops = attention_load(cost, perf.generation_work(2, 1000))
    assert kv == (2 * 1000 + 2) * 61 * 576
    assert flops == 2 * 1000 * generation * 61
    # a 100-token chunk after 50 cached: 100 x 50 + 5050 pairs in the plain form, the 50 latents up-projected
    kv, flops = attention_load(cost, perf.context_work(100, 50))
    assert kv == (50 + 100) * 61 * 576
    assert flops == pytest.approx((100 * 50 + 5050) * context * 61 + 50 * expand * 61)


def test_multi_head_attention_keeps_one_form(gpt_oss):
    cost = _cost(dataclasses.replace(gpt_oss, extras_json=None), tp=2)
    assert cost.attention_flops == 4 * 32 * 64 * 36 and cost.context_attention_flops is None
    assert cost.expand_flops == 0 and cost.caps == ()
    work = perf.add(perf.generation_work(3, 700), perf.context_work(64, 10))
    assert attention_load(cost, work) == ((work.kv_read + work.tokens) * cost.kv_bytes_per_token,
                                          work.pairs * cost.attention_flops)


# -- windows and chunks -------------------------------------------------------------------------------------------

def test_caps_per_family(gpt_oss, scout, deepseek):
    assert layer_caps(gpt_oss, range(36)) == ((128, 18), (None, 18))
    assert layer_caps(gpt_oss, range(1, 2)) == ()  # an odd layer alone attends in full: nothing capped
    assert layer_caps(scout, range(48)) == ((8192, 36), (None, 12))  # rope layers chunked, NoPE layers full
    assert layer_caps(_params("gemma-2-9b-it"), range(42)) == ((4096, 21), (None, 21))
    assert layer_caps(deepseek, range(61)) == ()
    assert layer_caps(_params("llama-3-8b-instruct"), range(32)) == ()


def test_span_under_a_cap_by_hand():
    prompt = Span(1, 0, 1000, causal=True)
    assert prompt.pairs(None) == 1000 * 1001 / 2
    assert prompt.pairs(128) == 128 * 129 / 2 + (1000 - 128) * 128  # the first 128 tokens see all before them
    later = Span(2, 300, 100, causal=True)  # a chunk after 300 cached, each token past the window of 128
    assert later.pairs(128) == 2 * 100 * 128 and later.kv_read(128) == 2 * 128
    decode = Span(4, 32768, 1, causal=False)
    assert decode.pairs(128) == 4 * 128 and decode.kv_read(8192) == 4 * 8192 and decode.kv_read(None) == 4 * 32768


def test_gpt_oss_window_by_hand_and_far_less_kv_at_32k(gpt_oss):
    cost = _cost(gpt_oss)
    per_layer = 2 * 8 * 64  # K and V of 8 heads of 64, fp8
    assert cost.kv_bytes_per_token == 36 * per_layer and cost.caps == ((128, 18), (None, 18))
    kv, flops = attention_load(cost, perf.generation_work(8, 32768))
    assert kv == (18 * 8 * 128 + 18 * 8 * 32768 + 36 * 8) * per_layer
    assert flops == 8 * (18 * 128 + 18 * 32768) * 4 * 64 * 64

    unwindowed = _cost(dataclasses.replace(gpt_oss, extras_json=None))
    kv_full, flops_full = attention_load(unwindowed, perf.generation_work(8, 32768))
    assert kv / kv_full < 0.51 and flops / flops_full < 0.51  # half the layers read 128 tokens, not 32768
    # and a generation step at 32k saves those bytes' time on a B200
    work = perf.generation_work(64, 32768)
    step = perf.gpu_step_time(cost, B200, work, eff=ROOF)
    full = perf.gpu_step_time(unwindowed, B200, work, eff=ROOF)
    saved = 64 * 18 * (32768 - 128) * per_layer / (B200.bandwidth_gb_s * 1e9)
    assert full.memory_s - step.memory_s == pytest.approx(saved) and step.seconds < full.seconds - 0.9 * saved


def test_llama4_chunks_cap_the_rope_layers(scout):
    cost = _cost(scout, tp=8)  # one KV head of 128 per rank
    per_layer = 2 * 1 * 128
    kv, _ = attention_load(cost, perf.generation_work(1, 20000))
    assert kv == (36 * 8192 + 12 * 20000 + 48) * per_layer
    kv_short, _ = attention_load(cost, perf.generation_work(1, 4000))  # below a chunk every layer reads it all
    assert kv_short == (4000 + 1) * 48 * per_layer


def test_steady_state_prompt_spans_match_the_totals():
    w = perf.Workload(5000, 100, 2048)
    spans = w.prompt_spans(3)
    assert [(s.start, s.tokens) for s in spans] == [(0, 2048), (2048, 2048), (4096, 904)]
    assert sum(s.kv_read(None) for s in spans) == 3 * w.prior_tokens
    assert sum(s.pairs(None) for s in spans) == 3 * 5000 * 5001 / 2


# -- experts ------------------------------------------------------------------------------------------------------

def test_deepseek_experts_by_hand(deepseek):
    cost = _cost(deepseek, tp=4, moe_ep=4, moe_tp=1, attention_dp=True)
    moe_layers = 61 - 3
    assert cost.moe_layers == moe_layers and cost.experts == 64 and cost.expert_share == 8 / 256
    routed = 2 * 3 * 2048 * 7168 * 8 / 4 * moe_layers  # top 8 of 256, a quarter of them on this rank
    assert cost.expert_flops == routed
    # the rest per own token: MLA's projections and the dense MLPs whole (attention DP), the router and the
    # shared expert (2048 wide, no gate) whole
    mla = (128 * 192 * 1536 + 1536 * 7168 + 576 * 7168 + 128 * 256 * 512 + 7168 * 128 * 128)
    dense = 3 * 18432 * 7168
    per_own = 2 * (mla * 61 + dense * 3 + (256 * 7168 + 3 * 2048 * 7168) * moe_layers)
    assert cost.gemm_flops - cost.expert_flops == pytest.approx(per_own)
    assert cost.expert_bytes == 3 * 2048 * 7168 * 2 * moe_layers  # one bf16 expert over the MoE layers


def test_exchange_tokens_take_the_cheaper_collective():
    assert exchange_tokens(8, 4, 4) == 3  # top 8 over 4 ranks: the all-gather (3 tokens) beats 8 x 3/4
    assert exchange_tokens(4, 2, 2) == 1  # gpt-oss DEP2
    assert exchange_tokens(8, 16, 16) == 8 * 15 / 16  # past top_k ranks the all-to-all wins
    assert exchange_tokens(2, 8, 4) == 7  # experts not spread over every rank: the all-gather
    assert exchange_tokens(8, 1, 1) == 0


# -- attention DP -------------------------------------------------------------------------------------------------

def test_attention_dp_runs_own_requests_whole_without_allreduce(deepseek):
    adp = _cost(deepseek, tp=4, moe_ep=4, moe_tp=1, attention_dp=True)
    one = _cost(deepseek, tp=1)
    assert adp.dp == 4 and adp.attention_flops == one.attention_flops  # every head on each rank
    assert adp.kv_bytes_per_token == one.kv_bytes_per_token
    work = perf.generation_work(400, 2000)
    # each rank's attention is a quarter of the batch with every head: tp 1's attention of 100 sequences
    assert attention_load(adp, work.scaled(1 / 4)) == attention_load(one, perf.generation_work(100, 2000))

    step = perf.gpu_step_time(adp, B200, work, tp=4, eff=ROOF)
    link = B200.link
    assert link is not None
    # no all-reduce: per MoE layer a dispatch and a combine of 100 own tokens x 3 (the all-gather) x 7168 x 2 B
    exchange = link.latency_us * 1e-6 + 100 * 3 * 7168 * 2 / (link.gb_s * 1e9)
    assert step.comm_s == pytest.approx(2 * 58 * exchange)
    tp4 = _cost(deepseek, tp=4, moe_ep=4, moe_tp=1)
    plain = perf.gpu_step_time(tp4, B200, work, tp=4, eff=ROOF)
    assert plain.comm_s == pytest.approx(2 * 61 * perf.allreduce_seconds(400 * 7168 * 2, 4, link))
    # the same batch costs each rank a quarter of the attention and dense linears, all of its experts' tokens
    expected = (100 * (adp.gemm_flops - adp.expert_flops) + 400 * adp.expert_flops) / (B200.peak("fp16") * 1e12)
    lm = 100 * adp.lm_head_flops / (B200.peak("fp16") * 1e12)
    _, attn = attention_load(adp, work.scaled(1 / 4))
    assert step.compute_s == pytest.approx(expected + lm + attn / (B200.peak("fp16") * 1e12))


def test_attention_dp_limits_are_per_rank(tmp_path, deepseek):
    from toolchain.plan.plan import plan_memory
    from toolchain.quant.view import quantization_of
    from toolchain.spec import spec_from_dict

    model = tmp_path / "deepseek"
    model.mkdir()
    cfg = json.loads((CONFIGS / "deepseek-r1" / "config.json").read_text())
    cfg.pop("quantization_config")
    (model / "config.json").write_text(json.dumps(cfg))
    data = {"name": "dsr1", "target": "llmapi", "model": {"checkpoint": str(model), "dtype": "bfloat16"},
            "quantization": {"method": "nvfp4", "kv_cache": "fp8"},
            "parallelism": {"tp": 4, "pp": 1, "gpus": 4, "attention_dp": True, "moe_ep": 4, "moe_tp": 1},
            "gpu": {"name": "B200", "per_node": 8},
            "limits": {"max_batch_size": 64, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 4096},
            "validation": {"workload": {"input_tokens": 1024, "output_tokens": 1024, "concurrency": 8}}}
    spec = spec_from_dict(data, tmp_path, "test")
    info = load_model(model)
    quant = quantization_of(spec.quantization, info.hf_config, hf_quant_config=info.hf_quant_config)
    memory = plan_memory(spec, info, quant, B200, suggest=False)
    got = perf.predict(spec, info, quant, B200, memory)
    assert (got.batch_limit, got.batch_limited_by) == (4 * 64, "max_batch_size")  # 64 on each of 4 ranks


def test_the_cpu_engine_is_costed_as_its_tp_split_under_attention_dp(tmp_path):
    """llmapi-cpu accepts enable_attention_dp but runs attention split over tp (llmapi/cpu_llm.py
    _check_attention_dp): its host prediction keeps the tp split's costs; a GPU replica takes attention DP's."""
    import yaml

    from test_probe_host import hand_profile
    from toolchain.spec import load_spec

    tiny = REPO / "models" / "tiny-mixtral"
    if not tiny.exists():
        pytest.skip("models/tiny-mixtral is not linked into this checkout")

    def spec(target: str, adp: bool):
        data = {"name": "adp", "target": target, "model": {"checkpoint": str(tiny), "dtype": "float16"},
                "gpu": {"name": "H100 80GB"}, "parallelism": {"tp": 2, "attention_dp": adp}}
        path = tmp_path / f"{target}-{adp}.yaml"
        path.write_text(yaml.safe_dump(data))
        return load_spec(path)

    model = load_model(tiny)
    cpu = [perf.deployment(spec("llmapi-cpu", adp), model, Quantization(), gpus.lookup("H100"),
                           profile=hand_profile())[0].stages[0] for adp in (False, True)]
    assert cpu[0] == cpu[1] and cpu[1].dp == 1
    gpu = perf.deployment(spec("llmapi", True), model, Quantization(), gpus.lookup("H100"))[0].stages[0]
    assert gpu.dp == 2 and gpu.attention_flops == 2 * cpu[0].attention_flops  # every head on each rank
