"""Metric definitions (latency-harness reference, section (a)), from raw records.

- TTFT  = t_first_tok - t_send   (first response carrying >= 1 token; an empty
          first response is not a token). TTFR = t_first_resp - t_send.
- E2E   = t_last_tok - t_send; E2E-final = t_final - t_send kept separately
          (they differ when a flag-only final response arrives late).
- TPOT  = (t_last_tok - t_first_tok) / (OSL - 1), only for OSL > 1.
- TTST  = second token-bearing response - first token-bearing response.
- ITL   = every gap between consecutive token-bearing responses, pooled over
          requests (chunk-weighted); each gap keeps its token count so a
          per-token ITL (gap / tokens) is derived too.
- Throughput window = first measured t_send .. last measured t_last_tok.
- Goodput = measured requests meeting every per-request SLO / window.

Percentiles: numpy `linear`; stdev: population (ddof=0), as genai-perf and vLLM.
Warm-up requests are excluded; failed requests are counted, never timed.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

import numpy as np

from toolchain.bench.records import RequestRecord

NS_PER_MS = 1e6
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99_9": 99.9}
PERCENTILE_METHOD = "linear"
WINDOW_DEFINITION = "first measured t_send .. last measured t_last_tok"

# SLO thresholds are named <metric>_p<NN>_ms (spec.validation.slo); the metric
# names map onto per-request values so goodput can judge each request.
_SLO_NAME = re.compile(r"^(?P<metric>[a-z0-9]+)_(?P<pct>p\d+(?:_\d+)?)_ms$")


def _ms(delta_ns: int | None) -> float | None:
    return None if delta_ns is None else delta_ns / NS_PER_MS


def request_metrics(rec: RequestRecord) -> dict:
    """Per-request latencies in ms (None where undefined) and the ITL gaps."""
    toks = rec.token_responses()
    osl = rec.osl
    t_send = rec.t_send
    out = {
        "ttft": _ms(rec.t_first_tok - t_send) if toks and t_send is not None else None,
        "ttfr": _ms(rec.t_first_resp - t_send) if rec.responses and t_send is not None else None,
        "e2e": _ms(rec.t_last_tok - t_send) if toks and t_send is not None else None,
        "e2e_final": _ms(rec.t_final - t_send) if rec.t_final is not None and t_send is not None else None,
        "tpot": _ms(rec.t_last_tok - rec.t_first_tok) / (osl - 1) if toks and osl > 1 else None,
        "ttst": _ms(toks[1].t_ns - toks[0].t_ns) if len(toks) > 1 else None,
        "osl": osl,
        # (gap ms, tokens in the later response) for each consecutive pair
        "itl": [(_ms(b.t_ns - a.t_ns), b.n_tok) for a, b in zip(toks, toks[1:])],
    }
    return out


def stats(values: Iterable[float]) -> dict:
    """p50/p90/p95/p99/p99.9 (numpy linear), mean, stdev (population), min, max, n."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return {**{k: None for k in PERCENTILES}, "mean": None, "stdev": None, "min": None, "max": None, "n": 0}
    pct = np.percentile(a, list(PERCENTILES.values()), method=PERCENTILE_METHOD)
    out = {k: float(v) for k, v in zip(PERCENTILES, pct)}
    out.update(mean=float(a.mean()), stdev=float(a.std(ddof=0)), min=float(a.min()), max=float(a.max()), n=int(a.size))
    return out


def parse_slo_name(name: str) -> tuple[str, str]:
    """'ttft_p99_ms' -> ('ttft', 'p99')."""
    m = _SLO_NAME.match(name)
    if not m or m["pct"] not in PERCENTILES:
        raise ValueError(f"SLO '{name}' is not <metric>_p<NN>_ms with a reported percentile")
    return m["metric"], m["pct"]


def _meets(per_req: dict, slo: dict[str, float]) -> bool:
    for name, threshold in slo.items():
        metric, _ = parse_slo_name(name)
        value = per_req.get(metric)
        if value is None:
            # TPOT is undefined for OSL <= 1: such a request cannot miss it (vLLM rule).
            if metric == "tpot":
                continue
            return False
        if value > threshold:
            return False
    return True


def compute(records: list[RequestRecord], slo: dict[str, float] | None = None) -> dict:
    """Aggregate the measured (non-warm-up) records. `slo`: set thresholds only."""
    slo = {k: v for k, v in (slo or {}).items() if v is not None}
    measured = [r for r in records if not r.warmup]
    # A request that completed without a single output token produced nothing to time.
    good = [r for r in measured if r.ok and r.t_first_tok is not None]
    failed = [r for r in measured if not (r.ok and r.t_first_tok is not None)]
    per = [request_metrics(r) for r in good]

    sends = [r.t_send for r in measured if r.t_send is not None]
    ends = [r.t_last_tok for r in good]
    start, end = (min(sends), max(ends)) if sends and ends else (None, None)
    window_s = (end - start) / 1e9 if start is not None and end > start else None

    def rate(count: float) -> float | None:
        return count / window_s if window_s else None

    total_osl = sum(p["osl"] for p in per)
    n_good_slo = sum(1 for p in per if _meets(p, slo))
    gaps = [g for p in per for g in p["itl"]]
    reasons = Counter(_error_text(r) for r in failed)
    return {
        "num_requests": len(good),
        "sent": len(sends),
        "errors": len(failed),
        "error_reasons": dict(reasons.most_common(5)),
        "warmup_requests": sum(1 for r in records if r.warmup),
        "window_s": window_s,
        "window": {"definition": WINDOW_DEFINITION, "start_ns": start, "end_ns": end},
        "requests_per_s": rate(len(good)),
        "output_tokens_per_s": rate(total_osl),
        "output_tokens": total_osl,
        "goodput_req_per_s": rate(n_good_slo),
        "goodput_fraction": n_good_slo / len(measured) if measured else None,
        "ttft_ms": stats(p["ttft"] for p in per),
        "ttfr_ms": stats(p["ttfr"] for p in per),
        "ttst_ms": stats(p["ttst"] for p in per),
        "tpot_ms": stats(p["tpot"] for p in per),
        "itl_ms": stats(g for g, _ in gaps),
        "itl_per_token_ms": stats(g / n for g, n in gaps),
        "e2e_ms": stats(p["e2e"] for p in per),
        "e2e_final_ms": stats(p["e2e_final"] for p in per),
        "isl": stats(r.isl for r in good),
        "osl": stats(p["osl"] for p in per),
    }


def _error_text(rec: RequestRecord) -> str:
    if rec.error:
        return rec.error
    if rec.t_send is None:
        return "not sent"
    if rec.t_final is None:
        return "no final response"
    return "no output tokens"


def evaluate_slo(metrics: dict, slo: dict[str, float | None]) -> dict:
    """{'passed': bool, <threshold name>: {threshold, measured, passed}, 'errors': {...}}.

    Failed requests fail the run: percentiles over the survivors would hide them.
    """
    out: dict = {}
    for name, threshold in slo.items():
        if threshold is None:
            continue
        metric, pct = parse_slo_name(name)
        measured = metrics[f"{metric}_ms"][pct]
        out[name] = {"threshold": threshold, "measured": measured,
                     "passed": measured is not None and measured <= threshold}
    out["errors"] = {"threshold": 0, "measured": metrics["errors"], "passed": metrics["errors"] == 0}
    ok = all(v["passed"] for v in out.values()) and metrics["num_requests"] > 0
    return {"passed": ok, **out}
