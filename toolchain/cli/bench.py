"""`toolchain bench SPEC`: stream the spec's workload at the served model and judge the SLOs."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli._common import spec_command
from toolchain.errors import StageFailed, ToolchainError


def default_url(spec) -> str:
    if spec.serving.grpc_port == 0:
        raise ToolchainError("serving.grpc_port is 0 (a free port picked at start), so the bench cannot guess it",
                             "pass --url host:port of the running server")
    host = spec.serving.host
    # A server bound to every interface is reached on loopback.
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"{host}:{spec.serving.grpc_port}"


@click.command()
@spec_command
@click.option("--url", metavar="HOST:PORT", default=None,
              help="Triton gRPC endpoint [default: serving.host:serving.grpc_port].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where report.json and requests.csv go [default: reports/<name>].")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds one request may take before it is cancelled and counted as failed.")
def command(ctx, spec, url, out_dir, request_timeout) -> None:
    """Measure TTFT, TPOT, ITL, E2E and throughput with validation.workload
    (override with --set validation.workload.concurrency=8 ...); exit 1 when an SLO is missed."""
    from toolchain.bench.report import print_report
    from toolchain.bench.run import run_bench

    out_dir = out_dir or ctx.workspace.report_dir(spec)
    report = run_bench(spec, url or default_url(spec), out_dir, request_timeout_s=request_timeout)
    print_report(report)
    click.echo(f"report: {Path(out_dir) / 'report.json'}")
    if report.get("aborted"):
        raise StageFailed(f"bench aborted: {report['aborted']}", f"partial report in {out_dir}")
    if not report["slo"]["passed"]:
        raise StageFailed(f"SLO missed: {missed_slos(report['slo'])}", f"see {Path(out_dir) / 'report.json'}")


def missed_slos(slo: dict) -> str:
    def fmt(v) -> str:
        return "n/a" if v is None else f"{v:.6g}"

    missed = [f"{name} {fmt(c['measured'])} > {c['threshold']}"
              for name, c in slo.items() if name != "passed" and not c["passed"]]
    return ", ".join(missed) or "no request completed"

