"""Multi-LoRA serving: a mixed-adapter workload against the base model alone, on both serving paths.

The embedded tiny Llama with its two tiny adapters (`make tiny-lora`: `attn` on q/k/v/o_proj, rank 8; `all` on
every projection, rank 16), served at concurrency 8 with the spec's workload classes: half the requests to the
base model, a quarter to each adapter, all in the same in-flight batches. Two paths, each started as `toolchain
deploy` starts it:

- Triton (build/tiny-llama-lora.yaml, target cpu): the ensemble over gRPC streaming, each adapter request with
  `lora_task_id` (the tensorrt_llm model holds both adapters from its lora_prefetch_dir);
- the OpenAI server (build/tiny-llama-lora-llmapi.yaml, llmapi-cpu): `/v1/completions` with the adapter's name
  in `model` (LLM()'s stand-in reads each PEFT directory on first use).

On each server the mixed load and a base-only load of the same prompts (the same classes with no adapters)
alternate in short rounds, the order swapped every round, so drift in what else runs on the host hits both.
Each round draws its own sessions (workload seed = the round), the same for both loads, after one uncounted
mixed run that takes a fresh server's one-time costs. The load is this toolchain's bench harness
(toolchain.bench.run_bench), ignore_eos: exactly --output-tokens each.

Keys, per path: `mixed` and `base_only` (medians over rounds of output tokens/s and TTFT / TPOT p50 and p90),
`per_adapter` (each class's TTFT and TPOT p50/p99 pooled over the mixed rounds' levels, by the median of rounds),
and `throughput_vs_base` = mixed output tokens/s over base-only's; target >= 0.8.

    python benchmarks/lora_mixed.py [--json PATH] [--requests N] [--rounds R] [--quick] [--paths triton,openai]
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

SPECS = {"triton": REPO / "build" / "tiny-llama-lora.yaml", "openai": REPO / "build" / "tiny-llama-lora-llmapi.yaml"}
CONCURRENCY = 8
TARGET = 0.8


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _spec(path: str, requests: int, input_tokens: int, output_tokens: int, **workload):
    from toolchain.spec import load_spec

    overrides = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0", "llmapi.openai_port=0",
                 "validation.workload.mode=concurrency", f"validation.workload.concurrency={CONCURRENCY}",
                 f"validation.workload.num_requests={requests}", f"validation.workload.warmup_requests={CONCURRENCY}",
                 f"validation.workload.input_tokens={input_tokens}",
                 f"validation.workload.output_tokens={output_tokens}"]
    overrides += [f"validation.workload.{k}={v}" for k, v in workload.items()]
    return load_spec(SPECS[path], overrides)


def _base_only(spec):
    """The same workload with every class sent to the base model: same shares, prompts and lengths."""
    wl = spec.validation.workload
    classes = [c.model_copy(update={"adapter": None}) for c in wl.classes]
    v = spec.validation.model_copy(update={"workload": wl.model_copy(update={"classes": classes})})
    return spec.model_copy(update={"validation": v})


def _server(path: str, root: Path):
    """The path's server over its prepared stages, not started, and how the bench reaches it."""
    from toolchain.engine.build import run_build
    from toolchain.llmapi.launch import served_model_name
    from toolchain.pipeline import convert_for, model_repo_for, openai_server, server_for
    from toolchain.workspace import Workspace

    spec = _spec(path, 1, 64, 32)
    ws = Workspace(root)
    convert_for(spec)(spec, ws)
    if path == "triton":
        run_build(spec, ws, converted=True)
        model_repo_for(spec)(spec, ws)
        server = server_for(spec, ws)  # as deploy starts it
        return spec, server, lambda: server.grpc_url, {"protocol": "triton-grpc", "endpoint": "ensemble"}
    model_repo_for(spec)(spec, ws)
    server = openai_server(spec, ws, root / "openai.log")
    return spec, server, lambda: server.url, {"protocol": "openai-completions", "endpoint": served_model_name(spec)}


