"""`toolchain deploy SPEC`: every stage, serve, bench, stop."""

from __future__ import annotations

import time
from pathlib import Path

import click

from toolchain.cli._common import Context, spec_command
from toolchain.errors import StageFailed
from toolchain.stopsignals import stop_on_signals
from toolchain.pipeline import deploy


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Report directory (default reports/<name>).")
@click.option("--keep-edits", is_flag=True,
              help="Keep files edited by hand since a stage wrote its output instead of writing it again "
                   "(its manifest and report.json record them as edited by hand).")
@spec_command
def command(ctx: Context, spec, out_dir: Path | None, keep_edits: bool) -> None:
    """Convert, build, render the Triton repository, serve, bench and stop."""

    start = time.perf_counter()

    def progress(stage: str, msg: str) -> None:
        click.echo(f"[{time.perf_counter() - start:7.2f}s] {stage:<12} {msg}", err=True)

    from toolchain.bench.report import print_report

    with stop_on_signals():  # SIGTERM, SIGINT, SIGHUP: the servers deploy started stop before it exits
        report = deploy(spec, ctx.workspace, out_dir, progress, keep_edits=keep_edits)
    print_report(report)
    for stage, files in (report.get("edited_by_hand") or {}).items():
        click.echo(f"edited by hand ({stage} kept them with --keep-edits): {', '.join(files)}")
    target = (out_dir or ctx.workspace.report_dir(spec)) / "report.json"  # deploy saved it, stage timings too
    openai = report.get("openai")
    if openai:
        def p50(key):
            value = (openai.get(key) or {}).get("p50")
            return "-" if value is None else f"{value:.1f} ms"

        click.echo(f"OpenAI server ({openai['protocol']}): TTFT p50 {p50('ttft_ms')}, TPOT p50 {p50('tpot_ms')}, "
                   f"{openai.get('num_requests')} requests, {openai.get('errors')} errors; report: {openai['report']}")
    quality = report.get("quality")
    if quality:
        c = quality["choices"]
        click.echo(f"quality through the OpenAI server: perplexity ratio {quality['perplexity_ratio']:.5f}, greedy "
                   f"agreement {quality['greedy_token_agreement']:.2%}, multiple choice {c['accuracy']:.3f} "
                   f"(reference {c['reference_accuracy']:.3f})")
    click.echo(f"deploy finished in {time.perf_counter() - start:.1f}s; report: {target}")
    missed = [what for what, r in (("Triton", report), ("OpenAI server", openai or {}))
              if not r.get("slo", {}).get("passed", True)]
    if missed:
        raise StageFailed(f"SLO missed ({' and '.join(missed)}); see the report above", str(target))
    if quality and not quality["passed"]:
        raise StageFailed(f"quality gate missed: {'; '.join(quality['missed'])}",
                          f"the figures are in {target} under quality")
