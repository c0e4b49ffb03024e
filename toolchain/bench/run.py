"""`run_bench`: check the endpoint, build the workload, run every load level, write the report.

Order of a run: the transport checks the server, the model and its contract
(one-line errors before any load); the tokenizer and the plan are built, and
the request deadline is settled (failfast.py: the spec's, or derived from the
workload and the SLOs); the warm-up requests run once, closed loop, excluded
from every figure; then each level runs with a server-metrics scrape before
and after it. Records are counted (tokenizer where the server did not count)
between levels, outside any timing. An interrupted or aborted run still
writes what it measured, marked `complete: false`; a run that stopped on its
endpoint (a dead server, or a streak of failed requests) says why under
`stopped`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from toolchain import __version__
from toolchain.bench import metrics as M
from toolchain.bench import schedule, servermetrics
from toolchain import slo as S
from toolchain.bench.datasets import Plan
from toolchain.bench.deployment import describe
from toolchain.bench.failfast import Deadline, failure_limit, longest_output, request_deadline
from toolchain.bench.loadgen import Runner
from toolchain.bench.prediction import prediction
from toolchain.bench.protocols import make_transport
from toolchain.bench.report import build_report, level_notes, write_outputs
from toolchain.bench.tokens import TokenCounter, token_count_source
from toolchain.bench.workload import PROMPT_CORPUS, load_tokenizer
from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec
from toolchain.speculative import mode_of
from toolchain.stopsignals import Stopped
from toolchain.triton.endpoints import endpoints


def default_url(spec: DeploymentSpec, protocol: str) -> str:
    kind = "grpc" if protocol == "triton-grpc" else "http"
    at = endpoints(spec).triton[kind]
    if at.port == 0:
        raise ToolchainError(f"serving.{kind}_port is 0 (a free port picked at start), so the bench cannot guess it",
                             "pass --url of the running server")
    return at.address if kind == "grpc" else at.url


def default_metrics_url(spec: DeploymentSpec) -> str | None:
    # Off loopback serve keeps metrics on 127.0.0.1 unless serving.metrics_host says otherwise.
    triton = endpoints(spec).triton
    return None if triton.metrics.port == 0 else triton.metrics_url


def normalize_url(url: str) -> str:
    """tritonclient wants host:port; accept grpc:// too."""
    url = url.strip().removeprefix("grpc://")
    if ":" not in url:
        raise ToolchainError(f"bad gRPC URL '{url}'", "pass --url host:port, e.g. 127.0.0.1:8001")
    return url


def max_prompt_len(spec: DeploymentSpec) -> int:
    """Longest prompt the deployment accepts for this workload; rejects a workload that cannot fit."""
    wl, lim = spec.validation.workload, spec.limits
    for where, isl, osl in [("", wl.input_tokens, wl.output_tokens)] + [
            (f" (class {c.name})", c.input_tokens or wl.input_tokens, c.output_tokens or wl.output_tokens)
            for c in wl.classes]:
        if wl.shared_prefix.num_prefixes:
            isl += wl.shared_prefix.prefix_tokens
        if isl > lim.max_input_len:
            raise ToolchainError(
                f"validation.workload.input_tokens{where} ({isl}) exceeds limits.max_input_len ({lim.max_input_len})",
                "lower the workload's input_tokens or rebuild the engine with a larger max_input_len")
        if isl + osl > lim.max_seq_len:
            raise ToolchainError(
                f"input_tokens + output_tokens{where} ({isl} + {osl}) exceeds limits.max_seq_len ({lim.max_seq_len})",
                "shorten the workload or rebuild with a larger max_seq_len")
    return min(lim.max_input_len, lim.max_seq_len - 1)


def levels_of(wl) -> list[float]:
    """The load levels of a workload: its sweep, or its one concurrency or rate."""
    if wl.sweep:
        return [int(v) if wl.mode == "concurrency" else float(v) for v in wl.sweep]
    return [wl.concurrency if wl.mode == "concurrency" else wl.rate]