def _figures(report: dict) -> dict[str, Any]:
    level = report["levels"][0] if report.get("levels") else report
    out = {k: level.get(k) for k in ("num_requests", "errors", "output_tokens_per_s")}
    for metric in ("ttft_ms", "tpot_ms"):
        stats = level.get(metric) or {}
        out[f"{metric}_p50"], out[f"{metric}_p90"] = stats.get("p50"), stats.get("p90")
    out["per_class"] = {name: {"adapter": c["adapter"], "num_requests": c["num_requests"],
                               "ttft_ms_p50": c["ttft_ms"]["p50"], "ttft_ms_p99": c["ttft_ms"]["p99"],
                               "tpot_ms_p50": c["tpot_ms"]["p50"], "tpot_ms_p99": c["tpot_ms"]["p99"]}
                        for name, c in (level.get("per_class") or {}).items()}
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(runs), "num_requests": sum(r["num_requests"] or 0 for r in runs),
                           "errors": sum(r["errors"] or 0 for r in runs)}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if key not in out and key != "per_class":
            out[key] = round(statistics.median(values), 3) if values else None
    return out


def _per_adapter(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, first in runs[0]["per_class"].items():
        rows = [r["per_class"][name] for r in runs if name in r["per_class"]]
        out[first["adapter"] or "base"] = {"class": name, "num_requests": sum(x["num_requests"] for x in rows), **{
            k: round(statistics.median(v), 3) if (v := [x[k] for x in rows if x[k] is not None]) else None
            for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")}}
    return out


def run_path(path: str, root: Path, requests: int, rounds: int, input_tokens: int, output_tokens: int) -> dict:
    from toolchain.bench.run import run_bench

    spec, server, url, workload = _server(path, root)
    loads = {"mixed": lambda s: s, "base_only": _base_only}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loads}
    with server:
        log(f"{path}: server up in {server.started_s:.1f} s")
        # A first run on a fresh server pays one-time costs (each adapter's first load on the LLM-API path,
        # allocator growth) that would land on whichever load went first: one mixed run, not counted.
        run_bench(_spec(path, 4 * CONCURRENCY, input_tokens, output_tokens, seed=rounds, **workload), url=url(),
                  metrics_url="", out_dir=root / f"bench-{path}-warm", plots=False, request_timeout_s=120)
        for r in range(rounds):
            for name in list(loads) if r % 2 == 0 else list(reversed(loads)):
                # Both loads of a round send the same sessions (seed r); each round draws its own.
                s = loads[name](_spec(path, max(CONCURRENCY, requests // rounds), input_tokens, output_tokens,
                                      seed=r, **workload))
                report = run_bench(s, url=url(), metrics_url="", out_dir=root / f"bench-{path}-{name}-{r}",
                                   plots=False, request_timeout_s=120)
                runs[name].append(_figures(report))
                log(f"{path} {name} round {r}: " + json.dumps({k: v for k, v in runs[name][-1].items()
                                                                if k != "per_class"}))
    mixed, base = _median(runs["mixed"]), _median(runs["base_only"])
    ratio = (round(mixed["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
             if mixed["output_tokens_per_s"] and base["output_tokens_per_s"] else None)
    return {"spec": str(SPECS[path].relative_to(REPO)), **workload, "mixed": mixed, "base_only": base,
            "per_adapter": _per_adapter(runs["mixed"]), "throughput_vs_base": ratio,
            "meets_target": ratio is not None and ratio >= TARGET and mixed["errors"] == 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--requests", type=int, default=96, help="measured requests per load (mixed, base-only) and path")
    ap.add_argument("--rounds", type=int, default=4, help="alternating runs the requests are split into")
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--paths", default="triton,openai", help="which serving paths, comma-separated")
    ap.add_argument("--quick", action="store_true", help="16 requests per load, 2 rounds")
    args = ap.parse_args(argv)
    from toolchain.tinymodel.lora import build_tiny_lora

    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in SPECS]
    if unknown:
        ap.error(f"unknown path(s) {unknown}; choose from {', '.join(SPECS)}")
    requests, rounds = (16, 2) if args.quick else (args.requests, max(1, min(args.rounds, args.requests)))
    build_tiny_lora(REPO / "models" / "tiny-llama", REPO / "models" / "tiny-llama-lora", log=log)  # as make tiny-lora
    out: dict[str, Any] = {"concurrency": CONCURRENCY, "requests_per_load": requests, "rounds": rounds,
                           "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
                           "workload": "classes base (share 2), attn (1, adapter attn), all (1, adapter all)",
                           "target_throughput_vs_base": TARGET, "paths": {}}
    t0 = time.monotonic()
    for path in paths:
        with tempfile.TemporaryDirectory(prefix=f"lora-mixed-{path}-") as d:
            out["paths"][path] = run_path(path, Path(d), requests, rounds, args.input_tokens, args.output_tokens)
    out["meets_target"] = all(p["meets_target"] for p in out["paths"].values())
    out["seconds"] = round(time.monotonic() - t0, 1)
    print_and_write(out, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
