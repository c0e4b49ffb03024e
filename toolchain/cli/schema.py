"""`toolchain schema`: the spec's JSON Schema for editors, or its field reference as Markdown."""

from __future__ import annotations

import json
from pathlib import Path

import click

from toolchain.fsutil import atomic_file
from toolchain.spec_reference import json_schema, markdown_reference


@click.command()
@click.option("--markdown", is_flag=True, help="Print the field reference (docs/spec-reference.md) instead.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write to this file instead of stdout.")
def command(markdown: bool, out: Path | None) -> None:
    """Print the JSON Schema of a build/<name>.yaml spec (for an editor's YAML language server:
    `# yaml-language-server: $schema=spec.schema.json`), or with --markdown every field's type,
    default and description."""

    text = markdown_reference() if markdown else json.dumps(json_schema(), indent=2) + "\n"
    if out is None:
        click.echo(text, nl=False)
        return
    with atomic_file(out) as fh:
        fh.write(text)
    click.echo(f"wrote {out}", err=True)
