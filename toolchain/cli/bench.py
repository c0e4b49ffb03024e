"""`toolchain bench SPEC`: load the served model with the spec's workload and judge the SLOs."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.bench.failfast import stop_line
from toolchain.cli._common import spec_command
from toolchain.errors import StageFailed, ToolchainError
from toolchain.slo import parse_slo
from toolchain.slo import RATE_KEYS
from rich.console import Console


def default_url(spec) -> str:
    """The Triton gRPC address from the serving section (the default protocol's)."""
    from toolchain.bench.run import default_url as url_for

    return url_for(spec, "triton-grpc")


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ToolchainError(f"bad --sweep '{text}'", "write comma-separated loads, e.g. --sweep 1,2,4,8") from None
    if not values:
        raise ToolchainError("--sweep is empty", "write comma-separated loads, e.g. --sweep 1,2,4,8")
    return values


@click.command()
@spec_command
@click.option("--url", default=None, metavar="URL",
              help="Server address: host:port (triton-grpc) or http://host:port [default: from the spec].")
@click.option("--protocol", type=click.Choice(["triton-grpc", "triton-http", "openai-completions", "openai-chat"]),
              default=None, help="Wire protocol [default: validation.workload.protocol].")
@click.option("--model", default=None, help="Model to bench [default: validation.workload.endpoint].")
@click.option("--mode", type=click.Choice(["concurrency", "rate"]), default=None,
              help="Closed loop at a concurrency, or open loop at a request rate.")
@click.option("--sweep", default=None, metavar="L1,L2,..", help="Load levels (concurrencies or req/s), run in order.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds per level instead of a request count.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where report.json, requests.csv and the plots go [default: reports/<name>].")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds one request may take before it is cancelled and counted as failed "
                   "[default: validation.workload.request_timeout_s, else derived from the workload and the SLOs].")
@click.option("--slo", "slos", multiple=True, metavar="EXPR",
              help="Extra threshold, e.g. 'ttft_p99_ms<=500' or 'itl p99.9 <= 80 ms' (repeatable).")
@click.option("--metrics-url", default=None, help="Server Prometheus endpoint to cross-check against "
              "[default: serving.metrics_port; '' disables].")
@click.option("--prometheus-port", type=click.IntRange(0, 65535), default=None,
              help="Serve the harness's own metrics (llm_ttft_seconds, ...) on this port while it runs.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def command(ctx, spec, url, protocol, model, mode, sweep, duration, out_dir, request_timeout, slos, metrics_url,
            prometheus_port, no_plots) -> None:
    """Measure TTFT, TPOT, ITL, E2E, send lag and throughput for every load level of
    validation.workload (override with the options or --set validation.workload.<field>=...);
    write report.json, requests.csv and plots; exit 1 when an SLO is missed or the run is incomplete."""

    from toolchain.bench.report import print_level, print_summary

    wl = spec.validation.workload
    for field, value in (("protocol", protocol), ("endpoint", model), ("mode", mode), ("duration_s", duration)):
        if value is not None:
            setattr(wl, field, value)
    if sweep is not None:
        values = _floats(sweep)
        if (mode or wl.mode) == "concurrency" and any(v != int(v) or v < 1 for v in values):
            raise ToolchainError(f"bad --sweep '{sweep}': concurrencies are whole numbers >= 1")
        wl.sweep = values
    for text in slos:
        try:
            parse_slo(text)
        except ValueError as err:
            raise ToolchainError(str(err), "see `toolchain bench --help` for the form") from None

    from toolchain.bench.run import run_bench

    import sys

    # Piped output (CI logs) would otherwise be cut to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 150)
    out_dir = out_dir or ctx.workspace.report_dir(spec)
    report = run_bench(spec, None, out_dir, request_timeout_s=request_timeout, url=url, metrics_url=metrics_url,
                       slo_extra=tuple(slos), prometheus_port=prometheus_port, plots=not no_plots,
                       on_level=lambda level: print_level(level, console))
    print_summary(report, console)
    click.echo(f"report: {Path(out_dir) / 'report.json'}" +
               (f" (plots: {', '.join(report['plots'])})" if report.get("plots") else ""))
    if report.get("stopped"):
        raise StageFailed(stop_line(report["stopped"]), f"partial report in {out_dir}")
    if report.get("aborted"):
        raise StageFailed(f"bench incomplete: {report['aborted']}", f"partial report in {out_dir}")
    if not report["slo"]["passed"]:
        raise StageFailed(f"SLO missed: {missed_slos(report['slo'])}", f"see {Path(out_dir) / 'report.json'}")


def missed_slos(slo: dict) -> str:
    def fmt(v) -> str:
        return "n/a" if v is None else f"{v:.6g}"

    missed = [f"{name} {fmt(c['measured'])} {'<' if name in RATE_KEYS else '>'} {c['threshold']}"
              for name, c in slo.items() if isinstance(c, dict) and not c["passed"]]
    where = f" at level {slo['level']}" if slo.get("level") is not None else ""
    return (", ".join(missed) or "no request completed") + where
