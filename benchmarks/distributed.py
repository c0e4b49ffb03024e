"""Serving past one server: several engine workers behind one endpoint, and one engine's ranks as processes,
measured on this host.

Independent sections, chosen with --parts (comma-separated; default: all):

  dynamo-scaling   NVIDIA Dynamo's frontend (router kv) in front of 1, then 2 CPU-engine workers
                   (build/tiny-llama-dynamo.yaml, one torch thread each), the same closed-loop workload on each:
                   output throughput and TTFT, `dynamo_2_workers_vs_1_throughput_ratio`.
  dynamo-routing   2 workers, a shared-prefix workload (many system prompts, a few users each), once with the
                   KV-aware router and once round-robin, each on a fresh deployment (cold caches): the prefix hit
                   rate (prompt tokens the workers took from their caches / prompt tokens, from the workers' own
                   counts) and TTFT; `kv_routing_ttft_ratio_vs_round_robin` = kv / round-robin (below 1: faster).
  mpi-ranks        The CPU engine's ranks as processes (serving.launch mpirun): tiny-llama at tp 1 (one process),
                   tp 2 in one process, and tp 2 as two tritonserver ranks under mpirun computing over gloo, the
                   same closed-loop workload on each over gRPC; `tp2_mpi_vs_single_process_tokens_ratio` (and
                   its TTFT ratio), `outputs_identical` (greedy tokens of 8 prompts, mpirun vs one process).
                   Without --quick again on the same model widened (zero MLP units, zero-output layers:
                   toolchain/tinymodel/widen.py's widen_target) so the forward dominates the per-step exchange,
                   keys suffixed `_wide`.

Load comes from this toolchain's bench harness (toolchain.bench.run_bench, protocol openai-completions), the
same that `toolchain bench` runs, pointed at the Dynamo frontend. This host has 2 cores: two workers of one
thread each plus the frontend and the load generator share them, so the scaling ratio says what 2 workers give
here, not on a host with a core (or a GPU) per worker.

    python benchmarks/distributed.py [--parts dynamo-scaling,dynamo-routing,mpi-ranks] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402
from toolchain.tinymodel.widen import widen_target  # noqa: E402
from toolchain.triton.grpc_client import stream, token_request  # noqa: E402

SPEC = REPO / "build" / "tiny-llama-dynamo.yaml"
RANKS_SPEC = REPO / "build" / "tiny-llama.yaml"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- Dynamo --------------------------------------------------------------------------------------------------


def _dynamo_available() -> str | None:
    from toolchain.dynamo.install import problem

    return problem()


def _bench(dep, spec, out_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """One run_bench level against the deployment's frontend; the figures this file reports, plus the workers'
    own counts over the run."""
    from toolchain.bench.run import run_bench
    from toolchain.spec import load_spec

    bench_spec = load_spec(SPEC, [f"dynamo.workers={dep.workers}", "validation.workload.protocol=openai-completions",
                                  f"validation.workload.endpoint={dep.model_name}", *overrides])
    before = [dep.worker_stats(i) for i in range(dep.workers)]
    report = run_bench(bench_spec, out_dir=out_dir, url=dep.url, plots=False)
    after = [dep.worker_stats(i) for i in range(dep.workers)]
    delta = {k: sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before, strict=True))
             for k in ("requests", "prompt_tokens", "cached_tokens", "reused_blocks", "context_blocks")}
    level = report["levels"][-1] if report.get("levels") else report
    return {
        "requests": level.get("num_requests"), "errors": level.get("errors"),
        "output_tokens_per_s": level.get("output_tokens_per_s"), "requests_per_s": level.get("requests_per_s"),
        "ttft_ms_p50": (level.get("ttft_ms") or {}).get("p50"), "ttft_ms_mean": (level.get("ttft_ms") or {}).get("mean"),
        "e2e_ms_p50": (level.get("e2e_ms") or {}).get("p50"),
        "requests_per_worker": [a.get("requests", 0) - b.get("requests", 0) for a, b in zip(after, before, strict=True)],
        "prefix_hit_rate": round(delta["cached_tokens"] / delta["prompt_tokens"], 4) if delta["prompt_tokens"] else None,
        "worker_counts": delta,
    }


def _deployment(workers: int, router: str, tmp: Path):
    from toolchain.dynamo.launcher import DynamoDeployment
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    spec = load_spec(SPEC, ["dynamo.http_port=0", f"dynamo.workers={workers}", f"dynamo.router={router}"])
    return DynamoDeployment(spec, Workspace(REPO), log_dir=tmp / f"logs-{workers}-{router}"), spec


def dynamo_scaling(args, tmp: Path) -> dict[str, Any]:
    n = 24 if args.quick else 64
    workload = ["validation.workload.mode=concurrency", "validation.workload.concurrency=4",
                f"validation.workload.num_requests={n}", "validation.workload.warmup_requests=4",
                "validation.workload.input_tokens=64", "validation.workload.output_tokens=48"]
    runs = {}
    for workers in (1, 2):
        dep, spec = _deployment(workers, "kv", tmp)
        with dep:
            log(f"dynamo-scaling: {workers} worker(s) ready in {dep.started_s:.1f} s")
            runs[workers] = _bench(dep, spec, tmp / f"scaling-{workers}", workload)
            log(f"  {json.dumps(runs[workers])}")
    one, two = runs[1]["output_tokens_per_s"], runs[2]["output_tokens_per_s"]
    return {
        "dynamo_scaling": {"workload": {"concurrency": 4, "requests": n, "input_tokens": 64, "output_tokens": 48},
                           "engine_threads_per_worker": 1, "host_cores": _cores(), "runs": runs},
        "dynamo_1_worker_output_tok_s": one, "dynamo_2_workers_output_tok_s": two,
        "dynamo_2_workers_vs_1_throughput_ratio": round(two / one, 3) if one and two else None,
        "dynamo_2_workers_vs_1_ttft_p50_ratio": _ratio(runs[2]["ttft_ms_p50"], runs[1]["ttft_ms_p50"]),
    }


def dynamo_routing(args, tmp: Path) -> dict[str, Any]:
    prefixes, users = (8, 3) if args.quick else (16, 4)
    n = prefixes * users
    workload = ["validation.workload.mode=concurrency", "validation.workload.concurrency=2",
                f"validation.workload.num_requests={n}", "validation.workload.warmup_requests=0",
                "validation.workload.input_tokens=24", "validation.workload.output_tokens=8",
                f"validation.workload.shared_prefix.num_prefixes={prefixes}",
                "validation.workload.shared_prefix.prefix_tokens=320",
                f"validation.workload.shared_prefix.users_per_prefix={users}"]
    runs = {}
    for router in ("kv", "round-robin"):
        dep, spec = _deployment(2, router, tmp)
        with dep:
            log(f"dynamo-routing: router {router} ready in {dep.started_s:.1f} s")
            runs[router] = _bench(dep, spec, tmp / f"routing-{router}", workload)
            log(f"  {json.dumps(runs[router])}")
    return {
        "dynamo_routing": {"workload": {"prefixes": prefixes, "users_per_prefix": users, "prefix_tokens": 320,
                                        "user_tokens": 24, "output_tokens": 8, "concurrency": 2, "requests": n},
                           "runs": runs},
        "kv_routing_prefix_hit_rate": runs["kv"]["prefix_hit_rate"],
        "round_robin_prefix_hit_rate": runs["round-robin"]["prefix_hit_rate"],
        "kv_routing_ttft_ratio_vs_round_robin": _ratio(runs["kv"]["ttft_ms_p50"], runs["round-robin"]["ttft_ms_p50"]),
        "kv_routing_ttft_mean_ratio_vs_round_robin": _ratio(runs["kv"]["ttft_ms_mean"],
                                                            runs["round-robin"]["ttft_ms_mean"]),
    }


# -- MPI ranks: 1 rank vs 2 rank processes vs 2 ranks in one process ------------------------------------------------

MPI_CONFIGS = (("tp1", 1, "single"), ("tp2_single_process", 2, "single"), ("tp2_mpi", 2, "mpirun"))


def _mpi_model(tmp: Path, wide: bool) -> Path:
    """The embedded default, or (wide) the same model with its MLP widened by zero units and zero-output
    layers added, so the forward pass dominates the per-step exchange as it does on real models."""
    src = REPO / "models" / "tiny-llama"
    if not wide:
        return src
    return widen_target(src, tmp / "wide-llama", extra_layers=6, intermediate=4096)


def _mpi_deploy(root: Path, checkpoint: Path, tp: int, launch: str):
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import load_spec
    from toolchain.triton.launch import TritonLaunch
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer
    from toolchain.workspace import Workspace

    spec = load_spec(RANKS_SPEC, [f"model.checkpoint={checkpoint}", f"parallelism.tp={tp}", f"serving.launch={launch}",
                            "serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0"])
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    run_model_repo(spec, ws)
    repo = ws.model_repo_dir(spec)
    server = (TritonLaunch.cpu(spec, repo, root / "server.log") if launch == "mpirun"
              else TritonServer.from_spec(spec, repo, log_path=root / "server.log"))
    return spec, server


def _greedy_outputs(server, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        got = stream(server.grpc_url, "tensorrt_llm", token_request(p, n, end_id=([-1], "INT32")), request_id=str(i))
        out.append(got.tokens() if not got.errors else [f"error: {got.errors[0]}"])
    return out


def _mpi_model_runs(tmp: Path, quick: bool, wide: bool) -> dict:
    from toolchain.bench.run import run_bench

    checkpoint = _mpi_model(tmp, wide)
    prompts = [[5 + i, 17, 29, 3 + 2 * i, 41] * 4 for i in range(8)]
    n_req = 16 if quick else 48
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for label, tp, launch in MPI_CONFIGS:
        spec, server = _mpi_deploy(tmp / f"mpi-{label}-{'wide' if wide else 'tiny'}", checkpoint, tp, launch)
        with server:
            log(f"[mpi] {label}: up in {server.started_s:.1f} s")
            outputs[label] = _greedy_outputs(server, prompts, 24)
            wl = spec.validation.workload.model_copy(update={
                "num_requests": n_req, "warmup_requests": 4, "concurrency": 4, "input_tokens": 64,
                "output_tokens": 32, "mode": "concurrency"})
            s = spec.model_copy(update={"validation": spec.validation.model_copy(update={"workload": wl})})
            report = run_bench(s, url=server.grpc_url, out_dir=tmp / f"bench-{label}", plots=False,
                               request_timeout_s=120)
        level = report["levels"][0] if "levels" in report else report["results"][0]
        results[label] = {k: level.get(k) for k in ("output_tokens_per_s", "requests_per_s", "errors")}
        for metric in ("ttft_ms", "tpot_ms"):
            stats = level.get(metric) or {}
            results[label][f"{metric}_p50"] = stats.get("p50")
            results[label][f"{metric}_p99"] = stats.get("p99")
        log(f"[mpi] {label}: {json.dumps(results[label])}")
    single, mpi, one = results["tp2_single_process"], results["tp2_mpi"], results["tp1"]

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    return {
        "model": "tiny-llama widened (zero units / zero-output layers)" if wide else "tiny-llama (embedded default)",
        "configs": results,
        "tp2_mpi_vs_single_process_tokens_ratio": ratio(mpi["output_tokens_per_s"], single["output_tokens_per_s"]),
        "tp2_mpi_vs_single_process_ttft_ratio": ratio(mpi["ttft_ms_p50"], single["ttft_ms_p50"]),
        "tp2_mpi_vs_tp1_tokens_ratio": ratio(mpi["output_tokens_per_s"], one["output_tokens_per_s"]),
        "outputs_identical": outputs["tp2_mpi"] == outputs["tp2_single_process"],
        "outputs_checked": len(prompts),
    }


def mpi_ranks(args, tmp: Path) -> dict[str, Any]:
    """The embedded default, then (unless --quick) the widened one, each in the three configurations."""
    tiny = _mpi_model_runs(tmp, args.quick, wide=False)
    out: dict[str, Any] = {"mpi_ranks": {"tiny": tiny}, "host_cores": _cores(),
                           "tp2_mpi_vs_single_process_tokens_ratio": tiny["tp2_mpi_vs_single_process_tokens_ratio"],
                           "tp2_mpi_vs_single_process_ttft_ratio": tiny["tp2_mpi_vs_single_process_ttft_ratio"],
                           "tp2_mpi_vs_tp1_tokens_ratio": tiny["tp2_mpi_vs_tp1_tokens_ratio"],
                           "outputs_identical": tiny["outputs_identical"]}
    if not args.quick:
        wide = _mpi_model_runs(tmp, args.quick, wide=True)
        out["mpi_ranks"]["wide"] = wide
        for key in ("tp2_mpi_vs_single_process_tokens_ratio", "tp2_mpi_vs_single_process_ttft_ratio",
                    "tp2_mpi_vs_tp1_tokens_ratio"):
            out[f"{key}_wide"] = wide[key]
        out["outputs_identical"] = tiny["outputs_identical"] and wide["outputs_identical"]
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


PARTS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "dynamo-scaling": dynamo_scaling,
    "dynamo-routing": dynamo_routing,
    "mpi-ranks": mpi_ranks,
}
NEEDS_DYNAMO = {"dynamo-scaling", "dynamo-routing"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated sections of {', '.join(PARTS)}")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--quick", action="store_true", help="fewer requests per run")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    out: dict[str, Any] = {"quick": args.quick, "parts": parts}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distributed-") as d:
        for part in parts:
            why = _dynamo_available() if part in NEEDS_DYNAMO else None
            if why:
                out[f"{part.replace('-', '_')}_skipped"] = f"{why} (run `make dynamo`)"
                log(f"{part}: skipped: {why}")
                continue
            out.update(PARTS[part](args, Path(d)))
    out["seconds"] = round(time.monotonic() - t0, 1)
    print_and_write(out, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
