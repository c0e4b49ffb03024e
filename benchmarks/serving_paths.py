"""The two serving paths of the LLM-API deployment, side by side in one run.

build/tiny-llama-llmapi.yaml (target llmapi-cpu) served twice on the same CPU
engine: Triton's `tensorrt_llm` llmapi model over gRPC streaming, and the
OpenAI-compatible server (`python -m toolchain.openai`, what trtllm-serve is
here) over SSE `/v1/completions`, both started as `toolchain deploy` starts
them. Both servers are up for the whole run and the load alternates between
them in short rounds (at concurrency 1, then 8: --rounds rounds, each a run
on either path, the order swapped every round), so drift in what else runs on
the host hits both alike. The load is this toolchain's bench harness
(toolchain.bench.run_bench) with the same prompts, seed and token counts
(ignore_eos: exactly --output-tokens each) on both.

Keys: per path and concurrency the median over rounds of each round's TTFT /
TPOT / E2E p50 (and p90) and output tokens/s, and
`openai_vs_triton_ttft_p50_ratio` / `openai_vs_triton_tpot_p50_ratio` (the
worse of the two concurrencies; per-concurrency ones are suffixed `_c1`,
`_c8`); target <= 1.15 each.

    python benchmarks/serving_paths.py [--json PATH] [--requests N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402

SPEC = REPO / "build" / "tiny-llama-llmapi.yaml"
CONCURRENCIES = (1, 8)
TARGET_RATIO = 1.15


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _spec(requests: int, concurrency: int, input_tokens: int, output_tokens: int, protocol: str, endpoint: str):
    from toolchain.spec import load_spec

    return load_spec(SPEC, [
        "serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0", "llmapi.openai_port=0",
        "validation.workload.mode=concurrency", f"validation.workload.concurrency={concurrency}",
        f"validation.workload.num_requests={requests}", f"validation.workload.warmup_requests={concurrency}",
        f"validation.workload.input_tokens={input_tokens}", f"validation.workload.output_tokens={output_tokens}",
        f"validation.workload.protocol={protocol}", f"validation.workload.endpoint={endpoint}",
        "validation.workload.seed=0"])


def _servers(root: Path):
    """Triton (the llmapi repository) and the OpenAI server on the same LLM() arguments, as deploy starts them."""
    from toolchain.pipeline import convert_for, model_repo_for, openai_server, server_for
    from toolchain.workspace import Workspace

    spec = _spec(1, 1, 64, 32, "triton-grpc", "tensorrt_llm")
    ws = Workspace(root)
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    triton = server_for(spec, ws)  # as deploy starts it
    openai = openai_server(spec, ws, root / "openai.log")
    return spec, triton, openai


def _level(report: dict) -> dict[str, Any]:
    level = report["levels"][0] if report.get("levels") else report
    out = {k: level.get(k) for k in ("num_requests", "errors", "output_tokens_per_s")}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        stats = level.get(metric) or {}
        out[f"{metric}_p50"] = stats.get("p50")
        out[f"{metric}_p90"] = stats.get("p90")
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(runs), "num_requests": sum(r["num_requests"] or 0 for r in runs),
                           "errors": sum(r["errors"] or 0 for r in runs)}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        if key not in out:
            out[key] = statistics.median(values) if values else None
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--requests", type=int, default=144, help="measured requests per path and concurrency")
    ap.add_argument("--rounds", type=int, default=6, help="alternating runs the requests are split into")
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="16 requests per level")
    args = ap.parse_args(argv)
    from toolchain.bench.run import run_bench
    from toolchain.llmapi.launch import served_model_name

    requests = 16 if args.quick else args.requests
    rounds = max(1, min(args.rounds, requests))
    out: dict[str, Any] = {"spec": str(SPEC.relative_to(REPO)), "requests_per_level": requests, "rounds": rounds,
                           "input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "paths": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="serving-paths-") as d:
        root = Path(d)
        spec, triton, openai = _servers(root)
        out["engine_threads"] = spec.serving.engine_threads
        with triton, openai:
            log(f"triton up in {triton.started_s:.1f} s, openai server up in {openai.started_s:.1f} s")
            paths = {"triton": ("triton-grpc", "tensorrt_llm", triton.grpc_url),
                     "openai": ("openai-completions", served_model_name(spec), openai.url)}
            for c in CONCURRENCIES:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
                for r in range(rounds):
                    names = list(paths) if r % 2 == 0 else list(reversed(paths))
                    for name in names:
                        protocol, endpoint, url = paths[name]
                        s = _spec(max(c, requests // rounds), c, args.input_tokens, args.output_tokens, protocol,
                                  endpoint)
                        report = run_bench(s, url=url, metrics_url="", out_dir=root / f"bench-{name}-c{c}-{r}",
                                           plots=False, request_timeout_s=120)
                        runs[name].append(_level(report))
                        log(f"{name} c{c} round {r}: {json.dumps(runs[name][-1])}")
                for name in paths:
                    out["paths"].setdefault(name, {})[f"c{c}"] = _median(runs[name])
    worst: dict[str, float | None] = {}
    for metric in ("ttft", "tpot"):
        ratios = []
        for c in CONCURRENCIES:
            r = _ratio(out["paths"]["openai"][f"c{c}"][f"{metric}_ms_p50"],
                       out["paths"]["triton"][f"c{c}"][f"{metric}_ms_p50"])
            out[f"openai_vs_triton_{metric}_p50_ratio_c{c}"] = r
            ratios.append(r)
        worst[metric] = None if None in ratios else max(r for r in ratios if r is not None)
        out[f"openai_vs_triton_{metric}_p50_ratio"] = worst[metric]
    out["target_ratio"] = TARGET_RATIO
    out["meets_target"] = all(v is not None and v <= TARGET_RATIO for v in worst.values())
    out["seconds"] = round(time.monotonic() - t0, 1)
    print_and_write(out, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
