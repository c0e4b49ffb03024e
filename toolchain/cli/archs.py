"""`toolchain archs`: the Hugging Face architectures the converter supports."""

from __future__ import annotations

import click
from toolchain.archs import supported


@click.command()
def command() -> None:
    """List supported Hugging Face architectures (config.json `architectures[0]`)."""

    for name in supported():
        click.echo(name)
