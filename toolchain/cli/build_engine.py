"""`toolchain build-engine SPEC`: convert if needed, then build the engine."""

from __future__ import annotations

import shlex

import click

from toolchain.cli._common import Context, spec_command
from toolchain.engine.build import planned_commands, run_build


@click.command()
@click.option("--force", is_flag=True, help="Rebuild even when the engine is up to date.")
@click.option("--keep-edits", is_flag=True,
              help="Keep files edited by hand since the engine (or its checkpoint) was written instead of "
                   "building again (its manifest records them as edited by hand).")
@click.option("--dry-run", is_flag=True,
              help="Print the trtllm-build command line(s) (target trtllm) and exit; failing checks only warn.")
@spec_command
def command(ctx: Context, spec, force: bool, keep_edits: bool, dry_run: bool) -> None:
    """Build the engine for SPEC into engines/<name>/engine (reused when nothing changed).
    Target trtllm runs trtllm-build 1.2 (PATH or build.trtllm_build), one log per rank under mpirun."""

    ws = ctx.workspace
    if spec.llmapi_path:
        click.echo(f"target {spec.target}: no engine to build (the PyTorch backend loads "
                   f"{'the converted' if spec.quantization.method != 'none' else 'the'} checkpoint when it starts); "
                   "next: `toolchain model-repo`")
        return
    if dry_run:
        if spec.target == "trtllm":
            for cmd in planned_commands(spec, ws):
                click.echo(shlex.join(cmd))
        else:
            click.echo(f"target cpu: engine config + {spec.parallelism.world_size} rank file(s) into {ws.engine_dir(spec)}")
        return
    manifest, reused = run_build(spec, ws, force=force, keep_edits=keep_edits, echo=click.echo)
    for warning in manifest.outputs.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    state = "up to date, reused" if reused else f"built in {manifest.seconds:.2f}s"
    click.echo(f"engine {ws.engine_dir(spec)}: {state} ({manifest.outputs.get('ranks')} rank(s), target {spec.target})")
    if not reused and manifest.outputs.get("logs"):
        click.echo(f"logs: {ws.engine_dir(spec) / 'logs'} ({', '.join(manifest.outputs['logs'])})")
