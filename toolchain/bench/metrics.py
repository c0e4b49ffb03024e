"""Metric definitions (after genai-perf's llm_profile_data_parser.py and vLLM's
vllm/benchmarks/serve.py), from raw records.

- TTFT  = t_first_tok - t_send   (first response carrying >= 1 token; an empty
          first response is not a token). TTFR = t_first_resp - t_send.
- E2E   = t_last_tok - t_send; E2E-final = t_final - t_send kept separately
          (they differ when a flag-only final response arrives late).
- TPOT  = (t_last_tok - t_first_tok) / (OSL - n_first), n_first = tokens in the
          first token-bearing response; defined when OSL > n_first. With one token
          per response this is the usual (E2E - TTFT) / (OSL - 1); with multi-token
          chunks the usual formula charges the first chunk's extra tokens to the
          decode window and understates TPOT (as genai-perf's and vLLM's formula do).
- TTST  = second token-bearing response - first token-bearing response.
- ITL   = every gap between consecutive token-bearing responses, pooled over
          requests (chunk-weighted); each gap keeps its token count so a
          per-token ITL (gap / tokens) is derived too.
- Throughput window = first measured t_send .. last measured t_last_tok.
- Goodput = measured requests meeting every per-request SLO / window.

- Send lag = t_send - t_sched (open loop: how late the harness sent against
          its precomputed schedule); TTFT/E2E-sched are measured from t_sched, so
          a harness falling behind shows up instead of hiding (coordinated omission).

Percentiles: numpy `linear`; stdev: population (ddof=0), as genai-perf and vLLM.
Warm-up requests are excluded; failed requests are counted, never timed;
requests cancelled on purpose are counted apart and never timed either.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Final, Iterable

import numpy as np

from toolchain import slo as S
from toolchain.bench.records import RequestRecord

NS_PER_MS = 1e6

# What the peers call each reported quantity, so a report read next to AIPerf's, vLLM's or
# trtllm-serve's numbers is not misread: AIPerf's "ITL" is a per-request TPOT, and per-chunk
# gaps are its "ICL" (aiperf 0.13 aiperf/metrics/types/inter_token_latency_metric.py,
# inter_chunk_latency_metric.py; vllm/benchmarks/serve.py; tensorrt_llm/metrics/collector.py).
METRIC_NAMES = {
    "ttft_ms": {"means": "send -> first token-bearing response", "trtllm_serve": "trtllm_time_to_first_token_seconds",
                "aiperf": "time_to_first_token (TTFT)", "vllm": "ttft", "genai_perf": "time_to_first_token"},
    "tpot_ms": {"means": "per request: (last token - first token) / (OSL - tokens in the first response)",
                "trtllm_serve": "trtllm_time_per_output_token_seconds", "aiperf": "inter_token_latency (ITL)",
                "vllm": "tpot", "genai_perf": "inter_token_latency"},
    "itl_ms": {"means": "every gap between consecutive token-bearing responses (inter-chunk latency)",
               "trtllm_serve": None, "aiperf": "inter_chunk_latency (ICL)", "vllm": "itl", "genai_perf": None},
}
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99_9": 99.9}
PERCENTILE_METHOD: Final = "linear"
WINDOW_DEFINITION = "first measured t_send .. last measured t_last_tok"

# SLO thresholds are named <metric>_p<NN>_ms (spec.validation.slo); the metric
# names map onto per-request values so goodput can judge each request.
_SLO_NAME = re.compile(r"^(?P<metric>[a-z0-9]+)_(?P<pct>p\d+(?:_\d+)?)_ms$")


def _ms(delta_ns: int | None) -> float | None:
    return None if delta_ns is None else delta_ns / NS_PER_MS


def _span(start_ns: int | None, end_ns: int | None) -> float | None:
    """end - start in ms; None where either end is missing."""
    return None if start_ns is None or end_ns is None else (end_ns - start_ns) / NS_PER_MS


def request_metrics(rec: RequestRecord) -> dict:
    """Per-request latencies in ms (None where undefined) and the ITL gaps."""
    toks = rec.token_responses()
    osl = rec.osl
    t_send, t_sched = rec.t_send, rec.t_sched
    return {
        "ttft": _span(t_send, rec.t_first_tok),
        "ttfr": _span(t_send, rec.t_first_resp),
        "e2e": _span(t_send, rec.t_last_tok),
        "e2e_final": _span(t_send, rec.t_final),
        "tpot": (toks[-1].t_ns - toks[0].t_ns) / NS_PER_MS / (osl - toks[0].n_tok)
        if toks and osl > toks[0].n_tok and len(toks) > 1 else None,
        "ttst": _ms(toks[1].t_ns - toks[0].t_ns) if len(toks) > 1 else None,
        "send_lag": _ms(rec.send_lag_ns),
        "ttft_sched": _span(t_sched, rec.t_first_tok),
        "e2e_sched": _span(t_sched, rec.t_last_tok),
        "osl": osl,
        # (gap ms, tokens in the later response) for each consecutive pair
        "itl": [(_ms(b.t_ns - a.t_ns), b.n_tok) for a, b in zip(toks, toks[1:], strict=False)],
    }


def stats(values: Iterable[float | None]) -> dict:
    """p50/p90/p95/p99/p99.9 (numpy linear), mean, stdev (population), min, max, n; None values are skipped."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return {**{k: None for k in PERCENTILES}, "mean": None, "stdev": None, "min": None, "max": None, "n": 0}
    pct = np.percentile(a, list(PERCENTILES.values()), method=PERCENTILE_METHOD)
    out = {k: float(v) for k, v in zip(PERCENTILES, pct, strict=False)}
    out.update(mean=float(a.mean()), stdev=float(a.std(ddof=0)), min=float(a.min()), max=float(a.max()), n=int(a.size))
    return out