def slo_thresholds(spec: DeploymentSpec, slo_extra: tuple[str, ...]) -> list[S.Threshold]:
    """The SLO thresholds of the spec plus `--slo` extras; a bad one is a one-line error."""
    try:
        return S.thresholds(spec.validation.slo, slo_extra)
    except ValueError as err:
        raise ToolchainError(str(err)) from None


def target_url(spec: DeploymentSpec, url: str | None, grpc_url: str | None) -> str:
    """The endpoint to load: --url, then the workload's url, then (triton-grpc) `grpc_url`, then the spec's port."""
    wl = spec.validation.workload
    target = url or wl.url or (grpc_url if wl.protocol == "triton-grpc" and grpc_url else None) \
        or default_url(spec, wl.protocol)
    return normalize_url(target) if wl.protocol == "triton-grpc" else target


def class_adapters(spec: DeploymentSpec) -> dict[str, int]:
    """The LoRA adapters the workload's classes name -> their task ids (spec.lora.task_id), in class order."""
    names = [c.adapter for c in spec.validation.workload.classes if c.adapter is not None]
    return {name: spec.lora.task_id(name) for name in dict.fromkeys(names)}


def open_transport(spec: DeploymentSpec, target: str):
    """The workload's transport to `target`, checked (server, model, contract) before any load."""
    wl = spec.validation.workload
    transport = make_transport(wl.protocol, url=target, model=wl.endpoint, streaming=wl.streaming,
                               adapters=class_adapters(spec),
                               ignore_eos=wl.ignore_eos, exclude_input=spec.serving.exclude_input_in_output,
                               keep_text=wl.multi_turn.turns > 1 or wl.prompts_file is not None,
                               # A draft-target or n-gram deployment speculates through the BLS when asked to.
                               num_draft_tokens=spec.speculative.max_draft_len
                               if mode_of(spec.speculative.mode).external_drafts else 0)
    transport.prepare()
    return transport


@dataclass
class BenchRun:
    """What one run holds between its steps: the workload, its transport and runner, and the levels so far."""

    wl: Any  # spec.validation.workload
    thresholds: list[S.Threshold]
    transport: Any
    plan: Plan
    counter: TokenCounter
    runner: Runner
    exporter: Any  # toolchain.bench.exporter.Exporter or None
    metrics_url: str | None
    loads: list[float]
    anchor_ns: int  # monotonic origin of the report's windows and requests.csv
    on_level: Callable[[dict], None] | None
    levels: list[dict] = field(default_factory=list)


def finish_level(run: BenchRun, i: int, value: float, before, after, n_sessions: int | None) -> None:
    """Count level `i`'s records, compute its metrics, SLO verdicts and server deltas, append it to run.levels."""
    wl, runner = run.wl, run.runner
    recs = [r for r in runner.records if r.level == i and not r.warmup]
    run.counter.fill(recs)
    m = M.compute(recs, run.thresholds)
    m["warmup_requests"] = sum(1 for r in runner.records if r.warmup)  # run once, before the first level
    for edge in ("start", "end"):  # monotonic ns -> ms after started_at, like requests.csv
        t = m["window"].pop(f"{edge}_ns")
        m["window"][f"{edge}_ms"] = None if t is None else (t - run.anchor_ns) / M.NS_PER_MS
    ok = [r for r in recs if r.ok]
    mism = sum(1 for r in ok if r.osl != r.max_tokens) if wl.ignore_eos else 0
    src = token_count_source(recs)
    load: dict[str, Any] = {"mode": wl.mode, "value": value, "sessions": n_sessions, "duration_s": wl.duration_s,
                            "stop_after_failures": failure_limit(wl, value)}
    if wl.mode == "rate":
        load.update(arrival=wl.arrival, burstiness=wl.burstiness)
    level = {"level": i, "load": load, **m, "token_count_source": src, "osl_mismatches": mism,
             "slo": S.evaluate(m, run.thresholds), "server": servermetrics.delta(before, after, wl.endpoint),
             "itl_by_position": M.itl_by_position(recs, max_positions=256)}
    level["notes"] = level_notes(m, src, mism, open_loop=wl.mode == "rate")
    run.levels.append(level)
    if run.on_level is not None:
        run.on_level(level)


