"""Shared CLI plumbing: the spec argument, `--set` overrides, workspace."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from toolchain.spec import load_spec
from toolchain.workspace import Workspace


class Context:
    def __init__(self, debug: bool, root: Path):
        self.debug = debug
        self.workspace = Workspace(root.resolve())


pass_ctx = click.make_pass_decorator(Context)


def spec_command(func):
    """Add `SPEC` and repeated `--set a.b=value`; pass (ctx, spec, ...) to `func`."""

    @click.argument("spec_path", metavar="SPEC", type=click.Path(path_type=Path))
    @click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                  help="Override a spec field, e.g. --set parallelism.tp=2 (repeatable).")
    @pass_ctx
    @functools.wraps(func)
    def wrapper(ctx: Context, spec_path: Path, overrides: tuple[str, ...], **kwargs):
        spec = load_spec(spec_path, overrides)
        return func(ctx, spec, **kwargs)

    return wrapper