def parse_slo_name(name: str) -> tuple[str, str]:
    """'ttft_p99_ms' -> ('ttft', 'p99') (the spec's named SLO fields)."""
    m = _SLO_NAME.match(name)
    if not m or m["pct"] not in PERCENTILES:
        raise ValueError(f"SLO '{name}' is not <metric>_p<NN>_ms with a reported percentile")
    return m["metric"], m["pct"]


def _thresholds(slo) -> list[S.Threshold]:
    """Accept Threshold lists or the legacy {name: value} mapping of the spec's fields."""
    if not slo:
        return []
    if isinstance(slo, dict):
        out = []
        for name, value in slo.items():
            if value is None:
                continue
            parse_slo_name(name)
            out.append(S.parse_slo(f"{name}<={value}"))
        return out
    return list(slo)


def compute(records: list[RequestRecord], slo=None, *, by_class: bool = True) -> dict:
    """Aggregate the measured (non-warm-up) records. `slo`: thresholds (or {name: value})."""
    ths = _thresholds(slo)
    measured = [r for r in records if not r.warmup]
    cancelled = [r for r in measured if r.cancelled]
    judged = [r for r in measured if not r.cancelled]
    # A request that completed without a single output token produced nothing to time.
    good = [r for r in judged if r.ok and r.t_first_tok is not None]
    failed = [r for r in judged if not (r.ok and r.t_first_tok is not None)]
    per = [request_metrics(r) for r in good]

    sends = [r.t_send for r in measured if r.t_send is not None]
    ends = [t for r in good if (t := r.t_last_tok) is not None]  # all of them: good ones have tokens
    start, end = (min(sends), max(ends)) if sends and ends else (None, None)
    window_s = (end - start) / 1e9 if start is not None and end is not None and end > start else None

    def rate(count: float) -> float | None:
        return count / window_s if window_s else None

    total_osl = sum(p["osl"] for p in per)
    n_good_slo = sum(1 for p in per if S.request_meets(p, ths))
    gaps = [g for p in per for g in p["itl"]]
    reasons = Counter(_error_text(r) for r in failed)
    send_span = (max(sends) - min(sends)) / 1e9 if len(sends) > 1 else None
    # (server count, tokenizer count) where a request has both
    both = [(s, c) for r in good if (s := r.server_osl) is not None and (c := r.client_osl) is not None]
    out = {
        "num_requests": len(good),
        "sent": len(sends),
        "errors": len(failed),
        "error_reasons": dict(reasons.most_common(5)),
        "cancelled": len(cancelled),
        "timed_out": sum(1 for r in failed if r.timed_out),
        "not_sent": sum(1 for r in measured if r.t_send is None),
        "warmup_requests": sum(1 for r in records if r.warmup),
        "window_s": window_s,
        "window": {"definition": WINDOW_DEFINITION, "start_ns": start, "end_ns": end},
        "requests_per_s": rate(len(good)),
        "output_tokens_per_s": rate(total_osl),
        "output_tokens": total_osl,
        "goodput_req_per_s": rate(n_good_slo),
        "goodput_fraction": n_good_slo / len(judged) if judged else None,
        "achieved_send_rate": (len(sends) - 1) / send_span if send_span else None,
        "ttft_ms": stats(p["ttft"] for p in per),
        "ttfr_ms": stats(p["ttfr"] for p in per),
        "ttst_ms": stats(p["ttst"] for p in per),
        "tpot_ms": stats(p["tpot"] for p in per),
        "itl_ms": stats(g for g, _ in gaps),
        "itl_per_token_ms": stats(g / n for g, n in gaps),
        "e2e_ms": stats(p["e2e"] for p in per),
        "e2e_final_ms": stats(p["e2e_final"] for p in per),
        "send_lag_ms": stats(_ms(r.send_lag_ns) for r in measured if r.send_lag_ns is not None),
        "ttft_sched_ms": stats(p["ttft_sched"] for p in per),
        "e2e_sched_ms": stats(p["e2e_sched"] for p in per),
        "isl": stats(r.isl for r in good),
        "osl": stats(p["osl"] for p in per),
        **_speculation(good),
        "token_count_check": {
            "requests_with_both": len(both),
            "mismatches": sum(1 for s, c in both if s != c),
            "server_total": sum(s for s, _ in both),
            "client_total": sum(c for _, c in both),
        },
    }
    classes = sorted({r.cls for r in measured})
    if by_class and len(classes) > 1:
        out["per_class"] = {c: _class_view(compute([r for r in measured if r.cls == c], ths, by_class=False),
                                           next(r.adapter for r in measured if r.cls == c))
                            for c in classes}
    return out


