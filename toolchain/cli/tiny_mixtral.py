"""`toolchain tiny-mixtral [OUT_DIR]`: the embedded tiny Llama upcycled into a tiny Mixtral, once."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("models/tiny-mixtral"))
@click.option("--from", "src", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=Path("models/tiny-llama"), show_default=True, help="The tiny Llama to upcycle.")
def command(out_dir: Path, src: Path) -> None:
    """Write a MixtralForCausalLM to OUT_DIR whose experts are noisy copies of the tiny Llama's trained MLPs
    (deterministic; a no-op when OUT_DIR's provenance.json matches)."""
    from toolchain.tinymodel.upcycle import build_tiny_mixtral  # torch loads only when this command runs

    build_tiny_mixtral(src, out_dir, log=click.echo)