async def warm_up(run: BenchRun) -> None:
    """The warm-up requests, closed loop, once before the first level; excluded from every figure."""
    wl, plan = run.wl, run.plan
    first = run.loads[0] if wl.mode == "concurrency" else 4
    run.runner.failure_limit = failure_limit(wl, run.loads[0])
    n_warm = plan.sessions_for(wl.warmup_requests)
    await run.runner.closed_loop(plan.sessions("warmup", n_warm), max(1, min(int(first), n_warm)), -1, warm=True)
    warm = [r for r in run.runner.records if r.warmup]
    run.runner.stop_if_none_answered(warm)
    run.counter.fill(warm)


async def run_level(run: BenchRun, i: int, value: float) -> None:
    """Level `i` at `value` (concurrency or rate), between two server-metrics scrapes, then its figures."""
    wl, plan, runner = run.wl, run.plan, run.runner
    if run.exporter:
        run.exporter.load.set(value)
    runner.failure_limit = failure_limit(wl, value)
    before = await asyncio.to_thread(servermetrics.scrape, run.metrics_url)
    n = None if wl.duration_s else plan.sessions_for(wl.num_requests)
    if wl.mode == "concurrency":
        await runner.closed_loop(plan.sessions(i, n), int(value), i, duration_s=wl.duration_s)
    else:
        offsets = schedule.arrivals(value, count=n, duration_s=wl.duration_s, arrival=wl.arrival,
                                    burstiness=wl.burstiness, seed=f"{wl.seed}:{i}")
        await runner.open_loop(list(plan.sessions(i, len(offsets))), offsets, i)
    after = await asyncio.to_thread(servermetrics.scrape, run.metrics_url)
    finish_level(run, i, value, before, after, n)


async def run_levels(run: BenchRun) -> None:
    """Open the transport, warm up, run every level until done or aborted, close the transport."""
    await run.transport.open()
    try:
        if run.wl.warmup_requests:
            await warm_up(run)
        for i, value in enumerate(run.loads):
            if run.runner.aborted:
                break
            await run_level(run, i, value)
    finally:
        await run.transport.close()


def drive(run: BenchRun) -> tuple[str | None, Stopped | None]:
    """Run the levels; return (why the run stopped early or None, the stop signal to re-raise after the report)."""
    aborted = None
    stopped: Stopped | None = None
    try:
        asyncio.run(run_levels(run))
        aborted = run.runner.aborted
    except Stopped as err:  # a stop signal to a command that started the server: report, then stop it
        aborted, stopped = str(err), err
    except KeyboardInterrupt:
        aborted = "interrupted by the user"
    finally:
        if run.exporter:
            run.exporter.close()
    return aborted, stopped


def finish_interrupted_level(run: BenchRun, aborted: str) -> None:
    """The level that was running when the run stopped: its unfinished requests marked, what it measured kept."""
    records = run.runner.records
    if not (records and (not run.levels or any(r.level == len(run.levels) for r in records))):
        return
    i = len(run.levels)
    for r in records:
        if r.level == i and r.t_final is None and r.error is None and not r.cancelled:
            r.error = f"unfinished: {aborted}"
    finish_level(run, i, run.loads[min(i, len(run.loads) - 1)], None, None, None)


def workload_section(run: BenchRun, deadline: Deadline, max_len: int) -> dict:
    """report.json's `workload`: the spec's workload plus what the run derived from it."""
    wl = run.wl
    return {
        **wl.model_dump(mode="json"),
        "levels": run.loads,
        "request_timeout_s": deadline.seconds,
        "request_timeout_from": deadline.source,
        "max_prompt_tokens": max_len,
        "prompt_corpus": str(wl.prompts_file) if wl.prompts_file else PROMPT_CORPUS,
        "isl_definition": "prompt tokens without special tokens (the server may add BOS); chat: message contents "
                          "joined, chat template not counted",
        "metric_names": M.METRIC_NAMES,
        "inputs_sent": sorted(run.transport.inputs_sent),
        "slo_thresholds": [t.name for t in run.thresholds],
    }


