"""The measured-kernel layer: AIConfigurator 0.12.0's per-operation database read from the installed package
(plan/perf/kernels.py) and the step built from it (plan/perf/kernel_step.py)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from toolchain import gpus
from toolchain.plan import calibration as cal
from toolchain.plan import perf
from toolchain.plan.perf import kernel_step
from toolchain.plan.perf import kernels as db
from toolchain.quant.view import Quantization, quantization_of

H100 = gpus.lookup("H100 80GB")
A100 = gpus.lookup("A100 80GB")


def _table_latency(system: str, dtype: str, m: int, n: int, k: int) -> float:
    t = db.table(system, "gemm", "gemm_perf")
    assert t is not None
    rows = pq.read_table(t.path, columns=["gemm_dtype", "m", "n", "k", "latency"]).to_pylist()
    return next(r["latency"] for r in rows if (r["gemm_dtype"], r["m"], r["n"], r["k"]) == (dtype, m, n, k))


def test_the_database_is_installed_and_its_newest_version_is_read():
    assert db.data_root() is not None, "make setup installs aiconfigurator-core 0.12.0"
    t = db.table("h100_sxm", "gemm", "gemm_perf")
    assert t is not None and t.version == "1.3.0rc20"
    assert db.table("a100_sxm", "gemm", "gemm_perf").version == "1.0.0"
    assert db.table("h100_pcie", "gemm", "gemm_perf") is None  # an empty directory in 0.12.0


def test_a_measured_gemm_is_the_tables_own_latency_and_interpolates_between_rows():
    sites = db.gemm_sites("h100_sxm", "fp8")
    assert sites is not None
    measured = _table_latency("h100_sxm", "fp8", 1024, 4096, 4096)
    ms, within = db.gemm_ms(H100, sites, "fp8", 1.0, 1024, 4096, 4096)
    assert within and ms == pytest.approx(max(measured, db.gemm_sol_ms(H100, "fp8", 1.0, 1024, 4096, 4096)))
    lo, hi = (db.gemm_ms(H100, sites, "fp8", 1.0, m, 4096, 4096)[0] for m in (1024, 1280))
    mid = db.gemm_ms(H100, sites, "fp8", 1.0, 1152, 4096, 4096)[0]
    assert min(lo, hi) <= mid <= max(lo, hi)


def test_past_the_largest_row_the_boundary_util_is_held():
    sites = db.gemm_sites("h100_sxm", "bfloat16")
    top = max(sites.sites[(4096, 4096)][0])
    at_top = db.gemm_ms(H100, sites, "fp16", 2.0, top, 4096, 4096)[0]
    twice = db.gemm_ms(H100, sites, "fp16", 2.0, 2 * top, 4096, 4096)[0]
    assert twice == pytest.approx(2 * at_top, rel=0.02)  # compute-bound: twice the rows, twice the time


def test_an_unmeasured_shape_borrows_the_nearest_sites_util():
    sites = db.gemm_sites("h100_sxm", "fp8")
    assert (28672, 4096) not in sites.sites  # Llama-3.1-8B's gate and up at TP1
    ms, within = db.gemm_ms(H100, sites, "fp8", 1.0, 512, 28672, 4096)
    assert within
    sol = db.gemm_sol_ms(H100, "fp8", 1.0, 512, 28672, 4096)
    utils = [db.gemm_sol_ms(H100, "fp8", 1.0, 512, *s) / db.gemm_ms(H100, sites, "fp8", 1.0, 512, *s)[0]
             for _, s in db.nearest_sites(sites, 28672, 4096)]
    assert min(utils) - 1e-9 <= sol / ms <= max(utils) + 1e-9
    # a shape far from every site still gets the nearest one's util, and says it lay outside the data
    assert db.gemm_ms(H100, sites, "fp8", 1.0, 512, 2 ** 20, 32)[1] is False


def test_no_kernel_is_faster_than_the_datasheet():
    # AIConfigurator 0.12.0's A100 generation-attention table (a `legacy` collection) reads faster than 2039 GB/s
    grid, _ = db.nearest_grid(db.attention_grids("a100_sxm", "generation", 128, "bfloat16"), 32, 8)
    kv_bytes = 128 * 2048 * 8 * 128 * 2 * 2  # batch x tokens x kv heads x head size x (K, V) x bf16
    assert db.grid_ms(grid, 128, 2048, lambda x: x) < kv_bytes / 2039e9 * 1e3
    p = cal.model_info("llama-3.1-8b").params
    cost = perf.stage_cost(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2, kv_bytes=2)
    _, generation = kernel_step.attention_ms(cost, cost.kernels, "a100_sxm", perf.generation_work(128, 2048), A100)
    assert generation >= 128 * 2048 * cost.kv_bytes_per_token / 2039e9 * 1e3 * (1 - 1e-9)


def _dep(model: str, gpu: str, method: str = "fp8", tp: int = 1) -> perf.Deployment:
    point = cal.Measured(model, gpu, method, tp, 1024, 1024, 8, 0.0, 0.0, "", "", "")
    dep = cal.measured_deployment(point, perf.DEFAULT_EFFICIENCY)
    return dep


def test_a_dense_deployment_on_a_measured_card_steps_on_measured_kernels():
    dep = _dep("llama-3.1-70b", "H100 80GB", tp=4)
    assert perf.measured_kernels(dep) and kernel_step.unmeasured(dep) is None
    row = perf.efficiency_of(dep.gpu, measured_kernels=True)
    assert row.kernels and row is not perf.efficiency_of(dep.gpu)
    step = perf.step_time(dep.stages[0], dep.gpu, perf.generation_work(64, 2048), math_precision="fp8", tp=4, eff=row)
    roof = perf.step_time(dep.stages[0], dep.gpu, perf.generation_work(64, 2048), math_precision="fp8", tp=4,
                          eff=perf.efficiency_of(dep.gpu))
    assert step.seconds != roof.seconds and step.comm_s > 0  # the all-reduce from its own table


def test_what_the_database_lacks_is_predicted_from_the_roofline_and_said_so():
    pcie = _dep("llama-3.1-8b", "H100 PCIe")
    assert not perf.measured_kernels(pcie)
    assert "no kernel data for H100 PCIe" in kernel_step.unmeasured(pcie)
    dense = cal.published_points(cal.PUBLISHED_V1_0)[0]
    basis = cal.predict_published(dense).basis
    assert "measured kernels (h200_sxm, TensorRT-LLM 1.3.0rc20" in basis and "extrapolated" not in basis


def test_a_missing_database_falls_back_to_the_roofline(monkeypatch):
    monkeypatch.setattr(db, "data_root", lambda: None)
    for fn in (db.gemm_sites, db.attention_grids, db.allreduce_curves, kernel_step._available):
        fn.cache_clear()
    try:
        dep = _dep("llama-3.1-8b", "H100 80GB")
        assert not perf.measured_kernels(dep)
        assert "not installed" in kernel_step.unmeasured(dep)
    finally:
        monkeypatch.undo()
        for fn in (db.gemm_sites, db.attention_grids, db.allreduce_curves, kernel_step._available):
            fn.cache_clear()


def test_each_path_and_release_takes_the_serving_costs_of_its_nearest_measured_runs():
    h200 = gpus.lookup("H200 141GB")
    assert perf.kernel_row(h200, "1.0", "pytorch")[0] == "H100 80GB"  # TensorRT-LLM 1.0.0rc3's runs
    assert perf.kernel_row(h200, None, "pytorch")[0] == "H200 141GB"  # what the toolchain deploys: the newest runs
    # no measured run covers the engine path: the nearest release's PyTorch serving costs stand in, and say so
    assert perf.kernel_row(h200, "0.17", "engine")[0] == "H100 80GB"
    assert perf.kernel_row(gpus.lookup("GB200 186GB"), None, "pytorch")[0] == "B200 180GB"
    assert {m["path"] for m in perf.KERNEL_ROW_META.values()} == {"pytorch"}
    v017 = cal.predict_published(cal.published_points(cal.PUBLISHED)[0]).basis
    v10 = cal.predict_published(cal.published_points(cal.PUBLISHED_V1_0)[0]).basis
    assert "H100 80GB's measured runs" in v017 and "the engine path has no measured runs here" in v017
    assert "H100 80GB's measured runs" in v10 and "has no measured runs here" not in v10


# ------------------------------------------------------------------------------------------- experts

SCOUT_FP8 = ("fp8", 5120, 8192, 1, 16)  # Llama 4 Scout's experts as the MoE table keys them: hidden, width, top 1 of 16


def _moe_rows(system: str, dtype: str, hidden: int, inter: int, topk: int, experts: int, moe_tp: int,
              moe_ep: int) -> dict[int, float]:
    """The MoE table's own latencies (ms) by num_tokens at one shape, at the distribution the lookup takes."""
    table, _ = db.moe_curves(system)
    assert table is not None
    rows = pq.read_table(table.path).to_pylist()
    key = (dtype, hidden, inter, topk, experts, moe_tp, moe_ep, db.MOE_DISTRIBUTION)
    return {r["num_tokens"]: r["latency"] for r in rows
            if (r["moe_dtype"], r["hidden_size"], r["inter_size"], r["topk"], r["num_experts"], r["moe_tp_size"],
                r["moe_ep_size"], r["distribution"]) == key and r["kernel_source"] != db.MOE_LOW_LATENCY}


