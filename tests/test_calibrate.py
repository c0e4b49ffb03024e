"""`toolchain calibrate`: reports of the three formats synthesized from NVIDIA's published points (held out of the
fit) and from a known row, the refit of a device row, the cache row later plans read, and every refusal.

Each test points the user's cache at its own tmp_path ($XDG_CACHE_HOME, as tests/test_probe_host.py does), so no
developer's calibrated row is ever read or written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from toolchain import gpus
from toolchain.cli import main
from toolchain.plan import calibration as cal
from toolchain.plan import perf
from toolchain.plan.calibrate import calibrate, case_of, complete, errors_pct, mean
from toolchain.plan.perf import calibrated as calrow
from toolchain.plan.plan import plan_memory
from toolchain.plan.reports import AIPERF, TOOLCHAIN_BENCH, TRTLLM_BENCH, Facts, gpu_named, read_report
from toolchain.quant.view import quantization_of
from toolchain.versions import TRTLLM_VERSION

H100 = "H100 80GB"
HF_NAMES = {"llama-3.1-8b": "nvidia/Llama-3.1-8B-Instruct-FP8", "llama-3.1-70b": "nvidia/Llama-3.3-70B-Instruct-FP8"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache of this test's own; the calibrated rows go to its calibrated/ folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(calrow.IGNORE_ENV, raising=False)
    return tmp_path / "cache" / "trtllm-toolchain" / "calibrated"


def trtllm_bench_report(pt: cal.Published, version: str, backend: str = "Pytorch", machine: bool = True) -> dict:
    """A trtllm-bench --report_json of a published maximum-throughput point, laid out as
    tensorrt_llm/bench/dataclasses/reporting.py get_statistics_dict writes it (max_batch_size and max_num_tokens
    left unset: the published runs let trtllm-bench's heuristic choose them)."""
    return {
        "engine": {"model": HF_NAMES[pt.model], "model_path": None, "engine_dir": None, "version": version,
                   "backend": backend, "dtype": "bfloat16", "kv_cache_dtype": "FP8", "quantization": "FP8"},
        "machine": {"name": "NVIDIA H100 80GB HBM3", "memory.total": 79.6, "clocks.mem": 2.619} if machine else None,
        "world_info": {"tp_size": pt.tp, "pp_size": 1, "ep_size": 1, "world_size": pt.tp, "max_batch_size": None,
                       "max_num_tokens": None, "scheduling_policy": "GUARANTEED_NO_EVICT",
                       "kv_cache_percentage": 0.95, "issue_rate": 1e12},
        "request_info": {"num_requests": 1500, "avg_num_concurrent_requests": 400.0, "avg_input_length": pt.isl,
                         "avg_output_length": pt.osl},
        "performance": {"total_latency_ms": 1e5, "system_output_throughput_tok_s": pt.output_tokens_per_s,
                        "output_throughput_per_gpu_tok_s": pt.output_tokens_per_s / pt.tp},
        "dataset": {"avg_isl": pt.isl, "avg_osl": pt.osl, "max_isl": pt.isl, "max_osl": pt.osl, "num_requests": 1500},
    }


def write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def v1_0_h100() -> list[cal.Published]:
    """release 1.0's H100 8B (TP1) and 70B (TP2) points, PyTorch path."""
    return [p for p in cal.published_points(cal.PUBLISHED_V1_0) if p.gpu == H100 and p.model in HF_NAMES]


def v0_17_h100() -> list[cal.Published]:
    """release 0.17's H100 8B TP1 and 70B TP2 points, engine path (trtllm-bench build)."""
    return [p for p in cal.published_points(cal.PUBLISHED) if p.gpu == H100 and p.model in HF_NAMES
            and p.tp == (1 if p.model == "llama-3.1-8b" else 2)]


# ------------------------------------------------------------------------------- the fit on held-out points


@pytest.mark.parametrize("points, release, backend, path", [(v1_0_h100, "1.0", "Pytorch", "pytorch"),
                                                            (v0_17_h100, "0.17", "TRT", "engine")],
                         ids=["pytorch-1.0", "engine-0.17"])
def test_fitting_half_the_mixes_cuts_the_error_on_the_other_half(tmp_path, cache, points, release, backend, path):
    points = points()
    mixes = sorted({(p.isl, p.osl) for p in points})
    fitted_mixes = set(mixes[::2])
    reports = {p: write(tmp_path / f"{p.model}-{p.isl}-{p.osl}.json", trtllm_bench_report(p, release, backend))
               for p in points}
    train = [read_report(f) for p, f in reports.items() if (p.isl, p.osl) in fitted_mixes]
    held = [read_report(f) for p, f in reports.items() if (p.isl, p.osl) not in fitted_mixes]
    assert len(train) == 10 and len(held) >= 8
    result = calibrate(train, Facts(), leave_one_out=False)
    doc = result.doc
    assert (doc["gpu"], doc["path"], doc["trtllm_version"]) == (H100, path, release)
    # ten throughputs pin three multipliers of the measured-kernel row (its kernels' time in serving, its overheads,
    # the 70B's all-reduce at tp 2); TTFT's needs a TTFT, so it stays shipped
    assert doc["fitted"]["parameters"] == ["kernels", "overhead", "allreduce"]
    assert doc["row"]["ttft_ms"] == pytest.approx(doc["shipped"]["ttft_ms"])
    assert doc["error_pct"]["after"] < doc["error_pct"]["before"]
    notes: list[str] = []
    cases = [case_of(r, complete(r, Facts()), p, None, notes) for r in held for p in r.points]
    before, after = mean(errors_pct(cases, result.base)), mean(errors_pct(cases, result.eff))
    assert after < before, f"held-out error {before:.1f}% with the shipped row, {after:.1f}% calibrated"
    # the cases are planned as the published check plans the same points (trtllm-bench's limits on its path)
    shipped = {(c.point.isl, c.point.osl, c.facts.tp): c.predict(result.base)["throughput"] for c in cases}
    for p in points:
        if (p.isl, p.osl) not in fitted_mixes:
            assert shipped[(p.isl, p.osl, p.tp)] == pytest.approx(cal.predict_published(p).max_output_tokens_per_s)


def test_three_reports_get_a_leave_one_out_error_the_basis_quotes(tmp_path, cache, capsys):
    files = [write(tmp_path / f"{p.isl}-{p.osl}.json", trtllm_bench_report(p, "0.17", "TRT"))
             for p in v0_17_h100() if p.model == "llama-3.1-8b"][:3]
    assert main(["calibrate", "--json", *map(str, files)]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["fitted"]["parameters"] == ["speed"] and doc["path"] == "engine"
    loo = doc["error_pct"]["leave_one_out"]
    assert loo is not None and loo > 0
    row = calrow.calibrated_row(H100, "engine", "0.17")
    assert row is not None and row.error_pct == loo and row.basis.startswith(
        f"measured kernels x serving costs calibrated on 3 runs of {H100} (engine, TensorRT-LLM 0.17), fit error {loo:.1f}% "
        "(leave-one-out)")


# ------------------------------------------------------------------------ the cache row and the plan's basis


def plan_spec(tmp_path: Path, target: str = "llmapi") -> Path:
    spec = cal.spec_for("llama-3.1-8b", H100, "fp8", 1, 1000, 1000, max_batch_size=256, max_num_tokens=8192,
                        kv_fraction=0.9, target=target)
    path = tmp_path / f"plan-{target}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    return path


def plan_performance(tmp_path: Path, spec: Path, capsys) -> dict:
    main(["--root", str(tmp_path), "plan", str(spec), "--json"])
    return json.loads(capsys.readouterr().out)["performance"]


def test_the_plan_says_it_uses_the_calibrated_row_after_calibrating_and_not_before(tmp_path, cache, capsys,
                                                                                    monkeypatch):
    point = next(p for p in v1_0_h100() if p.model == "llama-3.1-8b" and (p.isl, p.osl) == (1000, 1000))
    # a run of the release this toolchain deploys (the published figure stands in for it)
    report = write(tmp_path / "run.json", trtllm_bench_report(point, TRTLLM_VERSION))
    spec, engine_spec = plan_spec(tmp_path), plan_spec(tmp_path, "trtllm")
    before = plan_performance(tmp_path, spec, capsys)
    assert before["basis"].startswith("AIConfigurator 0.12.0's measured kernels") and "calibrated" not in before["basis"]

    assert main(["calibrate", str(report)]) == 0
    out = capsys.readouterr().out
    assert "fitted: speed" in out and "wrote" in out
    after = plan_performance(tmp_path, spec, capsys)
    assert after["basis"].startswith(f"measured kernels x serving costs calibrated on 1 run of {H100} (pytorch, "
                                     f"TensorRT-LLM {TRTLLM_VERSION}), fit error")
    assert any("calibrated from your runs" in n for n in after["notes"])
    assert after["max_output_tokens_per_s"] != before["max_output_tokens_per_s"]
    # the error bar is the calibration's own error on the user's runs, not the published cells'
    assert after["error_bar"]["nearest"] == after["basis"] and after["error_bar"]["cells"] == 1
    assert before["error_bar"]["nearest"] != before["basis"]
    # the row is the path's: an engine plan of the same GPU keeps the shipped table
    assert "calibrated" not in plan_performance(tmp_path, engine_spec, capsys)["basis"]
    monkeypatch.setenv(calrow.IGNORE_ENV, "1")  # reproducible runs ignore the cache
    assert plan_performance(tmp_path, spec, capsys) == before


def test_the_written_row_round_trips_and_show_and_clear_manage_it(tmp_path, cache, capsys):
    point = next(p for p in v1_0_h100() if p.model == "llama-3.1-70b" and (p.isl, p.osl) == (500, 2000))
    report = write(tmp_path / "run.json", trtllm_bench_report(point, "1.0"))
    assert main(["calibrate", "--json", str(report)]) == 0
    doc = json.loads(capsys.readouterr().out)
    file = Path(doc["written"])
    assert file.parent == cache and file == calrow.row_path(H100, "pytorch", "1.0")
    assert [p.name for p in cache.iterdir()] == [file.name]  # no temporary file beside it
    stored = json.loads(file.read_text())
    assert stored["reports"] == [{"path": str(report.resolve()), "sha256": read_report(report).sha256,
                                  "format": TRTLLM_BENCH, "points": 1}]
    assert stored["error_pct"]["leave_one_out"] is None  # one report: no leave-one-out
    row = calrow.calibrated_row(H100, "pytorch", "v1.0")
    assert row is not None and row.file == file and row.reports == 1
    assert {f.name: getattr(row.eff, f.name) for f in dataclasses.fields(perf.Efficiency)} == stored["row"]
    assert row.error_pct == stored["error_pct"]["after"]
    assert calrow.calibrated_row(H100, "pytorch", TRTLLM_VERSION) is None  # another release's plans
    assert main(["calibrate", "--show"]) == 0
    assert f"{H100} (pytorch, TensorRT-LLM 1.0)" in capsys.readouterr().out
    assert main(["calibrate", "--clear"]) == 0
    assert not list(cache.iterdir()) and calrow.calibrated_row(H100, "pytorch", "1.0") is None


def test_dry_run_writes_nothing(tmp_path, cache, capsys):
    point = v1_0_h100()[0]
    report = write(tmp_path / "run.json", trtllm_bench_report(point, "1.0"))
    assert main(["calibrate", "--dry-run", str(report)]) == 0
    assert "dry run: nothing written" in capsys.readouterr().out
    assert not cache.exists()


def test_a_failing_fit_leaves_the_cached_row_whole(tmp_path, cache, capsys):
    good = next(p for p in v1_0_h100() if p.model == "llama-3.1-8b")
    assert main(["calibrate", str(write(tmp_path / "good.json", trtllm_bench_report(good, "1.0")))]) == 0
    file = calrow.row_path(H100, "pytorch", "1.0")
    kept = file.read_bytes()
    # 70B in bf16 on one 80 GB card: the memory plan says it does not fit, so there is no prediction to fit
    big = dataclasses.replace(next(p for p in v1_0_h100() if p.model == "llama-3.1-70b"), tp=1)
    doc = trtllm_bench_report(big, "1.0")
    doc["engine"].update(quantization=None, kv_cache_dtype="bfloat16")
    capsys.readouterr()
    assert main(["calibrate", str(write(tmp_path / "big.json", doc))]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and len(err.strip().splitlines()) == 1
    assert file.read_bytes() == kept and [p.name for p in cache.iterdir()] == [file.name]


def test_a_row_that_cannot_be_serialised_leaves_no_file(cache):
    with pytest.raises(TypeError):
        calrow.save_row({"gpu": H100, "path": "pytorch", "trtllm_version": "1.0", "row": {"bandwidth": object()}})
    assert not list(cache.glob("*")) if cache.exists() else True


# ----------------------------------------------------------------------- AIPerf and this project's reports


def truth_row() -> perf.Efficiency:
    """The row the synthetic runs below are measured with: the shipped H100 measured-kernel row, slower kernels,
    dearer sequences."""
    base = perf.efficiency_of(gpus.lookup(H100), measured_kernels=True)
    return dataclasses.replace(base, kernel_scale=base.kernel_scale * 1.25, seq_us=base.seq_us * 1.5)


def measured(isl: int, osl: int, concurrency: int, requests: int) -> perf.Performance:
    """What the truth row gives a run at `concurrency` planned as calibrate plans an AIPerf run (trtllm-serve's
    default limits) of llama-3.1-8b fp8 on one H100."""
    spec = cal.spec_for("llama-3.1-8b", H100, "fp8", 1, isl, osl, max_batch_size=2048, max_num_tokens=8192,
                        kv_fraction=0.9, target="llmapi", concurrency=concurrency, num_requests=requests)
    info = cal.model_info("llama-3.1-8b")
    quant = quantization_of(spec.quantization, info.hf_config, hf_quant_config=info.hf_quant_config)
    device = gpus.lookup(H100)
    memory = plan_memory(spec, info, quant, device, suggest=False)
    return perf.predict(spec, info, quant, device, memory, eff=truth_row(), concurrency=concurrency, bench_run=True)


def aiperf_report(isl: int, osl: int, concurrency: int, requests: int) -> dict:
    """AIPerf 0.13's profile_export_aiperf.json (schema 1.4) as its exporter writes one."""
    got = measured(isl, osl, concurrency, requests)

    def metric(value: float, unit: str) -> dict:
        return {"unit": unit, "avg": value, "p50": value, "p90": value * 1.1, "min": value * 0.9, "max": value * 1.2}

    return {"schema_version": "1.4", "aiperf_version": "0.13.0", "benchmark_id": "x",
            "time_to_first_token": metric(got.ttft_ms, "ms"), "inter_token_latency": metric(got.tpot_ms, "ms"),
            "output_token_throughput": {"unit": "tokens/sec", "avg": got.output_tokens_per_s},
            "input_sequence_length": metric(isl, "tokens"), "output_sequence_length": metric(osl, "tokens"),
            "request_count": {"unit": "requests", "avg": requests},
            "input_config": {"models": {"items": [{"name": "served-model"}]},
                             "datasets": [{"type": "synthetic", "prompts": {"isl": {"mean": isl, "stddev": 0},
                                                                            "osl": {"mean": osl, "stddev": 0}}}],
                             "phases": [{"name": "profiling", "kind": "profiling", "type": "concurrency",
                                         "requests": requests, "concurrency": concurrency}]},
            "run_info": {"cli_command": f"aiperf profile --concurrency {concurrency}"}}


def toolchain_report(isl: int, osl: int, levels: list[int], requests: int, target: str = "llmapi") -> dict:
    """This project's report.json (bench/report.py build_report, bench/deployment.py describe), one level per
    concurrency."""
    rows = []
    for i, c in enumerate(levels):
        got = measured(isl, osl, c, requests)
        rows.append({"level": i, "load": {"mode": "concurrency", "value": c, "sessions": requests},
                     "num_requests": requests, "ttft_ms": {"mean": got.ttft_ms, "p50": got.ttft_ms},
                     "tpot_ms": {"mean": got.tpot_ms}, "isl": {"mean": isl}, "osl": {"mean": osl},
                     "output_tokens_per_s": got.output_tokens_per_s})
    return {"tool": "toolchain bench 0.1.0", "model": "ensemble",
            "deployment": {"name": "l8", "target": target, "tp": 1, "pp": 1, "dtype": "bfloat16",
                           "quantization": "fp8", "kv_cache_dtype": "fp8", "gpu": "host CPU" if target.endswith("cpu")
                           else H100, "speculative_mode": "none", "spec_hash": "0" * 64, "toolchain_version": "0.1.0"},
            "workload": {"input_tokens": isl, "output_tokens": osl, "mode": "concurrency"}, "levels": rows}


AIPERF_FLAGS = ["--gpu", "H100", "--tp", "1", "--quantization", "fp8", "--kv-cache", "fp8", "--path", "pytorch",
                "--version", TRTLLM_VERSION, "--model", "llama-3.1-8b"]


def test_the_three_formats_are_read_for_what_they_record(tmp_path):
    bench = read_report(write(tmp_path / "b.json", trtllm_bench_report(v1_0_h100()[0], "1.0")))
    assert bench.format == TRTLLM_BENCH and bench.points[0].concurrency is None
    f = bench.facts
    assert (f.gpu, f.tp, f.pp, f.method, f.kv_cache, f.path, f.version, f.model) == \
        (H100, 1, 1, "fp8", "fp8", "pytorch", "1.0", "llama-3.1-8b")
    ai = read_report(write(tmp_path / "a.json", aiperf_report(1000, 200, 16, 64)))
    assert ai.format == AIPERF and (ai.facts.gpu, ai.facts.tp, ai.facts.version) == (None, None, None)
    assert (ai.points[0].isl, ai.points[0].osl, ai.points[0].concurrency, ai.points[0].requests) == (1000, 200, 16, 64)
    ours = read_report(write(tmp_path / "o.json", toolchain_report(1000, 200, [4, 16], 64)))
    assert ours.format == TOOLCHAIN_BENCH and [p.concurrency for p in ours.points] == [4, 16]
    assert (ours.facts.gpu, ours.facts.path, ours.facts.method, ours.facts.kv_cache) == (H100, "pytorch", "fp8", "fp8")
    assert all(p.ttft_ms and p.tpot_ms for p in ai.points + ours.points)


def test_runs_at_a_concurrency_fit_ttft_and_tpot_toward_the_row_that_made_them(tmp_path, cache, capsys):
    ai = write(tmp_path / "aiperf.json", aiperf_report(2000, 200, 32, 128))
    ours = write(tmp_path / "report.json", toolchain_report(1000, 300, [8, 64], 256))
    assert main(["calibrate", "--dry-run", "--json", str(ai), str(ours), *AIPERF_FLAGS]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["written"] is None and doc["trtllm_version"] == TRTLLM_VERSION
    assert {r["format"] for r in doc["reports"]} == {AIPERF, TOOLCHAIN_BENCH}
    assert doc["error_pct"]["values"] == 9  # throughput, TTFT and TPOT of three points
    assert doc["fitted"]["parameters"] == ["kernels", "overhead", "ttft"]
    assert doc["error_pct"]["after"] < doc["error_pct"]["before"] / 2
    assert doc["error_pct"]["leave_one_out"] is None  # two reports
    truth, shipped = truth_row(), perf.efficiency_of(gpus.lookup(H100), measured_kernels=True)
    # the fitted kernels' time moved from the shipped row toward the one the runs were made with
    assert abs(doc["row"]["kernel_scale"] - truth.kernel_scale) < abs(shipped.kernel_scale - truth.kernel_scale)


def test_a_streaming_trtllm_bench_run_at_a_concurrency_fits_its_ttft_and_tpot(tmp_path, cache, capsys):
    got = measured(1000, 200, 16, 160)
    doc = trtllm_bench_report(v1_0_h100()[0], TRTLLM_VERSION)
    doc["dataset"].update(avg_isl=1000, avg_osl=200, num_requests=160)
    doc["request_info"].update(num_requests=160)
    doc["performance"]["system_output_throughput_tok_s"] = got.output_tokens_per_s
    doc["world_info"].update(max_batch_size=2048, max_num_tokens=8192, kv_cache_percentage=0.9)
    doc["streaming_metrics"] = {"avg_ttft_ms": got.ttft_ms, "avg_tpot_ms": got.tpot_ms}
    run = write(tmp_path / "run.json", doc)
    assert main(["calibrate", "--dry-run", "--json", str(run)]) == 0
    as_max = json.loads(capsys.readouterr().out)
    assert as_max["points"][0]["concurrency"] is None and list(as_max["points"][0]["measured"]) == ["throughput"]
    assert any("only their throughput is fitted" in n for n in as_max["notes"])
    assert main(["calibrate", "--dry-run", "--json", "--concurrency", "16", str(run)]) == 0
    at_c = json.loads(capsys.readouterr().out)
    assert at_c["points"][0]["concurrency"] == 16 and set(at_c["points"][0]["measured"]) == {"throughput", "ttft", "tpot"}
    assert at_c["error_pct"]["after"] < at_c["error_pct"]["before"]


# ------------------------------------------------------------------------------------------------ refusals


def refused(capsys, *argv: str) -> str:
    rc = main(["calibrate", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_refusals_are_one_line_errors(tmp_path, cache, capsys):
    assert "not a report calibrate reads" in refused(capsys, str(write(tmp_path / "x.json", {"hello": 1})))
    ai = write(tmp_path / "aiperf.json", aiperf_report(1000, 200, 8, 32))
    no_gpu = [a for a in AIPERF_FLAGS if a not in ("--gpu", "H100")]
    assert "--gpu" in refused(capsys, str(ai), *no_gpu)
    cpu = write(tmp_path / "cpu.json", toolchain_report(64, 32, [4], 32, target="cpu"))
    assert "probe-host" in refused(capsys, str(cpu))
    bench = write(tmp_path / "b.json", trtllm_bench_report(v1_0_h100()[0], "1.0"))
    assert "says tp 1, --tp says 2" in refused(capsys, str(bench), "--tp", "2")
    old = trtllm_bench_report(v1_0_h100()[0], "1.0", machine=False)  # releases before `machine`: no GPU name
    assert "--gpu" in refused(capsys, str(write(tmp_path / "old.json", old)))
    assert "one GPU, path and TensorRT-LLM version" in refused(
        capsys, str(bench), str(write(tmp_path / "b2.json", trtllm_bench_report(v1_0_h100()[1], "0.21"))))
    assert not cache.exists()


@pytest.mark.parametrize("name, memory, table", [
    ("NVIDIA H100 80GB HBM3", 79.6, H100), ("NVIDIA H200", None, "H200 141GB"), ("NVIDIA H100 PCIe", None, "H100 PCIe"),
    ("NVIDIA A100-SXM4-80GB", None, "A100 80GB"), ("NVIDIA GeForce RTX 4090", None, "RTX 4090"),
    # a variant the table lacks, or memory that is not the table card's: no guess, --gpu names it
    ("NVIDIA H100 NVL", None, None), ("NVIDIA A100-SXM4-40GB", None, None), ("NVIDIA H100 80GB HBM3", 40.0, None),
])
def test_device_names_map_to_the_gpu_table_or_to_nothing(name, memory, table):
    assert gpu_named(name, memory) == table


def test_a_spec_gives_the_facts_and_the_limits(tmp_path, cache, capsys):
    ours = write(tmp_path / "report.json", toolchain_report(1000, 300, [8], 64))
    spec = plan_spec(tmp_path)
    assert main(["calibrate", "--dry-run", "--json", "--spec", str(spec), str(ours)]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["points"][0]["model"] == "llama-3.1-8b" and not any("default limits" in n for n in doc["notes"])
    # the spec's target is the other path: the report and the spec disagree, in one line
    assert "the spec says engine" in refused(capsys, "--spec", str(plan_spec(tmp_path, "trtllm")), str(ours))
    assert "same run" in refused(capsys, str(ours), str(ours), "--model", "llama-3.1-8b")


def test_the_fit_tool_shares_the_search():
    from tools import fit_efficiency
    from toolchain.plan import fit
    assert fit_efficiency.nelder_mead is fit.nelder_mead
