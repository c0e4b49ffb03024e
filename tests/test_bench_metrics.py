"""Bench metrics from hand-made records with known timestamps (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from toolchain.bench import metrics as M
from toolchain.bench.records import RequestRecord, Response

MS = 1_000_000


def rec(i, send_ms, resps, final_ms=None, *, warmup=False, error=None, isl=8, max_tokens=3) -> RequestRecord:
    """resps: [(arrival ms, tokens)]; final defaults to 1 ms after the last response."""
    r = RequestRecord(index=i, request_id=f"r{i}", warmup=warmup, isl=isl, max_tokens=max_tokens,
                      t_sched=int(send_ms * MS), t_send=int(send_ms * MS), error=error)
    r.responses = [Response(int(t * MS), n) for t, n in resps]
    if error is None:
        last = resps[-1][0] if resps else send_ms
        r.t_final = int((final_ms if final_ms is not None else last + 1) * MS)
    return r


def test_ttft_skips_empty_first_response_and_keeps_ttfr():
    r = rec(0, 0, [(40, 0), (50, 1), (60, 1), (70, 1)], final_ms=75)
    m = M.request_metrics(r)
    assert m["ttfr"] == pytest.approx(40)
    assert m["ttft"] == pytest.approx(50)
    assert m["e2e"] == pytest.approx(70)          # last token, not the flag-only final
    assert m["e2e_final"] == pytest.approx(75)
    assert m["tpot"] == pytest.approx((70 - 50) / (3 - 1))
    assert m["ttst"] == pytest.approx(10)
    assert [g for g, _ in m["itl"]] == pytest.approx([10, 10])  # the empty response makes no gap


def test_tpot_formula_and_itl_pooled_with_multi_token_chunks():
    a = rec(0, 0, [(50, 2), (90, 4), (130, 4)])            # OSL 10
    b = rec(1, 0, [(20, 1), (25, 1), (35, 1), (40, 1)])   # OSL 4
    out = M.compute([a, b])
    # the first chunk's 2 tokens arrived at TTFT: the decode window delivered the other 8
    assert M.request_metrics(a)["tpot"] == pytest.approx((130 - 50) / 8)
    assert M.request_metrics(b)["tpot"] == pytest.approx((40 - 20) / 3)
    # ITL pools every gap of every request, one value per chunk gap
    pooled = [40, 40, 5, 10, 5]
    assert out["itl_ms"]["n"] == 5
    assert out["itl_ms"]["mean"] == pytest.approx(np.mean(pooled))
    assert out["itl_ms"]["max"] == pytest.approx(40)
    # per-token ITL divides each gap by the tokens it delivered
    per_token = [10, 10, 5, 10, 5]
    assert out["itl_per_token_ms"]["mean"] == pytest.approx(np.mean(per_token))
    assert out["osl"]["max"] == 10


def test_osl_of_one_is_excluded_from_tpot():
    one = rec(0, 0, [(30, 1)])
    two = rec(1, 0, [(30, 1), (42, 1)])
    out = M.compute([one, two])
    assert M.request_metrics(one)["tpot"] is None
    assert out["tpot_ms"]["n"] == 1 and out["tpot_ms"]["p50"] == pytest.approx(12)
    assert out["ttft_ms"]["n"] == 2


def test_throughput_window_is_first_send_to_last_token():
    a = rec(0, 0, [(50, 1), (70, 2)], final_ms=200)   # late final flag must not stretch the window
    b = rec(1, 10, [(60, 4), (130, 6)])
    out = M.compute([a, b])
    assert out["window_s"] == pytest.approx(0.130)
    assert out["requests_per_s"] == pytest.approx(2 / 0.130)
    assert out["output_tokens_per_s"] == pytest.approx((3 + 10) / 0.130)
    assert out["output_tokens"] == 13


def test_warmup_excluded_everywhere():
    warm = rec(0, -1000, [(4000, 1), (5000, 1)], warmup=True)
    a = rec(1, 0, [(50, 1), (60, 1)])
    out = M.compute([warm, a])
    assert out["warmup_requests"] == 1
    assert out["num_requests"] == 1
    assert out["ttft_ms"]["max"] == pytest.approx(50)
    assert out["window_s"] == pytest.approx(0.060)


def test_errors_counted_separately_and_not_timed():
    a = rec(0, 0, [(50, 1), (60, 1)])
    bad = rec(1, 0, [(10, 1)], error="boom")
    empty = rec(2, 0, [(10, 0)])  # completed without a token
    out = M.compute([a, bad, empty])
    assert out["num_requests"] == 1
    assert out["errors"] == 2
    assert out["error_reasons"] == {"boom": 1, "no output tokens": 1}
    assert out["ttft_ms"]["n"] == 1


def test_goodput_counts_requests_meeting_every_slo():
    reqs = [
        rec(0, 0, [(30, 1), (40, 1)]),     # ttft 30, tpot 10, e2e 40 -> good
        rec(1, 0, [(60, 1), (70, 1)]),     # ttft 60 -> misses ttft
        rec(2, 0, [(30, 1), (80, 1)]),     # tpot 50 -> misses tpot
        rec(3, 0, [(35, 1)]),              # OSL 1: no TPOT, cannot miss it -> good
        rec(4, 0, [], error="timeout"),    # failed: never good
    ]
    slo = {"ttft_p99_ms": 50.0, "tpot_p99_ms": 20.0, "e2e_p99_ms": None}
    out = M.compute(reqs, slo)
    assert out["window_s"] == pytest.approx(0.080)
    assert out["goodput_req_per_s"] == pytest.approx(2 / 0.080)
    assert out["goodput_fraction"] == pytest.approx(2 / 5)
    # no SLO: goodput equals completed throughput
    assert M.compute(reqs)["goodput_req_per_s"] == pytest.approx(4 / 0.080)


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(0)
    ttfts = rng.uniform(5, 500, size=137)
    reqs = [rec(i, 0, [(t, 1), (t + 3, 1)]) for i, t in enumerate(ttfts)]
    s = M.compute(reqs)["ttft_ms"]
    ref = np.asarray([int(t * MS) / MS for t in ttfts])  # the records hold whole ns
    for key, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("p99_9", 99.9)):
        assert s[key] == pytest.approx(np.percentile(ref, q, method="linear"), abs=1e-9)
    assert s["mean"] == pytest.approx(ref.mean())
    assert s["stdev"] == pytest.approx(ref.std(ddof=0))
    assert (s["min"], s["max"], s["n"]) == (pytest.approx(ref.min()), pytest.approx(ref.max()), 137)


def test_stats_of_nothing_are_none():
    s = M.stats([])
    assert s["n"] == 0 and s["p99"] is None and s["mean"] is None


def test_evaluate_slo_per_threshold_and_errors():
    reqs = [rec(i, 0, [(10 + i, 1), (20 + 2 * i, 1)]) for i in range(10)]
    m = M.compute(reqs)
    res = M.evaluate_slo(m, {"ttft_p99_ms": 100.0, "tpot_p99_ms": 1.0, "e2e_p99_ms": None})
    assert res["passed"] is False
    assert res["ttft_p99_ms"] == {"threshold": 100.0, "measured": m["ttft_ms"]["p99"], "passed": True}
    assert res["tpot_p99_ms"]["passed"] is False
    assert "e2e_p99_ms" not in res
    assert res["errors"] == {"threshold": 0, "measured": 0, "passed": True}
    assert M.evaluate_slo(m, {"ttft_p99_ms": 100.0})["passed"] is True
    m_err = M.compute(reqs + [rec(99, 0, [], error="x")])
    assert M.evaluate_slo(m_err, {})["passed"] is False
    assert M.evaluate_slo(M.compute([]), {})["passed"] is False  # nothing completed


def test_slo_names_parse():
    assert M.parse_slo_name("ttft_p99_ms") == ("ttft", "p99")
    assert M.parse_slo_name("e2e_p50_ms") == ("e2e", "p50")
    with pytest.raises(ValueError):
        M.parse_slo_name("ttft_max")


def test_server_speculation_is_the_levels_delta_of_the_models_gauges():
    """Medusa speculates inside tensorrt_llm: the bench reads what happened during a level from
    toolchain_spec_decode_metrics, before and after."""
    from toolchain.bench.servermetrics import delta, parse

    def scrape_text(draft, accepted, steps):
        labels = 'model="tensorrt_llm",version="1",spec_decode_metric="{}"'
        return "\n".join([
            "# TYPE toolchain_spec_decode_metrics gauge",
            f"toolchain_spec_decode_metrics{{{labels.format('total_draft_tokens')}}} {draft}",
            f"toolchain_spec_decode_metrics{{{labels.format('total_accepted_draft_tokens')}}} {accepted}",
            f"toolchain_spec_decode_metrics{{{labels.format('draft_steps')}}} {steps}",
            f"toolchain_spec_decode_metrics{{{labels.format('acceptance_rate')}}} 0.5",
            'nv_inference_request_success{model="ensemble",version="1"} 3'])

    before, after = parse(scrape_text(40, 10, 10)), parse(scrape_text(100, 40, 25))
    spec = delta(before, after, "ensemble")["speculation"]
    assert spec["draft_tokens"] == 60 and spec["accepted_draft_tokens"] == 30 and spec["steps"] == 15
    assert spec["acceptance_rate"] == 0.5 and spec["accepted_per_step"] == 2.0
    assert "speculation" not in delta(before, before, "ensemble")  # nothing drafted during the level
