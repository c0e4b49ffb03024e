"""The performance model against public measurements (toolchain/plan/calibration.py).

Two sources, kept apart: AIConfigurator 0.12.0's measured TensorRT-LLM runs (data/silicon_points.json), to which
tools/fit_efficiency.py fits the efficiency table on a training split, and NVIDIA's published trtllm-bench table
(data/published_throughput.json, perf-overview.md of release 0.17), which is never fitted to and only checks
the result against the issue's target: the maximum throughput within +-20% on at least 80% of the Llama 3.1
8B/70B/405B points on H100/H200/A100, a median error of at most 15%, and the published ranking of TP choices.
release/1.2's Blackwell NVFP4 points and its mixture-of-experts points (DeepSeek R1 at attention DP, gpt-oss-120b
at DEP2 and TP1) are checked apart, against loose bounds the model meets as measured (never fitted)."""

from __future__ import annotations

import ast
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from toolchain import gpus
from toolchain.plan import calibration as cal
from toolchain.plan import perf

REPO = Path(__file__).resolve().parents[1]


def _checked(path: Path = cal.PUBLISHED) -> list:
    """(point, predicted max output tokens/s, signed error in %) for every point of a published table."""
    return [(pt, pred, (pred - pt.output_tokens_per_s) / pt.output_tokens_per_s * 100)
            for pt, pred in cal.published_check(path)]


@pytest.fixture(scope="module")
def published():
    return _checked()


