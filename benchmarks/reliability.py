"""Reliability of a real deployment of the embedded default (build/tiny-llama.yaml, CPU engine, tritonserver).

Five parts, each against what the server itself says (readiness, /metrics, its log, /proc):

- (a) hostile requests: malformed requests over gRPC (tritonclient and raw, truncated protobufs) and
  HTTP (generate, generate_stream, infer) to every model, interleaved with valid requests whose outputs
  are checked against the CPU engine's greedy output;
- (b) cancellation storm: streams cancelled at random points, by closing the client stream and by the
  `stop` input with the request id; KV blocks, active requests, stub threads and RSS before/after;
- (c) soak: open-loop load at ~80 % of the measured saturation rate (toolchain.bench, mode rate);
- (d) crash safety: kill -9 of `toolchain convert`, `build-engine` and `model-repo` at random points;
  the final directory is never a partial one and the rerun is byte-identical to an uninterrupted run;
- (e) a dying model instance: the tensorrt_llm stub killed with requests in flight, and during load.
  The figures (`dying_instance.hung_requests`, `time_to_detect_s`) are those of the path users run,
  `toolchain serve` (a subprocess): it watches for dead stubs and on one stops tritonserver, which ends
  every in-flight request (the connection closes), prints one line naming the instance and exits non-zero;
  no tritonserver, stub or /dev/shm region of it may be left. The same kill under a bare TritonServer
  object, with nothing watching it, is kept for information only (`hung_requests_bare_tritonserver`,
  the section's `bare_tritonserver`): tritonserver 2.51 never ends the requests in flight on a dead
  Python-backend stub, nor restarts it, nor stops answering ready, so there every request hangs; that is
  the server's behaviour the serve loop exists to contain, not a figure of the deployment.

    python benchmarks/reliability.py [--json PATH] [--quick] [--soak-s S] [--parts abcde]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The parts live in benchmarks/reliability_parts/ (this script's folder is on sys.path when it runs);
# tests/test_reliability_small.py calls deploy and the part_* functions through this module.
from reliability_parts.cancellation import part_b  # noqa: E402
from reliability_parts.common import deploy, log  # noqa: E402
from reliability_parts.crash import part_d  # noqa: E402
from reliability_parts.dying import part_e, part_e_load, part_e_serve  # noqa: E402
from reliability_parts.hostile import part_a  # noqa: E402
from reliability_parts.soak import part_c  # noqa: E402

from toolchain.bench.results import print_and_write  # noqa: E402

__all__ = ["deploy", "part_a", "part_b", "part_c", "part_d", "part_e", "part_e_load", "part_e_serve", "main"]

TARGETS = {"server_crashes": 0, "model_instance_deaths": 0, "valid_outputs_wrong": 0, "unanswered_requests": 0,
           "kv_or_slots_leaked": 0, "threads_leaked": 0, "cancel_rss_growth_pct": 5, "kills_rerun_mismatches": 0,
           "partial_outputs_used": 0, "hung_requests": 0}
# The flat summary printed at the end: (key, section) of the results, as `section.key`.
SUMMARY_KEYS = (("hostile_requests", "hostile"), ("server_crashes", "hostile"),
                ("model_instance_deaths", "hostile"), ("valid_outputs_wrong", "hostile"),
                ("unanswered_requests", "hostile"), ("kv_or_slots_leaked", "cancellation"),
                ("threads_leaked", "cancellation"), ("rss_growth_pct", "cancellation"),
                ("rss_growth_pct", "soak"), ("ttft_p99_drift_pct", "soak"), ("errors", "soak"),
                ("kills", "crash_safety"), ("rerun_mismatches", "crash_safety"),
                ("partial_outputs_used", "crash_safety"), ("hung_requests", "dying_instance"),
                ("time_to_detect_s", "dying_instance"), ("serve_exit_code", "dying_instance"),
                ("hung_requests_bare_tritonserver", "dying_instance"))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; the part sizes left unset take --quick's or the full run's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--soak-s", type=float, default=None)
    ap.add_argument("--parts", default="abcde")
    ap.add_argument("--hostile", type=int, default=None)
    ap.add_argument("--cancel", type=int, default=None)
    ap.add_argument("--kills", type=int, default=None)
    args = ap.parse_args(argv)
    q = args.quick
    args.hostile = args.hostile or (1000 if q else 10000)
    args.cancel = args.cancel or (200 if q else 1000)
    args.kills = args.kills or (3 if q else 20)
    args.soak_s = args.soak_s or (30.0 if q else 120.0)
    return args


def run_server_parts(args: argparse.Namespace, server, spec, ws, tmp: Path, out: dict) -> None:
    """Parts (a), (b), (c) and the bare-server half of (e), in turn against one running server while it lives."""
    log(f"server up in {server.started_s:.1f} s at {server.urls}")
    if "a" in args.parts:
        log(f"(a) {args.hostile} hostile requests")
        out["hostile"] = part_a(server, spec, ws, args.hostile)
        log(json.dumps(out["hostile"], indent=1))
    if "b" in args.parts and server.process.poll() is None:
        log(f"(b) {args.cancel} cancelled streams")
        out["cancellation"] = part_b(server, args.cancel)
        log(json.dumps(out["cancellation"], indent=1))
    if "c" in args.parts and server.process.poll() is None:
        log(f"(c) soak {args.soak_s:.0f} s")
        out["soak"] = part_c(server, spec, args.soak_s, tmp)
        log(json.dumps(out["soak"], indent=1))
    if "e" in args.parts and server.process.poll() is None:
        log("(e) kill the tensorrt_llm stub with requests in flight")
        out["dying_instance"] = part_e(server)
        log(json.dumps(out["dying_instance"], indent=1))


def run_dying_parts(spec, ws, tmp: Path, out: dict) -> None:
    """Part (e) after the server stopped: the stub killed during load, then under `toolchain serve`, whose
    figures become the section's (the bare server's kept apart)."""
    log("(e) kill the tensorrt_llm stub during load")
    out["dying_instance_during_load"] = part_e_load(spec, ws, tmp)
    log(json.dumps(out["dying_instance_during_load"], indent=1))
    log("(e) `toolchain serve`: kill the tensorrt_llm stub with requests in flight")
    served = part_e_serve(tmp / "ws")
    log(json.dumps(served, indent=1))
    # the figures of the path users run are the section's; the bare server's are kept apart
    bare = out.get("dying_instance", {})
    out["dying_instance"] = {
        **served,
        "hung_requests_bare_tritonserver": bare.get("hung_requests"),
        "time_to_detect_s_bare_tritonserver": bare.get("time_to_detect_s"),
        "bare_tritonserver": bare,
    }


def summary(out: dict) -> dict:
    """The headline figures, flat (`section.key`), of the sections that ran."""
    flat = {}
    for key, section in SUMMARY_KEYS:
        if section in out:
            flat[f"{section}.{key}"] = out[section].get(key)
    return flat


def main(argv=None) -> int:
    """Deploy the embedded default, run the parts asked for, print the summary and write the results."""
    args = parse_args(argv)
    out: dict = {"quick": args.quick, "targets": TARGETS}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reliability-") as d:
        tmp = Path(d)
        if set(args.parts) & set("abce"):
            spec, ws, server = deploy(tmp / "ws")
            with server:
                run_server_parts(args, server, spec, ws, tmp, out)
            if "e" in args.parts:
                run_dying_parts(spec, ws, tmp, out)
        if "d" in args.parts:
            log(f"(d) {args.kills} kills per stage")
            out["crash_safety"] = part_d(args.kills, tmp)
            log(json.dumps(out["crash_safety"], indent=1))
    out["seconds"] = round(time.monotonic() - t_all, 1)
    out["summary"] = flat = summary(out)
    print_and_write(out, args.json, printed=flat, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