_CLASS_KEYS = ("num_requests", "errors", "cancelled", "requests_per_s", "output_tokens_per_s", "goodput_fraction",
               "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "send_lag_ms", "osl")


def _speculation(good: list[RequestRecord]) -> dict:
    """Draft tokens proposed and accepted, as the server reported them per request (speculative
    deployments only): the acceptance rate over all of them, and its spread over requests."""
    # (drafted, accepted) for each request that reported drafts
    spec = [(d, r.accepted_draft_tokens or 0) for r in good if (d := r.draft_tokens)]
    if not spec:
        return {}
    drafted = sum(d for d, _ in spec)
    accepted = sum(a for _, a in spec)
    return {"speculation": {"requests": len(spec), "draft_tokens": drafted, "accepted_draft_tokens": accepted,
                            "acceptance_rate": accepted / drafted,
                            "acceptance_rate_per_request": stats(a / d for d, a in spec)}}


def _class_view(m: dict, adapter: str | None) -> dict:
    """A class's figures and the LoRA adapter its requests used (None: the base model), so per-class TTFT is
    per-adapter TTFT where classes name adapters."""
    return {"adapter": adapter, **{k: m[k] for k in _CLASS_KEYS}}


def itl_by_position(records: list[RequestRecord], max_positions: int = 512) -> dict:
    """Gap before the k-th token-bearing response (k = 2, 3, ...), pooled over requests:
    the plot that shows decode slowing as sequences grow or stalls at fixed steps."""
    buckets: list[list[float]] = []
    for r in records:
        if r.warmup or not r.ok:
            continue
        toks = r.token_responses()
        for k, (a, b) in enumerate(zip(toks, toks[1:max_positions + 1], strict=False)):
            if len(buckets) <= k:
                buckets.append([])
            buckets[k].append((b.t_ns - a.t_ns) / NS_PER_MS)
    return {"position": [k + 2 for k in range(len(buckets))],
            "mean_ms": [float(np.mean(b)) for b in buckets],
            "p90_ms": [float(np.percentile(b, 90)) for b in buckets],
            "n": [len(b) for b in buckets]}


def _error_text(rec: RequestRecord) -> str:
    if rec.error:
        return rec.error
    if rec.t_send is None:
        return "not sent"
    if rec.t_final is None:
        return "no final response"
    return "no output tokens"


def evaluate_slo(metrics: dict, slo) -> dict:
    """{'passed': bool, <threshold name>: {threshold, measured, passed}, 'errors': {...}}."""
    return S.evaluate(metrics, _thresholds(slo))
