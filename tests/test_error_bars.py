"""Per-cell error bars (toolchain/plan/perf/error_bars.py, data/error_cells.json, tools/error_cells.py).

The committed cells are what the current model gives (so the bars cannot drift from it); a configuration that is a
cell group gets that group's median |error|; an unseen card or size gets a wider bar that names what it fell back
to; plan prints the bar beside the throughput and tune beside each candidate, ranking by the prediction itself."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import write_spec

from toolchain import hostprofile as hp
from toolchain.checks.preflight import build_context, run_checks
from toolchain.checks.render import render_text, report_dict
from toolchain.plan import calibration as cal
from toolchain.plan.perf import error_bars, performance_dict
from toolchain.plan.perf.error_bars import CELLS_FILE, error_bar, params_billions
from toolchain.slo import thresholds
from toolchain.spec import load_spec
from toolchain.tune.report import render
from toolchain.tune.search import search
from tools import error_cells

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = REPO / "build" / "llama3-70b-tp4pp2.yaml"
PROFILE = REPO / "tests" / "tune" / "host-profile-epyc-2core.json"


def committed() -> list[dict]:
    doc = json.loads(CELLS_FILE.read_text())
    return [dict(zip(doc["columns"], row, strict=True)) for row in doc["rows"]]


def group_median(**match) -> tuple[float, int]:
    errors = [abs(c["error_pct"]) for c in committed() if all(c[k] == v for k, v in match.items())]
    return statistics.median(errors), len(errors)


def test_the_committed_cells_are_what_the_current_model_gives():
    rows = error_cells.published_rows() + error_cells.measured_rows()
    assert CELLS_FILE.read_text() == error_cells.document(rows), "stale: run PYTHONPATH=. python -m tools.error_cells"
    published = sum(len(cal.published_points(p)) for p in error_cells.PUBLISHED_FILES)
    measured = sum(cal.held_out(p) for p in cal.measured_points())
    assert len(rows) == published + measured and published >= 290 and measured > 0
    paths = {(c["release"], c["path"]) for c in committed() if c["source"] == "published"}
    assert {("0.17", "engine"), ("1.0", "pytorch"), ("1.2", "pytorch")} <= paths


def test_parameters_count_every_expert():
    assert params_billions(cal.model_info("llama-3.1-70b").params) == pytest.approx(70.55, abs=0.01)
    assert params_billions(cal.model_info("llama-3.1-8b").params) == pytest.approx(cal.param_count(
        cal.model_info("llama-3.1-8b").params) / 1e9)
    assert params_billions(cal.model_info("deepseek-r1").params) == pytest.approx(671.3, abs=0.1)  # not 37B active


def test_a_published_configuration_gets_its_own_groups_median():
    # release 1.0's Llama 3.3 70B on two H100 at FP8, PyTorch path: ten published cells
    want, n = group_median(gpu="H100 80GB", method="fp8", params_b=70.6, tp=2, path="pytorch")
    bar = error_bar("H100 80GB", "fp8", 70.55, 2, "pytorch", moe=False)
    assert bar == {"pct": round(want, 1), "cells": n, "nearest": "H100 80GB fp8 70.6B tp2 pytorch: 10 published cells",
                   "distance": 0.0}
    # the same configuration on the engine path is another group (release 0.17's nine mixes)
    engine, _ = group_median(gpu="H100 80GB", method="fp8", params_b=70.6, tp=2, path="engine")
    assert error_bar("H100 80GB", "fp8", 70.55, 2, "engine")["pct"] == round(engine, 1) != bar["pct"]
    # and the prediction of the published point itself carries it
    point = next(pt for pt in cal.published_points(cal.PUBLISHED_V1_0) if (pt.gpu, pt.tp) == ("H100 80GB", 2))
    assert cal.predict_published(point).error_bar == bar
    assert cal.predict_published(point).as_dict()["error_bar"] == bar


def test_an_unseen_card_or_size_gets_a_wider_bar_naming_what_it_fell_back_to():
    exact = error_bar("H100 80GB", "fp8", 70.55, 2, "pytorch")
    pcie = error_bar("H100 PCIe", "fp8", 70.55, 2, "pytorch")  # no cell of the PCIe card
    assert pcie["pct"] > exact["pct"] and pcie["distance"] == error_bars.OTHER_GPU_SAME_GENERATION
    assert pcie["nearest"].startswith("nearest: H100 80GB fp8 70.6B tp2 pytorch, 10 published cells")
    assert "other GPU of the same generation, Hopper" in pcie["nearest"]
    # a size nobody measured on the A100: the 70B cells, further off, wider still
    a100_70b, _ = group_median(gpu="A100 80GB", method="none", params_b=70.6, tp=2, path="engine")
    a100_32b = error_bar("A100 80GB", "none", 32.0, 2, "engine")
    assert a100_32b["pct"] > round(a100_70b, 1) and "70.6B for 32B" in a100_32b["nearest"]
    # a card of a generation without cells (Ada) falls back to Hopper's and says so
    l40s = error_bar("L40S", "fp8", 8.03, 1, "engine")
    assert "another generation: Hopper for L40S's Ada" in l40s["nearest"] and l40s["distance"] >= 2
    # too far from every cell: no bar
    assert error_bar("H100 80GB", "none", 0.1, 1, "pytorch") is None


def test_plan_prints_the_bar_beside_the_throughput():
    spec = load_spec(REPO / "build" / "llama3-8b-llmapi-h100.yaml")
    ctx = build_context(spec, "plan")
    report = report_dict(ctx, run_checks(ctx))
    bar = report["performance"]["error_bar"]
    assert bar == error_bar("H100 80GB", "fp8", 8.03, 1, "pytorch", moe=False)
    text = render_text(report)
    assert f"output tokens/s ±{bar['pct']:.0f}% (" in text
    assert f"error bar ±{bar['pct']:.1f}%" in text and bar["nearest"] in text


def test_tune_shows_the_bar_and_ranks_by_the_prediction():
    spec = load_spec(LLAMA_70B, ["validation.slo.tpot_p99_ms=null", "validation.slo.ttft_p99_ms=null"])
    result = search(spec, [spec], 4, thresholds(spec.validation.slo, []), by_cost=False)
    shown = result.shown[:5]
    assert len(shown) >= 2 and all(e.performance["error_bar"] for e in shown)
    rates = [e.performance["per_gpu_output_tokens_per_s"] for e in shown]
    assert rates == sorted(rates, reverse=True)  # the bar does not reorder
    lines = render(result, 5).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("#"))
    assert lines[head].split()[2:4] == ["tok/s/GPU", "error"]
    for e, line in zip(shown, lines[head + 1:], strict=False):
        bar = e.performance["error_bar"]
        assert e.candidate.label in line and f"±{bar['pct']:.0f}%" in line.split(e.candidate.label)[1]
    assert any("ranked by the prediction itself" in line for line in lines)


def test_a_cpu_target_gets_no_bar(hf_llama, tmp_path):
    """The CPU engine's prediction comes from this host's profile and is checked closed loop, not against cells."""
    spec = load_spec(write_spec(tmp_path / "cpu.yaml", hf_llama, target="cpu"))
    ctx = build_context(spec, "plan")
    profile = hp.HostProfile.from_dict(json.loads(PROFILE.read_text()))
    perf = performance_dict(spec, ctx.model, ctx.quant, ctx.device, ctx.memory, profile=profile)
    assert perf["predicted"] and perf["basis"].startswith("host profile") and perf["error_bar"] is None
    report = {**report_dict(ctx, run_checks(ctx)), "performance": perf}
    text = render_text(report)
    assert "output tokens/s (" in text and "error bar" not in text and "±" not in text


def test_the_file_says_how_the_bars_hold_on_configurations_left_out():
    doc = json.loads(CELLS_FILE.read_text())
    check = error_bars.left_out_check(error_bars.groups())
    assert check["groups"] >= 40 and 0 < check["covered"] <= check["groups"]
    assert f"for {check['covered']} of {check['groups']}" in doc["left_out"] and doc["left_out_missed"] == check["missed"]
    # leaving a group out changes its own bar: the H100 70B TP2 PyTorch cells no longer answer for themselves
    pool = error_bars.groups()
    mine = next(g for g in pool if g.label == "H100 80GB fp8 70.6B tp2 pytorch")
    without = error_bar(mine.gpu, mine.method, mine.params_b, mine.tp, mine.path, mine.moe,
                        among=tuple(g for g in pool if g is not mine))
    assert without["distance"] > 0 and "H100 80GB fp8 70.6B tp2 pytorch" not in without["nearest"]
