"""How long one request may take, and when a run gives up on its endpoint.

A hung endpoint (a model whose execute() never returns, a server that sends
headers and then nothing) must be reported in seconds, not after every
request of every level has used its whole deadline. Two rules do that:

- The request deadline. `validation.workload.request_timeout_s` (or
  `--request-timeout`) when set; otherwise derived from the workload and the
  SLOs: DEADLINE_MULTIPLE times the longest one request may take under them
  (the e2e limit, or the ttft limit plus the longest output times the
  per-token limit, whichever is tighter), never below DEADLINE_FLOOR_S; with
  no SLO bounding a whole request, FALLBACK_TIMEOUT_S. A request five times
  over what the SLOs allow it is stuck, not a tail sample; the floor keeps
  tight SLOs on a small workload from timing out requests on a loaded host.
- The stop. Once `limit` requests in a row (in the order they ended, warm-up
  included) timed out or failed, the run stops: requests in flight are
  cancelled, nothing more is sent, and the report says why under `stopped`.
  The default limit is the level's concurrency, at least MIN_STREAK: every
  request in flight may fail together in one stall, so the streak must also
  hold a request sent after the failures began. A success, or a request
  cancelled on purpose, ends a streak. A warm-up in which no request
  answered stops the run too, however short: the first level would only
  wait out another deadline to learn the same.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from toolchain.bench.records import RequestRecord
from toolchain.slo import Threshold

DEADLINE_MULTIPLE = 5
DEADLINE_FLOOR_S = 30.0
FALLBACK_TIMEOUT_S = 300.0  # the old fixed default, kept where no SLO says how long a request may take
MIN_STREAK = 3

# Metrics whose bound also bounds a request's first token, each later token, or the whole request. A chunk's gap
# (itl) is at least the per-token time of its tokens, so an itl bound is a tpot bound too.
_FIRST = ("ttft", "ttft_sched")
_PER_TOKEN = ("tpot", "itl", "itl_per_token")
_WHOLE = ("e2e", "e2e_final", "e2e_sched")


@dataclass(frozen=True)
class Deadline:
    seconds: float
    source: str
    """Where the value came from, for report.json: the spec, the caller, or how it was derived."""


def longest_output(wl, file_entries: list[dict] | None, max_seq_len: int) -> int:
    """The most output tokens one request of the workload asks for (three standard deviations over the
    largest mean: the sampled lengths are normal), at most what the engine holds."""
    means = [wl.output_tokens, *(c.output_tokens for c in wl.classes if c.output_tokens)]
    means += [e["output_tokens"] for e in file_entries or [] if e.get("output_tokens")]
    return max(1, min(max(means) + math.ceil(3 * wl.output_tokens_stddev), max_seq_len - 1))


def _bound(thresholds: list[Threshold], metrics: tuple[str, ...]) -> float | None:
    """The tightest of the metrics' bounds, each metric at its loosest statistic (a single request may be
    the p99 one)."""
    per_metric: dict[str, float] = {}
    for t in thresholds:
        name = t.metric.removesuffix("_ms")
        if t.upper and t.stat is not None and name in metrics:
            per_metric[name] = max(per_metric.get(name, 0.0), t.value)
    return min(per_metric.values()) if per_metric else None


def derived_timeout(thresholds: list[Threshold], osl: int) -> Deadline:
    """The request deadline the SLOs imply for requests of up to `osl` output tokens."""
    first, per_token, whole = _bound(thresholds, _FIRST), _bound(thresholds, _PER_TOKEN), _bound(thresholds, _WHOLE)
    budgets: list[tuple[float, str]] = []
    if whole is not None:
        budgets.append((whole, f"e2e {whole:g} ms"))
    if first is not None and per_token is not None:
        budgets.append((first + osl * per_token, f"ttft {first:g} ms + {osl} x tpot {per_token:g} ms"))
    if not budgets:
        return Deadline(FALLBACK_TIMEOUT_S, f"default: no SLO bounds a whole request ({FALLBACK_TIMEOUT_S:g} s)")
    ms, how = min(budgets)
    seconds = max(DEADLINE_FLOOR_S, DEADLINE_MULTIPLE * ms / 1000.0)
    return Deadline(round(seconds, 3), f"derived: max({DEADLINE_FLOOR_S:g} s, {DEADLINE_MULTIPLE} x ({how}))")


def request_deadline(wl, thresholds: list[Threshold], osl: int, override_s: float | None) -> Deadline:
    """The caller's value, else the spec's, else the derived one."""
    if override_s:
        return Deadline(override_s, "--request-timeout")
    if wl.request_timeout_s:
        return Deadline(wl.request_timeout_s, "validation.workload.request_timeout_s")
    return derived_timeout(thresholds, osl)


def failure_limit(wl, load: float) -> int:
    """Requests in a row that may fail before the run stops, at a level of `load`."""
    if wl.max_consecutive_failures:
        return wl.max_consecutive_failures
    return max(MIN_STREAK, int(load)) if wl.mode == "concurrency" else MIN_STREAK


class Streak:
    """The requests that failed in a row, in the order they ended."""

    def __init__(self) -> None:
        self.failed: list[RequestRecord] = []

    def add(self, rec: RequestRecord) -> int:
        """Count a request that ended; returns the streak's length."""
        if rec.error is None or rec.cancelled:
            self.failed.clear()
        else:
            self.failed.append(rec)
        return len(self.failed)

    def reason(self, subject: str | None = None) -> str:
        """'4 consecutive requests timed out after 12 s', or the last error of a mixed streak; `subject`
        names the requests otherwise ('all 2 warm-up requests')."""
        n, errors = len(self.failed), {r.error or "" for r in self.failed}  # each failed one has its error
        subject = subject or f"{n} consecutive requests"
        if len(errors) == 1:
            (error,) = errors
            verb = "" if error.startswith("timed out") else "failed: "
            return f"{subject} {verb}{error}"
        return f"{subject} timed out or failed (the last: {self.failed[-1].error})"