def test_a_measured_moe_shape_is_the_tables_own_latency():
    # the current slot of query_versions.yaml, not the newest directory (1.3.0rc23 holds a few other shapes only)
    assert db.moe_curves("h200_sxm")[0].version == "1.3.0rc20"
    rows = _moe_rows("h200_sxm", *SCOUT_FP8, 4, 1)
    assert len(rows) > 20
    for tokens in (1, 64, 1024):
        assert db.moe_ms("h200_sxm", *SCOUT_FP8[:1], tokens, *SCOUT_FP8[1:], 4, 1) == rows[tokens]


def test_moe_latency_interpolates_along_the_tokens_and_grows_past_the_last_row():
    rows = _moe_rows("h100_sxm", *SCOUT_FP8, 4, 1)
    measured = sorted(rows)
    lo, hi = next((a, b) for a, b in zip(measured, measured[1:]) if b - a > 1 and a >= 64)
    mid = db.moe_ms("h100_sxm", "fp8", (lo + hi) / 2, *SCOUT_FP8[1:], 4, 1)
    assert min(rows[lo], rows[hi]) < mid < max(rows[lo], rows[hi])
    top = measured[-1]
    assert db.moe_ms("h100_sxm", "fp8", 2 * top, *SCOUT_FP8[1:], 4, 1) == pytest.approx(2 * rows[top])