def test_published_points_cover_the_issue_grid(published):
    points = [pt for pt, _, _ in published]
    assert {pt.model for pt in points} == {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"}
    assert {pt.gpu for pt in points} == {"H100 80GB", "H200 141GB", "A100 80GB"}
    assert {pt.tp for pt in points} == {1, 2, 4, 8}
    assert len(points) == 131  # 15 columns of 9 ISL/OSL mixes, 4 cells empty in the published table


def test_published_median_error_within_15_percent(published):
    assert statistics.median(abs(e) for _, _, e in published) <= 15


def test_published_tp_ranking_is_kept(published):
    groups = defaultdict(list)
    for pt, pred, _ in published:
        groups[(pt.model, pt.gpu, pt.isl, pt.osl)].append((pt.tp, pt.output_tokens_per_s, pred))
    compared = 0
    for key, rows in groups.items():
        if len(rows) < 2:
            continue
        compared += 1
        by_published = [tp for tp, _, _ in sorted(rows, key=lambda r: r[1])]
        by_predicted = [tp for tp, _, _ in sorted(rows, key=lambda r: r[2])]
        assert by_predicted == by_published, (key, rows)
    assert compared == 27


def _share_within_20(published) -> float:
    return sum(abs(e) <= 20 for _, _, e in published) / len(published)


def test_published_share_within_20_percent_does_not_regress(published):
    # 112 of 131 (85.5%) on the measured kernels (97, 74%, on the roofline before them); the misses are mostly
    # A100 (no end-to-end measurements there) and the 8B at batches over 1000 (the measured concurrencies end at 128)
    assert _share_within_20(published) >= 0.85


def test_published_share_within_20_percent_meets_the_target(published):
    assert _share_within_20(published) >= 0.80


def test_stored_holdout_error_is_what_the_committed_points_give():
    stored = json.loads(cal.EFFICIENCY_FILE.read_text())["holdout_mape"]
    again = cal.holdout_mape()
    for key in ("ttft", "tpot", "throughput"):
        assert again[key] == pytest.approx(stored[key], abs=0.01), key
    assert again["gpu_holdout_mape"] == pytest.approx((again["ttft"] + again["tpot"] + again["throughput"]) / 3)


def test_perf_loads_the_fitted_rows_and_names_them():
    doc = json.loads(cal.EFFICIENCY_FILE.read_text())
    for arch, row in doc["rows"].items():
        assert perf.EFFICIENCY[arch] == perf.Efficiency(**row)
    # a generation without end-to-end measurements takes Hopper's row scaled by its card's GEMM efficiencies in
    # AIConfigurator's kernel measurements over Hopper's, and says so
    kernels = json.loads((cal.DATA / "kernel_efficiency.json").read_text())["cards"]
    hopper = {f: (kernels["H100 80GB"][f] + kernels["H200 141GB"][f]) / 2 for f in ("bandwidth", "compute")}
    a100 = gpus.lookup("A100")
    row, fitted = perf.efficiency_of(a100), perf.EFFICIENCY["Hopper"]
    assert row.bandwidth == pytest.approx(fitted.bandwidth * kernels["A100 80GB"]["bandwidth"] / hopper["bandwidth"],
                                          abs=1e-4)
    assert row.compute == pytest.approx(fitted.compute * kernels["A100 80GB"]["compute"] / hopper["compute"], abs=1e-4)
    assert (row.fixed_us, row.seq_us, row.ttft_ms) == (fitted.fixed_us, fitted.seq_us, fitted.ttft_ms)
    assert "A100 80GB's GEMM efficiencies over Hopper's" in perf.basis_of(a100)
    assert perf.efficiency_of(gpus.lookup("L4")) == perf.EFFICIENCY["Ada"] != fitted
    h100 = perf.basis_of(gpus.lookup("H100"))
    assert h100.startswith(perf.BASIS) and "TensorRT-LLM 1.0.0rc3" in h100
    assert f"throughput {doc['roofline_holdout_mape']['throughput']:.0f}%" in h100  # the roofline row's own error
    assert "(not measured)" in perf.basis_of(gpus.lookup("H100 PCIe"))


def test_split_holds_out_whole_configurations():
    points = cal.measured_points()
    sides = defaultdict(set)
    for pt in points:
        sides[pt.config].add(cal.held_out(pt))
    assert all(len(s) == 1 for s in sides.values())  # no configuration on both sides
    held = [c for c, s in sides.items() if True in s]
    assert len(held) == len(sides) // cal.HOLDOUT_EVERY
    # every model and GPU has configurations on both sides
    for group in {(c[0], c[1]) for c in sides}:
        assert {True, False} <= {True in sides[c] for c in sides if (c[0], c[1]) == group}


def test_the_fit_never_reads_the_published_figures():
    tree = ast.parse((REPO / "tools" / "fit_efficiency.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {n for n in names if "published" in n.lower() or n == "PUBLISHED"}


def test_measured_throughput_is_the_closed_loop_rate():
    pt = cal.measured_points()[0]
    latency_s = (pt.ttft_ms + (pt.osl - 1) * pt.tpot_ms) / 1e3
    assert pt.throughput == pytest.approx(pt.concurrency * pt.osl / latency_s)


def test_requests_beyond_the_kv_cache_wait_by_littles_law():
    point = next(p for p in cal.measured_points()
                 if p.config == ("llama-3.1-70b", "B200 180GB", "fp8", 1, 1024, 8192) and p.concurrency == 128)
    running = cal._kv_requests(*point.config)
    assert running < point.concurrency  # 69 requests of 9216 tokens fit the FP8 KV cache of one B200
    # the measured-kernel row of the card's own runs
    eff = perf.measured_row(point.gpu, "pytorch")
    assert eff.kernels and eff == perf.KERNEL_ROWS[point.gpu]
    # the run's waves counted at the requests that run at once (calibration.WAVES)
    workload = perf.Workload(1024, 8192, cal.MAX_NUM_TOKENS, requests=cal.WAVES * running)
    at = perf.steady_state(cal.measured_deployment(point, eff), workload, running)
    service_ms = at.ttft_s * 1e3 + 8191 * at.tpot_s * 1e3
    ttft, tpot, _ = cal.predict_measured(point)
    assert tpot == pytest.approx(at.tpot_s * 1e3)
    assert ttft == pytest.approx(at.ttft_s * 1e3 + (128 / running - 1) * service_ms)
    assert ttft > 60_000  # measured: 136.6 s


def test_trtllm_bench_build_limits_by_hand():
    point = cal.Published("llama-3.1-8b", "H100 80GB", "fp8", 1, 1000, 1000, 15244.78)
    # 8,030,261,248 parameters (embedding and lm_head 2 x 128256 x 4096, 32 layers of 218,112,000, a norm): 8.03 GB
    # at a byte each; 81559 MiB = 79.647 GiB; 65536 bytes of FP8 KV per token (2 x 32 layers x 8 heads x 128).
    assert cal.param_count(cal.model_info("llama-3.1-8b").params) == 8_030_261_248
    requests = (81559 / 1024 - 8.030261248) * 0.95 / (65536 / 1024 ** 3) / 2000  # 557.4
    assert 557 < requests < 558
    # batch: 557.4 is in [256, 1024) -> 128 x ceil(557.4 / 128) = 640; tokens: 557.4 x 2 < 4096 -> the 2048 floor
    assert cal.bench_build_limits(point) == (640, 2048)


# -- release/1.2's Blackwell NVFP4 points (data/published_blackwell_fp4.json), checked apart ---------------------

@pytest.fixture(scope="module")
def published_fp4():
    return _checked(cal.PUBLISHED_BLACKWELL_FP4)


def test_blackwell_fp4_points_cover_three_cards_and_four_mixes(published_fp4):
    points = [pt for pt, _, _ in published_fp4]
    assert {pt.gpu for pt in points} == {"B200 180GB", "GB200 186GB", "B300 288GB"}
    assert {(pt.isl, pt.osl) for pt in points} == {(1024, 1024), (1024, 8192), (8192, 1024), (32768, 1024)}
    assert {(pt.method, pt.tp) for pt in points} == {("nvfp4", 1)}
    # Those cards' FP4 tensor-core peaks are what the prediction multiplies in (quant/formats.py math "fp4").
    assert all(gpus.lookup(g).peak("fp4") for g in {pt.gpu for pt in points})


def test_blackwell_fp4_prediction_error(published_fp4):
    """Measured 2026-12-06: median |error| 9.6%, 10 of 12 points within +-20%; the prefill-heavy 8192/1024 mix is
    over-predicted most (+24% on B200, +28% on B300). A regression past these bounds fails."""
    errors = [e for _, _, e in published_fp4]
    assert statistics.median(abs(e) for e in errors) <= 12
    assert sum(abs(e) <= 20 for e in errors) >= 10
    assert max(abs(e) for e in errors) <= 35


# -- release/1.2's mixture-of-experts points (data/published_moe_families.json), checked apart -------------------

@pytest.fixture(scope="module")
def published_moe():
    return _checked(cal.PUBLISHED_MOE_FAMILIES)


def _of(published_moe, model: str) -> list:
    return [row for row in published_moe if row[0].model == model]


def test_moe_family_points_are_deepseek_gpt_oss_and_llama4_and_list_what_waits(published_moe):
    points = [pt for pt, _, _ in published_moe]
    assert {(pt.model, pt.gpu, pt.method, pt.tp, pt.attention_dp) for pt in points} == {
        ("deepseek-r1", "B200 180GB", "nvfp4", 4, True), ("deepseek-r1", "B300 288GB", "nvfp4", 4, True),
        ("deepseek-r1", "GB200 186GB", "nvfp4", 4, True), ("deepseek-r1", "H200 141GB", "fp8_block", 8, True),
        ("gpt-oss-120b", "B200 180GB", "mxfp4", 2, True), ("gpt-oss-120b", "H200 141GB", "mxfp4", 2, True),
        ("gpt-oss-120b", "B300 288GB", "mxfp4", 1, False), ("gpt-oss-120b", "GB200 186GB", "mxfp4", 1, False),
        ("llama-4-scout", "H200 141GB", "fp8", 4, False), ("llama-4-scout", "H100 80GB", "fp8", 4, False)}
    assert len(_of(published_moe, "deepseek-r1")) == 14 and len(_of(published_moe, "gpt-oss-120b")) == 19
    assert len(_of(published_moe, "llama-4-scout")) == 18
    assert all(pt.per_gpu for pt in points)
    # the KV cache as published: FP8 everywhere but gpt-oss on Hopper (auto, the model's bf16)
    assert {pt.kv_cache for pt in points if pt.model == "gpt-oss-120b" and pt.gpu.startswith("H")} == {"none"}
    assert {pt.kv_cache for pt in points if pt.model != "gpt-oss-120b" or not pt.gpu.startswith("H")} == {"fp8"}
    doc = json.loads(cal.PUBLISHED_MOE_FAMILIES.read_text())
    assert "NEVER fitted" in doc["use"]
    assert "Waiting for: gpt-oss-20b" in doc["kept"] and "Waiting for: Llama 4 Scout's B200/GB200" in doc["kept"]
    assert "Modelled with a bf16 KV cache on every card" in doc["kept"]


def test_gpt_oss_points_plan_the_kv_cache_the_planner_allows():
    """The Blackwell gpt-oss points ran with an FP8 KV cache, which the planner refuses on the stored MXFP4
    checkpoint (no k_scale / v_scale to import, no calibration of a pre-quantized one): the check plans them with
    the bf16 KV cache instead, as the file's `kept` says. When the planner takes FP8 KV here, plan them with it."""
    from toolchain.errors import ToolchainError
    from toolchain.quant.view import quantization_of

    released = json.loads((REPO / "build" / "configs" / "gpt-oss-120b" / "config.json").read_text())
    assert json.loads((cal.MODELS / "gpt-oss-120b" / "config.json").read_text()) == released  # the copy is whole
    info = cal.model_info("gpt-oss-120b")
    spec = cal.spec_for("gpt-oss-120b", "B200 180GB", "mxfp4", 2, 1024, 1024, max_batch_size=64,
                        max_num_tokens=8192, kv_fraction=0.95, target="llmapi", attention_dp=True)
    assert (spec.quantization.method, spec.quantization.kv_cache) == ("none", "none")
    assert quantization_of(spec.quantization, info.hf_config).format.name == "mxfp4"
    fp8_kv = spec.quantization.model_copy(update={"kv_cache": "fp8"})
    with pytest.raises(ToolchainError, match="carries no FP8 KV-cache scales"):
        quantization_of(fp8_kv, info.hf_config)


def test_moe_family_prediction_error(published_moe):
    """DeepSeek R1 on measured kernels (latent attention from AIConfigurator's mla tables, the experts from its MoE
    table at DeepSeek's power_law_1.01 skew, each DEP rank's own share of the attention), measured 2026-12-07: every
    point over-predicted, +22% to +87%, median +44% (+53% on the roofline), worst +87% (GB200 1024/1024; +132% at
    H200 1024/1024 on the roofline), 2 of 14 within +-30% (6 on the roofline, whose long-output Blackwell points
    sat near +10% to +20%). The GB200's and B300's MoE rows time the experts about 40% faster than the B200's
    where the published GB200 runs no faster than the B200; the serving costs are the dense rows' (B200's kernel
    scale 0.78, fitted to Llama-3.1-70B), and the experts' all-to-all stays the roofline's. Loose bounds the model
    meets, only to catch a regression (checking, never fitted)."""
    errors = [e for _, _, e in _of(published_moe, "deepseek-r1")]
    assert all(e > 0 for e in errors)
    assert statistics.median(abs(e) for e in errors) <= 50
    assert max(abs(e) for e in errors) <= 100
    assert sum(abs(e) <= 30 for e in errors) >= 2


def test_gpt_oss_prediction_error(published_moe):
    """gpt-oss-120b on measured kernels (the MXFP4 experts from AIConfigurator's MoE table: W4A16 on H200, W4A8 on
    Blackwell; DEP2 with each rank's own share of the attention), measured 2026-12-07: median |error| 21% (34% on
    the roofline), worst +43% (H200 1024/8192), 16 of 19 points within +-30%. Blackwell is under-predicted (-3% to
    -33%, worst on the prefill-heavy 8192/1024 and 32768/1024 at TP1): planned with a bf16 KV cache against the
    published FP8 one, so a rank holds half the requests. H200 is over-predicted (+4% to +43%; the published run
    used the TRITON MoE backend, the table times TensorRT-LLM's own). Loose bounds the model meets, only to catch a
    regression (checking, never fitted)."""
    rows = _of(published_moe, "gpt-oss-120b")
    errors = [e for _, _, e in rows]
    assert statistics.median(abs(e) for e in errors) <= 25
    assert max(abs(e) for e in errors) <= 50
    assert sum(abs(e) <= 30 for e in errors) >= 14
    assert all(e > 0 for pt, _, e in rows if pt.gpu == "H200 141GB")
    assert all(e < 0 for pt, _, e in rows if pt.gpu != "H200 141GB")


def test_llama4_scout_prediction_error(published_moe):
    """Llama 4 Scout at TP4 FP8 (the v1.0 table's totals over 4 GPUs) on measured kernels (the experts from
    AIConfigurator's MoE table at moe_tp 4), measured 2026-12-07: median |error| 33% (32% on the roofline), 8 of 18
    within +-30%, worst +104% (H100 128/4096). Every point is over-predicted: H200 by +7% to +34% but +74% at
    20000/2000, H100 by +33% to +104% (+23% to +56% on the roofline). The H100's published figures are under half
    the H200's while its planned batch is half of the H200's and its step about as long per request, so the
    surplus is in the batch the H100 held rather than in the kernels (UNVERIFIED: the published runs name no batch).
    Loose bounds the model meets, only to catch a regression (checking, never fitted)."""
    rows = _of(published_moe, "llama-4-scout")
    errors = [e for _, _, e in rows]
    assert statistics.median(abs(e) for e in errors) <= 40
    assert max(abs(e) for e in errors) <= 110
    assert sum(abs(e) <= 30 for e in errors) >= 6
    assert all(e > 0 for _, _, e in rows)


def test_moe_family_keeps_b300_above_b200(published_moe):
    """DeepSeek R1 runs DEP4 on both cards; gpt-oss runs DEP2 on B200 but TP1 on B300, so its cards are not compared."""
    by = {(pt.gpu, pt.isl, pt.osl): (pt.output_tokens_per_s, pred) for pt, pred, _ in _of(published_moe, "deepseek-r1")}
    for (gpu, isl, osl), (published, predicted) in by.items():
        if gpu == "B300 288GB":
            b200 = by[("B200 180GB", isl, osl)]
            assert published > b200[0] and predicted > b200[1], (isl, osl)
