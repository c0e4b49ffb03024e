"""`toolchain tiny-lora [OUT_DIR]`: two PEFT LoRA adapters for the embedded tiny Llama, once."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("models/tiny-llama-lora"))
@click.option("--from", "src", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=Path("models/tiny-llama"), show_default=True, help="The tiny Llama the adapters are for.")
def command(out_dir: Path, src: Path) -> None:
    """Write OUT_DIR/attn (q/k/v/o_proj, rank 8) and OUT_DIR/all (every projection, rank 16): PEFT adapters
    briefly fine-tuned from the tiny Llama (seeded; a no-op when OUT_DIR's provenance.json matches)."""
    from toolchain.tinymodel.lora import build_tiny_lora  # torch and peft load only when this command runs

    build_tiny_lora(src, out_dir, log=click.echo)