def _published(model: str, gpu: str, method: str, tp: int, attention_dp: bool) -> cal.Published:
    return cal.Published(model, gpu, method, tp, 1024, 1024, 1.0, attention_dp=attention_dp, per_gpu=True,
                         path="pytorch", release="1.2")


def test_moe_families_step_on_measured_experts_where_the_table_has_their_shape():
    scout = cal.predict_published(_published("llama-4-scout", "H200 141GB", "fp8", 4, False)).basis
    assert "the experts from its TensorRT-LLM 1.3.0rc20 MoE table" in scout and "extrapolated" not in scout
    # gpt-oss's MXFP4 experts under attention DP (DEP2) on Hopper (W4A16) and on one Blackwell GPU (W4A8_MXFP8)
    for gpu, tp in (("H200 141GB", 2), ("B300 288GB", 1)):
        basis = cal.predict_published(_published("gpt-oss-120b", gpu, "mxfp4", tp, tp > 1)).basis
        assert "MoE table" in basis and "extrapolated" not in basis
    # DeepSeek's latent attention from the mla tables, its experts at DeepSeek's own routing skew
    r1 = cal.predict_published(_published("deepseek-r1", "H200 141GB", "fp8_block", 8, True)).basis
    assert "MoE table" in r1 and "extrapolated" not in r1


