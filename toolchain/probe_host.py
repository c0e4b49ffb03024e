"""`toolchain probe-host`'s measurement: the CPU engine's rates and fixed costs (engine/probe.py), then what
serving adds to them, measured by deploying the embedded tiny model as `deploy` does it (pipeline.deploy) and
setting the bench's TTFT and TPOT against the performance model's kernel time."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from toolchain.errors import StageFailed
from toolchain.pipeline import Progress, deploy
from toolchain.plan.model import load_model
from toolchain.plan.perf import predict_spec
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

TINY_SPEC = Path(__file__).resolve().parents[1] / "build" / "tiny-llama.yaml"
"""The embedded default deployment; probe-host serves it to measure what serving adds to the engine."""
SERVING_PROBE_LEVELS = (1, 8)


def _probe_deploy(spec_path: Path, profile, levels: tuple[int, ...], requests: int, progress: Progress):
    """One of probe-host's served measurements: `spec_path` deployed as `deploy` does it in a scratch workspace, on
    free ports with the profile's engine threads, benched closed loop at `levels` with `requests` per level.
    Returns (the spec as deployed, its report)."""
    spec = load_spec(spec_path, [
        "serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
        f"serving.engine_threads={profile.key.threads}", "validation.workload.mode=concurrency",
        f"validation.workload.sweep={list(levels)}", f"validation.workload.num_requests={requests}",
        # A fresh server's first requests run slower (first calls, the allocator warming): eight go unmeasured, or
        # the per-step cost read from the first level comes out high and every prediction after it with it.
        "validation.workload.warmup_requests=8", "validation.workload.seed=0"])
    with tempfile.TemporaryDirectory(prefix="probe-host-") as tmp:
        return spec, deploy(spec, Workspace(Path(tmp)), Path(tmp) / "report", progress)


def probe_serving(profile, progress: Progress = lambda stage, msg: None) -> dict | None:
    """The served path's own costs, measured: the embedded tiny model deployed as `deploy` does it (Triton's
    ensemble over gRPC, streaming), benched closed loop at concurrency 1 and 8, each level's mean TPOT and (at 1)
    TTFT set against the performance model's kernel time for it (with the probe's per-layer cost). The differences
    are the path's cost per step and per sequence in a step (the engine's scheduling and sampling with the
    responses' way out), which stand in for the engine-only ones in predictions, and per request (its way in and
    its first token's way out). None when the embedded spec is not in this checkout."""
    if not TINY_SPEC.is_file():
        return None
    spec, report = _probe_deploy(TINY_SPEC, profile, SERVING_PROBE_LEVELS, 48, progress)
    levels = {int(lv["load"]["value"]): lv for lv in report.get("levels", [])}
    if sorted(levels) != list(SERVING_PROBE_LEVELS) or any(lv["errors"] for lv in levels.values()):
        raise StageFailed("probe-host: the serving probe's bench did not complete", "see the messages above")
    low, high = SERVING_PROBE_LEVELS
    # The served steps' costs beyond their kernels and the per-layer cost, measured whole: the engine's own step and
    # sequence costs (measured in this process, at another moment) are left out rather than subtracted.
    bare = dataclasses.replace(profile, step_us=0.0, sequence_us=0.0)
    predicted = {c: predict_spec(spec, concurrency=c, profile=bare) for c in SERVING_PROBE_LEVELS}
    extra = {c: levels[c]["tpot_ms"]["mean"] - predicted[c]["tpot_ms"] for c in SERVING_PROBE_LEVELS}
    sequence_ms = max((extra[high] - extra[low]) / (high - low), 0.0)
    step_ms = max(extra[low] - sequence_ms * low, 0.0)
    # The prompt's step pays the same two costs; what is left of TTFT is the request's own way in and out.
    request_ms = max(levels[low]["ttft_ms"]["mean"] - predicted[low]["ttft_ms"] - step_ms - sequence_ms, 0.0)
    return {"protocol": spec.validation.workload.protocol, "step_us": round(step_ms * 1e3, 2),
            "sequence_us": round(sequence_ms * 1e3, 2), "request_us": round(request_ms * 1e3, 2),
            "measured": {f"c{c}": {"ttft_ms": round(levels[c]["ttft_ms"]["mean"], 3),
                                   "tpot_ms": round(levels[c]["tpot_ms"]["mean"], 3),
                                   "kernels_ttft_ms": predicted[c]["ttft_ms"],
                                   "kernels_tpot_ms": predicted[c]["tpot_ms"]} for c in SERVING_PROBE_LEVELS}}


RANKS_SPEC = TINY_SPEC.with_name("tiny-llama-ranks.yaml")
RANKS_PROBE_CONCURRENCY = 4


def probe_ranks(profile, progress: Progress = lambda stage, msg: None) -> dict | None:
    """The rank exchange as the served `serving.launch: mpirun` path pays it: the embedded tiny model's tp-2 ranks
    (build/tiny-llama-ranks.yaml) deployed as `deploy` does it and benched at concurrency 4. Two rank processes
    alone exchange in a fraction of a millisecond (engine/probe.py gloo_exchange), but served they share the
    cores with tritonserver, the Python backend and the client, and each exchange waits until its peer is
    scheduled; what the measured TPOT has beyond the prediction with the bare exchange is spread over the step's
    all-reduces (two per layer) as their served fixed cost. None without the spec or a measured exchange."""
    if not RANKS_SPEC.is_file() or profile.gloo is None:
        return None
    spec, report = _probe_deploy(RANKS_SPEC, profile, (RANKS_PROBE_CONCURRENCY,), 32, progress)
    levels = report.get("levels", [])
    if len(levels) != 1 or levels[0]["errors"]:
        raise StageFailed("probe-host: the rank probe's bench did not complete", "see the messages above")
    predicted = predict_spec(spec, concurrency=RANKS_PROBE_CONCURRENCY, profile=profile)
    exchanges = 2 * load_model(spec.model.checkpoint).params.num_hidden_layers  # two all-reduces per layer
    extra_ms = max(levels[0]["tpot_ms"]["mean"] - predicted["tpot_ms"], 0.0)
    return {"served_latency_us": round(profile.gloo["latency_us"] + extra_ms * 1e3 / exchanges, 2),
            "served_tpot_ms": round(levels[0]["tpot_ms"]["mean"], 3), "bare_tpot_ms": predicted["tpot_ms"]}


def probe_host(threads: int, *, serving: bool = True, progress: Progress = lambda stage, msg: None):
    """`toolchain probe-host`'s measurement: the engine's rates and fixed costs (engine/probe.py), then, with
    `serving`, what serving adds (`probe_serving`). The caller caches it (hostprofile.save_profile)."""
    from toolchain.engine.probe import measure  # torch

    started = time.perf_counter()
    profile = measure(threads, log=lambda line: progress("probe", line))
    if serving:
        progress("probe", "what serving adds (the embedded tiny model through tritonserver, concurrency 1 and 8) ...")
        profile = dataclasses.replace(profile, serving=probe_serving(profile, progress))
        if profile.gloo is not None:
            progress("probe", "the rank exchange served (the embedded tiny model's tp-2 ranks under mpirun) ...")
            ranks = probe_ranks(profile, progress)
            if ranks is not None:
                profile = dataclasses.replace(profile, gloo={**profile.gloo, **ranks})
    return dataclasses.replace(profile, seconds=round(time.perf_counter() - started, 2))
