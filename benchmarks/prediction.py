"""How close the performance model comes: predicted over measured, on this host's CPU engine.

build/tiny-llama.yaml (the embedded default) deployed on CPU as `toolchain deploy` does it, benched closed loop
at concurrency 1, 4 and 16 (one sweep on one server) with the spec's workload (ISL 64, OSL 32 exactly), and the
`prediction` object `toolchain bench` writes beside each level (plan/perf.py from this host's profile, which the
script takes with `toolchain probe-host` first: cached unless --probe). Ratios are predicted / measured mean.

Keys (issue 26, item 8): `cpu_tpot_pred_over_measured_c1`, `_c4`, `_c16` (target 0.85-1.15 each),
`cpu_ttft_pred_over_measured_c1`, `_c16` (target 0.75-1.33); `gpu_holdout_mape`, `tuned_vs_default_goodput_ratio`
and `tuned_quality_loss_pct` stay null until the calibration and tune branches land (one line each in
PENDING below); `load_average` says how busy the host was.

    python benchmarks/prediction.py [--json PATH] [--requests N] [--probe]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402

SPEC = REPO / "build" / "tiny-llama.yaml"
CONCURRENCIES = (1, 4, 16)
TARGETS: dict[str, tuple[float, float]] = {
    **{f"cpu_tpot_pred_over_measured_c{c}": (0.85, 1.15) for c in (1, 4, 16)},
    **{f"cpu_ttft_pred_over_measured_c{c}": (0.75, 1.33) for c in (1, 16)},
}
# Filled when the calibration/tune branches land: key -> (value, target as text); the lead wires each in one line.
PENDING: dict[str, tuple[float | None, str]] = {
    "gpu_holdout_mape": (None, "<= 15 (%)"),
    "tuned_vs_default_goodput_ratio": (None, "see issue 26"),
    "tuned_quality_loss_pct": (None, "<= 1"),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spec_for(requests: int):
    from toolchain.spec import load_spec

    return load_spec(SPEC, [
        "serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
        "validation.workload.mode=concurrency", f"validation.workload.sweep={list(CONCURRENCIES)}",
        f"validation.workload.num_requests={requests}", f"validation.workload.warmup_requests={max(CONCURRENCIES)}",
        "validation.workload.seed=0"])


def run(requests: int, probe: bool) -> dict[str, Any]:
    from toolchain.hostprofile import load_profile, save_profile
    from toolchain.pipeline import deploy, probe_host
    from toolchain.workspace import Workspace

    spec = spec_for(requests)
    threads = spec.serving.engine_threads
    profile = None if probe else load_profile(threads)
    if profile is None:
        log("probing the host (toolchain probe-host) ...")
        profile = probe_host(threads, progress=lambda stage, msg: log(f"probe-host {stage:<12} {msg}"))
        save_profile(profile)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prediction-") as tmp:
        root = Path(tmp)
        report = deploy(spec, Workspace(root), root / "report", lambda stage, msg: log(f"{stage:<12} {msg}"))
    pred = report.get("prediction") or {}
    results: dict[str, Any] = {"profile": {"measured_at": profile.measured_at, "step_us": profile.step_us,
                                           "layer_us": profile.layer_us, "sequence_us": profile.sequence_us,
                                           "stream_gb_s": profile.stream_gb_s, "cache_gb_s": profile.cache_gb_s,
                                           "serving": {k: v for k, v in (profile.serving or {}).items()
                                                       if k != "measured"} or None},
                               "basis": pred.get("basis"), "requests_per_level": requests,
                               "load_average": {"before": [round(x, 2) for x in load_before],
                                                "after": [round(x, 2) for x in os.getloadavg()]},
                               "seconds": round(time.perf_counter() - started, 1), "levels": {}}
    if not pred.get("predicted"):
        results["note"] = pred.get("note", "no prediction in the report")
    for row in pred.get("levels", []):
        if not row.get("predicted"):
            continue
        c = row["concurrency"]
        results["levels"][f"c{c}"] = {k: row[k] for k in ("ttft_ms", "tpot_ms", "output_tokens_per_s",
                                                           "measured", "ratio")}
        for metric in ("ttft", "tpot"):
            key = f"cpu_{metric}_pred_over_measured_c{c}"
            if key in TARGETS:
                results[key] = row["ratio"][f"{metric}_ms"]
    results["targets"] = {}
    for key, (low, high) in TARGETS.items():
        value = results.get(key)
        results.setdefault(key, None)
        results["targets"][key] = {"target": [low, high],
                                   "pass": None if value is None else bool(low <= value <= high)}
    for key, (value, target) in PENDING.items():
        results[key] = value
        results["targets"][key] = {"target": target, "pass": None,
                                   "note": "filled when the calibration/tune branches land"}
    results["all_cpu_targets_pass"] = all(results["targets"][k]["pass"] for k in TARGETS)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--requests", type=int, default=96, help="measured requests per concurrency level")
    ap.add_argument("--probe", action="store_true", help="measure the host again first (probe-host --force)")
    args = ap.parse_args()
    print_and_write(run(args.requests, args.probe), args.json)


if __name__ == "__main__":
    main()
