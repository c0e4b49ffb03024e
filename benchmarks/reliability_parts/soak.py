"""Part (c) of benchmarks/reliability.py: a soak.

The saturation rate measured first (toolchain.bench, concurrency 8), then open-loop load at ~80 % of it
(mode rate); RSS growth and the drift of TTFT p99 from the first third of the run to the last.
"""

from __future__ import annotations

import time
from pathlib import Path

from reliability_parts.common import proc_snapshot, wait_idle


def _bench(spec, server, out: Path, **workload) -> tuple[dict, list[dict]]:
    """run_bench against `server` with the spec's workload changed by `workload`; the report and requests.csv."""
    import csv

    from toolchain.bench.run import run_bench

    wl = spec.validation.workload.model_copy(update={"warmup_requests": 2, "input_tokens": 64, "output_tokens": 32,
                                                     **workload})
    s = spec.model_copy(update={"validation": spec.validation.model_copy(update={"workload": wl})})
    report = run_bench(s, url=server.grpc_url, out_dir=out, metrics_url=server.metrics_url, plots=False,
                       request_timeout_s=60)
    with open(out / "requests.csv") as fh:
        rows = list(csv.DictReader(fh))
    return report, rows


def p99(xs):
    """The 99th percentile, nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def part_c(server, spec, soak_s: float, tmp: Path) -> dict:
    """Saturation measured, then `soak_s` seconds at 80 % of it."""
    from toolchain.bench import metrics as M  # noqa: F401

    sat, _ = _bench(spec, server, tmp / "sat", mode="concurrency", concurrency=8, num_requests=48)
    level = sat["levels"][0] if "levels" in sat else sat["results"][0]
    rate_sat = level["requests_per_s"]
    rate = round(0.8 * rate_sat, 2)
    wait_idle(server.metrics_url)
    before = proc_snapshot(server)
    n = max(8, int(rate * soak_s))
    report, rows = _bench(spec, server, tmp / "soak", mode="rate", rate=rate, arrival="constant", num_requests=n)
    time.sleep(1.0)
    wait_idle(server.metrics_url)
    after = proc_snapshot(server)
    lvl = report["levels"][0] if "levels" in report else report["results"][0]
    measured = [r for r in rows if r.get("warmup") in ("False", "false", "0", "")]
    ttft_key = next(k for k in rows[0] if k.startswith("ttft"))
    send_key = next((k for k in rows[0] if k in ("t_send_s", "t_send_ms", "send_s", "t_send")), None)
    if send_key:
        measured.sort(key=lambda r: float(r[send_key] or 0))
    vals = [float(r[ttft_key]) for r in measured if r[ttft_key] not in ("", "None", "nan")]
    third = max(1, len(vals) // 3)

    first, last = p99(vals[:third]), p99(vals[-third:])
    return {
        "saturation_req_s": round(rate_sat, 2), "rate_req_s": rate, "soak_s": soak_s, "requests": n,
        "rss_growth_pct": round(100.0 * (after["rss_kb"] - before["rss_kb"]) / before["rss_kb"], 2),
        "rss_kb_by_process_before_after": [before["rss_kb_by_process"], after["rss_kb_by_process"]],
        "ttft_p99_first_third_ms": round(first, 2), "ttft_p99_last_third_ms": round(last, 2),
        "ttft_p99_drift_pct": round(100.0 * (last - first) / first, 1),
        "errors": lvl["errors"], "achieved_send_rate": lvl.get("achieved_send_rate"),
        "ttft_column": ttft_key, "order_column": send_key,
    }
