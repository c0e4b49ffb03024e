"""`run_bench`: drive the workload, derive the metrics, write the report."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from toolchain import __version__
from toolchain.bench import metrics as M
from toolchain.bench.client import ClosedLoop, Job, RequestOptions, check_endpoint
from toolchain.bench.records import RequestRecord
from toolchain.bench.report import build_report, write_outputs
from toolchain.bench.tokens import TokenCounter, token_count_source
from toolchain.bench.workload import PROMPT_CORPUS, build_prompts, load_tokenizer
from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec

DEFAULT_REQUEST_TIMEOUT_S = 300.0


def normalize_url(url: str) -> str:
    """tritonclient wants host:port; accept grpc:// too."""
    url = url.strip().removeprefix("grpc://")
    if ":" not in url:
        raise ToolchainError(f"bad gRPC URL '{url}'", "pass --url host:port, e.g. 127.0.0.1:8001")
    return url


def max_prompt_len(spec: DeploymentSpec) -> int:
    """Longest prompt the deployment accepts for this workload; rejects a workload that cannot fit."""
    wl, lim = spec.validation.workload, spec.limits
    if wl.input_tokens > lim.max_input_len:
        raise ToolchainError(
            f"validation.workload.input_tokens ({wl.input_tokens}) exceeds limits.max_input_len ({lim.max_input_len})",
            "lower the workload's input_tokens or rebuild the engine with a larger max_input_len")
    if wl.input_tokens + wl.output_tokens > lim.max_seq_len:
        raise ToolchainError(
            f"input_tokens + output_tokens ({wl.input_tokens} + {wl.output_tokens}) exceeds limits.max_seq_len "
            f"({lim.max_seq_len})", "shorten the workload or rebuild with a larger max_seq_len")
    return min(lim.max_input_len, lim.max_seq_len - wl.output_tokens)


def run_bench(spec: DeploymentSpec, grpc_url: str, out_dir: Path, tokenizer_dir: Path | None = None, *,
              request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> dict:
    """Run spec.validation.workload against `grpc_url`; write out_dir/report.json and requests.csv; return the report."""
    wl = spec.validation.workload
    url = normalize_url(grpc_url)
    max_len = max_prompt_len(spec)
    contract = check_endpoint(url, wl.endpoint)
    tokenizer_dir = Path(tokenizer_dir or spec.model.tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)

    total = wl.warmup_requests + wl.num_requests
    prompts = build_prompts(tokenizer, count=total, mean=wl.input_tokens, stddev=wl.input_tokens_stddev,
                            seed=wl.seed, max_len=max_len)
    opts = RequestOptions(max_tokens=wl.output_tokens, ignore_eos=wl.ignore_eos,
                          exclude_input_in_output=spec.serving.exclude_input_in_output)
    jobs = []
    for i, prompt in enumerate(prompts):
        warm = i < wl.warmup_requests
        rid = f"w{i}" if warm else f"m{i - wl.warmup_requests}"
        rec = RequestRecord(index=i, request_id=rid, warmup=warm, isl=prompt.isl, max_tokens=wl.output_tokens)
        jobs.append(Job(rec, prompt.text, opts))

    # One wall-clock anchor per run, to line the monotonic stamps up with server logs.
    started_wall = dt.datetime.now(dt.timezone.utc)
    anchor_ns = time.perf_counter_ns()
    with ClosedLoop(url, contract, wl.concurrency, request_timeout_s) as loop:
        loop.run_phase([j for j in jobs if j.record.warmup])
        loop.run_phase([j for j in jobs if not j.record.warmup])
        aborted, stray = loop.aborted, loop.stray_responses

    records = [j.record for j in jobs]
    TokenCounter(tokenizer).fill(records)
    slo_thresholds = spec.validation.slo.model_dump()
    metrics = M.compute(records, slo_thresholds)
    window = metrics["window"]
    for edge in ("start", "end"):  # monotonic ns -> ms after started_at, like requests.csv
        t = window.pop(f"{edge}_ns")
        window[f"{edge}_ms"] = None if t is None else (t - anchor_ns) / M.NS_PER_MS
    measured_ok = [r for r in records if not r.warmup and r.ok]
    mismatches = sum(1 for r in measured_ok if r.osl != r.max_tokens) if wl.ignore_eos else 0
    workload = {
        **wl.model_dump(mode="json"),
        "load_mode": "closed-loop concurrency",
        "request_timeout_s": request_timeout_s,
        "max_prompt_tokens": max_len,
        "prompt_corpus": PROMPT_CORPUS,
        "isl_definition": "prompt tokens without special tokens (the server may add BOS)",
        "inputs_sent": sorted(i for i in contract.inputs
                              if i in {"text_input", "max_tokens", "stream", "exclude_input_in_output"}
                              or (i == "end_id" and wl.ignore_eos)),
    }
    run = {
        "tool": f"toolchain bench {__version__}",
        "deployment": spec.name,
        "model": wl.endpoint,
        "url": url,
        "tokenizer": str(tokenizer_dir),
        "started_at": started_wall.isoformat(),
        "clock": "time.perf_counter_ns (monotonic); requests.csv times are ms after started_at",
        "aborted": aborted,
        "stray_responses": stray,
    }
    report = build_report(metrics, M.evaluate_slo(metrics, slo_thresholds), workload=workload, run=run,
                          token_count_source=token_count_source(records), osl_mismatches=mismatches)
    write_outputs(Path(out_dir), report, records, anchor_ns)
    return report
