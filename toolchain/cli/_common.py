"""Shared CLI plumbing: the spec argument, `--set` overrides, `--skip-check`,
the preflight checks that guard each stage, and the workspace."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from toolchain.spec import load_spec
from toolchain.weights_source import with_converted_source
from toolchain.workspace import Workspace
from toolchain.checks.preflight import FAIL, GUARDED, check_skip_ids, run_preflight

# Keyword arguments that make a command only print (or write out) what it would do: checks
# then report instead of refusing, so a dry run always shows its commands. Writing manifests
# for GPU hosts is printing: TensorRT-LLM need not be on the host that writes them.
_DRY_FLAGS = ("dry_run", "print_only", "manifests_dir")
# Stages that read the spec's model.checkpoint as written: `plan` plans from it (config.json is
# enough) and `convert` converts it. Every later stage takes the weights `convert` recorded when
# the spec's own directory holds none (toolchain/weights_source.py).
_READS_OWN_CHECKPOINT = ("plan", "convert")


class Context:
    def __init__(self, debug: bool, root: Path):
        self.debug = debug
        self.workspace = Workspace(root.resolve())


pass_ctx = click.make_pass_decorator(Context)


def preflight(ctx: Context, spec, stage: str, skip: tuple[str, ...], dry: bool) -> None:
    """Run the checks guarding `stage` (toolchain.checks.preflight); a failure stops
    the stage unless skipped, and is only reported by dry runs. Passing checks
    and warnings stay quiet here: `toolchain plan` shows them."""

    if stage not in GUARDED:
        check_skip_ids(skip)
        return
    results = run_preflight(spec, stage, ctx.workspace, skip=skip, enforce=not dry)
    for r in results:
        if r.status == FAIL:
            click.echo(f"warning: check {r.id} fails: {r.message}", err=True)


def spec_command(func):
    """Add `SPEC`, repeated `--set a.b=value` and `--skip-check ID`; run the
    preflight checks of the command's stage; pass (ctx, spec, ...) to `func`."""

    @click.argument("spec_path", metavar="SPEC", type=click.Path(path_type=Path))
    @click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                  help="Override a spec field, e.g. --set parallelism.tp=2 (repeatable).")
    @click.option("--skip-check", "skip_checks", multiple=True, metavar="ID",
                  help="Start even though preflight check ID fails (repeatable; `toolchain plan` lists the ids).")
    @pass_ctx
    @functools.wraps(func)
    def wrapper(ctx: Context, spec_path: Path, overrides: tuple[str, ...], skip_checks: tuple[str, ...], **kwargs):
        spec = load_spec(spec_path, overrides)
        stage = click.get_current_context().info_name or func.__name__
        dry = any(kwargs.get(flag) for flag in _DRY_FLAGS)
        if stage == "plan":
            return func(ctx, spec, skip_checks=skip_checks, **kwargs)
        if stage not in _READS_OWN_CHECKPOINT:
            spec, note = with_converted_source(spec, ctx.workspace)
            if note:
                click.echo(f"note: {note}", err=True)
        preflight(ctx, spec, stage, skip_checks, dry)
        return func(ctx, spec, **kwargs)

    return wrapper