def test_an_moe_shape_the_table_lacks_falls_back_to_the_roofline_and_says_which():
    # the H100's w4a16_mxfp4 rows for gpt-oss-120b start at moe_ep 2: one GPU holding all 128 experts is not there
    assert db.moe_ms("h100_sxm", "w4a16_mxfp4", 64, 2880, 2880, 4, 128, 1, 2) is not None
    assert db.moe_ms("h100_sxm", "w4a16_mxfp4", 64, 2880, 2880, 4, 128, 1, 1) is None
    p = cal.model_info("gpt-oss-120b")
    spec = cal.spec_for("gpt-oss-120b", "H100 80GB", "mxfp4", 1, 1024, 1024, max_batch_size=64, max_num_tokens=8192,
                        kv_fraction=0.9)
    quant = quantization_of(spec.quantization, p.hf_config, hf_quant_config=p.hf_quant_config)
    dep, _ = perf.deployment(spec, p, quant, H100)
    assert not perf.measured_kernels(dep)
    why = kernel_step.unmeasured(dep)
    assert "MoE table has no w4a16_mxfp4 experts" in why and "moe_tp 1 x moe_ep 1 on H100 80GB" in why


def test_latent_attention_is_the_mla_tables_own_and_its_bmms_interpolate():
    table = db.table("h200_sxm", "mla", "generation_mla_perf")
    rows = pq.read_table(table.path).to_pylist()
    row = next(r for r in rows if (r["kv_cache_dtype"], r["num_heads"], r["batch_size"]) == ("fp8", 128, 64))
    grid, scale = db.nearest_grid(db.mla_grids("h200_sxm", "generation", "fp8"), 128, 1)
    assert scale == 1.0
    assert db.grid_ms(grid, 64, row["step"] + row["isl"], lambda x: x) == row["latency"]
    bmm = db.mla_bmm_curves("h200_sxm")
    pre, post = bmm[("mla_gen_pre", "fp8", 128)], bmm[("mla_gen_post", "fp8", 128)]
    i = pre[0].index(1024.0)
    assert db.mla_bmm_ms("h200_sxm", "fp8", 1024, 128) == pytest.approx(pre[1][i] + post[1][post[0].index(1024.0)])
    assert db.mla_bmm_ms("h200_sxm", "fp8", 1024, 3) is None  # no such head count measured


def test_deepseek_steps_on_measured_latent_attention_and_experts():
    p = cal.model_info("deepseek-r1").params
    cost = perf.stage_cost(p, tp=8, pp_rank=0, pp=1, quant=Quantization(method="fp8_block", kv_cache="fp8"),
                           dt_bytes=2, kv_bytes=1, moe_tp=1, moe_ep=8, attention_dp=True)
    k = cost.kernels
    assert k is not None and k.latent is not None and k.experts is not None
    assert (k.heads, k.kv_heads) == (128, 1)  # attention DP: every head on the rank
    assert k.gemms == ((1536 + 576, 7168), (128 * 192, 1536), (7168, 128 * 128))  # q_a+kv_a, q_b, o_proj
    assert k.latent.kv_b == (128 * 256, 512) and k.latent.bmm_dtype == "fp8"
    assert (k.experts.moe_ep, k.experts.layers, k.experts.distribution) == (8, 58, db.MLA_MOE_DISTRIBUTION)
    h200 = gpus.lookup("H200 141GB")
    assert kernel_step.available(cost, h200, 8)
    row = perf.efficiency_of(h200, measured_kernels=True)
    step = kernel_step.kernel_step_time(cost, h200, perf.generation_work(256, 2048), math_precision="fp8", tp=8,
                                        eff=row)
    # the experts see all 256 tokens, the latent attention each rank's 32 sequences
    own = kernel_step.attention_ms(cost, k, "h200_sxm", perf.generation_work(32, 2048), h200)[1]
    experts = db.moe_ms("h200_sxm", "fp8_block", 256, 7168, 2048, 8, 256, 1, 8, db.MLA_MOE_DISTRIBUTION) * 58
    assert step.kernels_s * 1e3 > (own * row.attention_scale + experts) * row.kernel_scale
