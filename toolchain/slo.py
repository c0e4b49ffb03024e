"""SLO thresholds: parse them, judge a level's metrics, judge one request.

A threshold names a statistic of a reported metric and a bound:

- latency: `<metric>_<stat>_ms <= value`, with metric one of LATENCY_METRICS
  (the report's `<metric>_ms` blocks) and stat p50/p90/p95/p99/p99_9/mean/max.
  Strings may be written loosely: "ttft_p99_ms<=500", "itl p99.9 <= 80 ms",
  "tpot:p90<0.05s". The spec's fields (ttft_p99_ms: 500) are the same thing.
- throughput: `requests_per_s >= v`, `output_tokens_per_s >= v`,
  `goodput_req_per_s >= v`, `goodput_fraction >= v`.

Goodput judges each request against the per-request latency thresholds (TTFT,
TPOT, E2E, ...; a request with OSL <= 1 has no TPOT and cannot miss it, the
vLLM rule); ITL and send lag are distributions over gaps/requests, not
per-request figures, so they bound the level but not goodput.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LATENCY_METRICS = ("ttft", "ttfr", "ttst", "tpot", "itl", "itl_per_token", "e2e", "e2e_final",
                   "send_lag", "ttft_sched", "e2e_sched")
PER_REQUEST = ("ttft", "ttfr", "ttst", "tpot", "e2e", "e2e_final", "ttft_sched", "e2e_sched")
STATS = ("p50", "p90", "p95", "p99", "p99_9", "mean", "max")
RATE_KEYS = ("requests_per_s", "output_tokens_per_s", "goodput_req_per_s", "goodput_fraction")

_METRIC = "|".join(sorted(LATENCY_METRICS, key=len, reverse=True))
_LATENCY = re.compile(
    rf"^(?P<metric>{_METRIC})[\s_:]+(?P<stat>p\d+(?:[._]\d+)?|mean|max)(?:_ms)?\s*(?P<op><=|<|=)\s*"
    r"(?P<value>\d+(?:\.\d*)?(?:e[-+]?\d+)?)\s*(?P<unit>ms|s)?$")
_RATE = re.compile(rf"^(?P<key>{'|'.join(RATE_KEYS)})\s*(?P<op>>=|>|=)\s*(?P<value>\d+(?:\.\d*)?(?:e[-+]?\d+)?)$")


@dataclass(frozen=True)
class Threshold:
    name: str
    """Canonical name, e.g. ttft_p99_ms or goodput_fraction."""
    metric: str
    """Report key the bound applies to: `ttft_ms` (with stat) or a rate key."""
    stat: str | None
    value: float
    upper: bool
    """True: measured must be <= value (latency); False: >= value (throughput)."""

    def holds(self, measured: float | None) -> bool:
        if measured is None:
            return False
        return measured <= self.value if self.upper else measured >= self.value


def parse_slo(text: str) -> Threshold:
    """'itl p99.9 <= 80 ms' -> Threshold('itl_p99_9_ms', 'itl_ms', 'p99_9', 80.0, upper=True)."""
    s = " ".join(str(text).strip().lower().split())
    m = _LATENCY.match(s)
    if m:
        stat = m["stat"].replace(".", "_")
        if stat not in STATS:
            raise ValueError(f"SLO '{text}': statistic '{m['stat']}' is not one of {', '.join(STATS)}")
        value = float(m["value"]) * (1000.0 if m["unit"] == "s" else 1.0)
        return Threshold(f"{m['metric']}_{stat}_ms", f"{m['metric']}_ms", stat, value, upper=True)
    m = _RATE.match(s)
    if m:
        return Threshold(m["key"], m["key"], None, float(m["value"]), upper=False)
    raise ValueError(f"SLO '{text}' does not parse; write <metric>_<stat>_ms<=<value> (metric: "
                     f"{', '.join(LATENCY_METRICS)}; stat: {', '.join(STATS)}) or <rate key> >= <value> "
                     f"({', '.join(RATE_KEYS)}), e.g. 'ttft_p99_ms<=500'")


def thresholds(slo_section, extra: tuple[str, ...] | list[str] = ()) -> list[Threshold]:
    """The spec's slo section (named fields + `extra` strings) plus more strings (CLI --slo); later wins."""
    out: dict[str, Threshold] = {}
    for name, value in slo_section.model_dump().items():
        if name == "extra" or value is None:
            continue
        t = parse_slo(f"{name}<={value}")
        out[t.name] = t
    for text in [*slo_section.extra, *extra]:
        t = parse_slo(text)
        out[t.name] = t
    return list(out.values())


def measured(metrics: dict, t: Threshold) -> float | None:
    block = metrics.get(t.metric)
    if t.stat is None:
        return block
    return None if not block else block.get(t.stat)


def evaluate(metrics: dict, ths: list[Threshold]) -> dict:
    """{'passed': bool, <name>: {threshold, measured, passed}, 'errors': {...}}.

    Failed requests fail the level: percentiles over the survivors would hide them.
    Requests cancelled on purpose are not failures.
    """
    out: dict = {}
    for t in ths:
        value = measured(metrics, t)
        out[t.name] = {"threshold": t.value, "measured": value, "passed": t.holds(value)}
    out["errors"] = {"threshold": 0, "measured": metrics["errors"], "passed": metrics["errors"] == 0}
    ok = all(v["passed"] for v in out.values()) and metrics["num_requests"] > 0
    return {"passed": ok, **out}


def request_meets(per_req: dict, ths: list[Threshold]) -> bool:
    """Goodput test of one request's metrics (ms) against the per-request latency thresholds."""
    for t in ths:
        metric = t.metric.removesuffix("_ms")
        if not t.upper or metric not in PER_REQUEST:
            continue
        value = per_req.get(metric)
        if value is None:
            if metric in ("tpot", "ttst"):  # undefined for OSL <= 1: cannot be missed
                continue
            return False
        if value > t.value:
            return False
    return True


# The predicted counterpart of a latency metric: plan's performance model predicts one steady-state (or one bench
# level's) mean TTFT and TPOT per deployment, no spread, so a percentile or max bound is judged on that mean and
# every output that judges one says so (`on_mean`, `judged_on`).
PREDICTED_METRIC = {"ttft": "ttft", "ttfr": "ttft", "tpot": "tpot", "itl": "tpot", "itl_per_token": "tpot",
                    "e2e": "e2e", "e2e_final": "e2e"}


def predicted_value(t: Threshold, ttft_ms: float, tpot_ms: float, output_tokens: int) -> float | None:
    """The predicted mean a latency threshold is judged on (ms): TTFT, TPOT (a token's gap: ITL too), or E2E as
    TTFT plus the other output tokens' TPOT; None where nothing is predicted (rates, send lag, ...)."""
    metric = PREDICTED_METRIC.get(t.metric.removesuffix("_ms")) if t.upper else None
    if metric == "ttft":
        return ttft_ms
    if metric == "tpot":
        return tpot_ms
    if metric == "e2e":
        return ttft_ms + max(output_tokens - 1, 0) * tpot_ms
    return None


def on_mean(t: Threshold) -> bool:
    """A predicted threshold whose statistic is not the mean (a percentile, the max): its prediction is a mean."""
    return t.upper and t.stat != "mean" and t.metric.removesuffix("_ms") in PREDICTED_METRIC


def judged_on(ths: list[Threshold]) -> str | None:
    """The clause saying which bounds a predicted mean stands for, or None when none does."""
    names = [t.name for t in ths if on_mean(t)]
    if not names:
        return None
    return f"{', '.join(names)} judged on the predicted mean: the model predicts means, no percentiles"