def last_response(records: list[RequestRecord], now_ns: int | None = None) -> dict | None:
    """What the endpoint sent last in this run: the request, its status line (HTTP), its streamed responses
    (tokens: the server's counts, else one per text chunk), their first bytes; None when nothing came back."""
    now_ns = time.perf_counter_ns() if now_ns is None else now_ns
    best, t_best = None, -1
    for r in records:
        t = max(r.t_status or -1, r.responses[-1].t_ns if r.responses else -1)
        if t > t_best:
            best, t_best = r, t
    if best is None:
        return None
    first = next((x.text for x in best.responses if x.text), None)
    return {"request_id": best.request_id, "status": best.status, "responses": len(best.responses),
            "tokens": sum(x.n_tok for x in best.responses) or sum(1 for x in best.responses if x.text),
            "first_bytes": first[:40] if first else None, "error": best.error,
            "seconds_before_stop": round((now_ns - t_best) / 1e9, 1)}


def describe_last(last: dict | None) -> str:
    if last is None:
        return "none, no request got any answer"
    parts = [last["status"]] if last["status"] else []
    if last["responses"]:
        first = f", first bytes {last['first_bytes']!r}" if last["first_bytes"] else ""
        parts.append(f"{last['responses']} streamed responses, {last['tokens']} tokens{first}")
    else:
        parts.append("nothing streamed")
    return f"{', '.join(parts)} for request {last['request_id']}, {last['seconds_before_stop']:g} s before the stop"


def stop_line(stopped: dict) -> str:
    """The one line `toolchain bench` and `deploy` print for a stopped run."""
    where = "the warm-up" if stopped["level"] == "warmup" else f"level {stopped['level']}"
    return (f"bench stopped at {where}: {stopped['reason']}, model '{stopped['model']}' at {stopped['url']}; "
            f"last response seen: {describe_last(stopped['last_response'])}")