def run_section(spec: DeploymentSpec, run: BenchRun, tokenizer_dir: Path, started_wall: dt.datetime,
                aborted: str | None) -> dict:
    """report.json's `run`: the tool, the deployment, the endpoint, the client and whether the run completed."""
    wl = run.wl
    return {
        "tool": f"toolchain bench {__version__}",
        "deployment": describe(spec),
        "model": wl.endpoint,
        "url": run.transport.url,
        "protocol": wl.protocol,
        "transport": run.transport.describe(),
        "tokenizer": str(tokenizer_dir),
        "metrics_url": run.metrics_url,
        "started_at": started_wall.isoformat(),
        "clock": "time.perf_counter_ns (monotonic); requests.csv times are ms after started_at",
        "client": {"python": platform.python_version(), "cpus": os.cpu_count(), "loop": "asyncio, one thread"},
        "complete": aborted is None,
        "aborted": aborted,
        "stopped": run.runner.stopped,
    }


def run_bench(spec: DeploymentSpec, grpc_url: str | None = None, out_dir: Path | str = "reports",
              tokenizer_dir: Path | None = None, *, request_timeout_s: float | None = None, url: str | None = None,
              metrics_url: str | None = None, slo_extra: tuple[str, ...] = (), prometheus_port: int | None = None,
              plots: bool = True, on_level: Callable[[dict], None] | None = None, save_report: bool = True) -> dict:
    """Run spec.validation.workload; write out_dir/report.json, requests.csv and plots; return the report.

    `grpc_url` (the walking skeleton's argument) is used for protocol triton-grpc when no `url` is given.
    `save_report=False` leaves report.json to the caller (deploy adds its stage timings and writes it once);
    a run a stop signal cut short writes it here all the same, before the stop goes on."""
    wl = spec.validation.workload
    thresholds = slo_thresholds(spec, slo_extra)
    max_len = max_prompt_len(spec)
    transport = open_transport(spec, target_url(spec, url, grpc_url))
    metrics_url = metrics_url if metrics_url is not None else (
        default_metrics_url(spec) if wl.protocol.startswith("triton") else None)
    tokenizer_dir = Path(tokenizer_dir or spec.model.tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir, spec.model.trust_remote_code)
    counter = TokenCounter(tokenizer)
    plan = Plan(wl, tokenizer, max_input=max_len, max_seq=spec.limits.max_seq_len,
                token_ids=transport.token_ids, chat=transport.chat)
    deadline = request_deadline(wl, thresholds, longest_output(wl, plan.file_entries, spec.limits.max_seq_len),
                                request_timeout_s)

    exporter = None
    if prometheus_port is not None:
        from toolchain.bench.exporter import Exporter

        exporter = Exporter(prometheus_port, counter=counter)
    runner = Runner(transport, plan, timeout_s=deadline.seconds, think_time_s=wl.multi_turn.think_time_s,
                    on_done=exporter.observe if exporter else None)
    loads = levels_of(wl)
    started_wall = dt.datetime.now(dt.timezone.utc)
    run = BenchRun(wl=wl, thresholds=thresholds, transport=transport, plan=plan, counter=counter, runner=runner,
                   exporter=exporter, metrics_url=metrics_url, loads=loads, anchor_ns=time.perf_counter_ns(),
                   on_level=on_level)
    aborted, stopped = drive(run)
    if aborted:
        finish_interrupted_level(run, aborted)

    report = build_report(run.levels, run=run_section(spec, run, tokenizer_dir, started_wall, aborted),
                          workload=workload_section(run, deadline, max_len), notes=[])
    report["prediction"] = prediction(spec, run.levels)
    out_dir = Path(out_dir)
    if stopped is not None:  # the partial report, saved before the stop goes on
        write_outputs(out_dir, report, runner.records, run.anchor_ns)
        raise stopped
    if plots and run.levels:
        from toolchain.bench.plots import write_plots

        report["plots"] = write_plots(out_dir, report, runner.records)
    write_outputs(out_dir, report, runner.records, run.anchor_ns, with_report=save_report)
    return report
