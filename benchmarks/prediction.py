"""How close the performance model comes: predicted over measured, on this host's CPU engine.

build/tiny-llama.yaml (the embedded default) deployed on CPU as `toolchain deploy` does it, benched closed loop
at concurrency 1, 4 and 16 (one sweep on one server) with the spec's workload (ISL 64, OSL 32 exactly), and the
`prediction` object `toolchain bench` writes beside each level (plan/perf/ from this host's profile, which the
script takes with `toolchain probe-host` first: cached unless --probe). Ratios are predicted / measured mean.

Keys (issue 26, item 8): `cpu_tpot_pred_over_measured_c1`, `_c4`, `_c16` (target 0.85-1.15 each),
`cpu_ttft_pred_over_measured_c1`, `_c16` (target 0.75-1.33); `gpu_holdout_mape`, the mean of the held-out
TTFT, TPOT and throughput errors on AIConfigurator's measured GPU runs (plan/calibration.py; target <= 15%), with
each of the three beside it, `holdout_ttft_mape`, `holdout_tpot_mape`, `holdout_throughput_mape` (targets <= 15,
6, 6); NVIDIA's published trtllm-bench maximum throughputs, never fitted to (benchmarks/prediction_parts/published.py):
`published_within_15pct_fraction` (target >= 0.9), `published_within_20pct_fraction` and
`published_median_abs_error_pct` (target <= 8) over release 0.17's Hopper/Ampere engine-path points and release
1.0's Hopper PyTorch-path points together (`published_point_count`), the same per table (`published_v017_*`,
`published_v1_0_*` with each point under `published_v1_0_points`) and per path (`published_by_path`),
`published_tp_order_kept` (the groups differing only in TP whose predicted ranking of the TPs is the published one,
the broken ones listed; `published_tp_order_kept_fraction`, target 1.0); reported apart: `blackwell_fp4_published_*`
(release/1.2's per-GPU and release 1.0's Blackwell NVFP4 Llama points together, per table under
`blackwell_fp4_published_by_table`, each point listed) and `moe_families_published_*` (DeepSeek R1 at attention DP,
gpt-oss-120b at DEP2 and TP1, Llama 4 Scout at TP4, each point listed, each model's median and worst error and
points within +-30% under `moe_families_published_by_model`);
`tuned_vs_default_goodput_ratio` (target >= 1.3) and `tuned_quality_loss_pct` (target <= 1) from
benchmarks/prediction_parts/tune_gain.py (`toolchain tune --measure`, about 10 minutes; --skip-tune leaves them
null); `load_average` says how busy the host was.

    python benchmarks/prediction.py [--json PATH] [--requests N] [--probe] [--skip-tune]
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
LIMITS: dict[str, tuple[str, float]] = {  # key -> (comparison, target)
    "gpu_holdout_mape": ("<=", 15.0),
    "holdout_tpot_mape": ("<=", 6.0),  # issue 39's held-out targets
    "holdout_ttft_mape": ("<=", 15.0),
    "holdout_throughput_mape": ("<=", 6.0),
    "published_within_15pct_fraction": (">=", 0.9),
    "published_median_abs_error_pct": ("<=", 8.0),
    "published_tp_order_kept_fraction": (">=", 1.0),
    "tuned_vs_default_goodput_ratio": (">=", 1.3),
    "tuned_quality_loss_pct": ("<=", 1.0),
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
    from toolchain.pipeline import deploy
    from toolchain.probe_host import probe_host
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
    results["all_cpu_targets_pass"] = all(results["targets"][k]["pass"] for k in TARGETS)
    return results


def gpu_keys() -> dict[str, Any]:
    from toolchain.plan.calibration import holdout_mape

    mape = holdout_mape()
    parts = {k: round(mape[k], 2) for k in ("ttft", "tpot", "throughput")}
    return {"gpu_holdout_mape": round(mape["gpu_holdout_mape"], 2), "gpu_holdout_mape_parts": parts,
            **{f"holdout_{k}_mape": v for k, v in parts.items()}}


def published_keys() -> dict[str, Any]:
    """NVIDIA's published maximum throughputs, never fitted to (benchmarks/prediction_parts/published.py)."""
    from prediction_parts.published import published_keys as keys

    return keys()


def tune_keys() -> dict[str, Any]:
    from prediction_parts.tune_gain import tuned_keys

    with tempfile.TemporaryDirectory(prefix="tune-bench-") as tmp:
        doc = tuned_keys(top=2, repeats=2, root=Path(tmp))
    return {**{k: doc[k] for k in ("tuned_vs_default_goodput_ratio", "tuned_quality_loss_pct")},
            "tune": {k: v for k, v in doc.items() if k not in ("targets",)}}


def judge(results: dict[str, Any]) -> None:
    for key, (op, target) in LIMITS.items():
        value = results.setdefault(key, None)
        ok = None if value is None else (value <= target if op == "<=" else value >= target)
        results["targets"][key] = {"target": f"{op} {target}", "pass": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--requests", type=int, default=96, help="measured requests per concurrency level")
    ap.add_argument("--probe", action="store_true", help="measure the host again first (probe-host --force)")
    ap.add_argument("--skip-tune", action="store_true", help="leave the tuned_* keys null (saves ~10 minutes)")
    args = ap.parse_args()
    results = run(args.requests, args.probe)
    results.update(gpu_keys())
    results.update(published_keys())
    if not args.skip_tune:
        results.update(tune_keys())
    judge(results)
    print_and_write(results, args.json)


if __name__ == "__main__":
    main()
