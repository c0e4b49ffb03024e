"""`toolchain tiny-model OUT_DIR`: train the embedded default model."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed for weight init and batch order; a seed reproduces the same weights on one machine.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Optimizer steps [default: 320, or 6 with --quick].")
@click.option("--quick", is_flag=True, help="A few steps of a smaller model on a slice of the corpus (seconds; for tests).")
@click.option("--draft-of", "draft_of", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Train a smaller draft model for speculative decoding with this model's tokenizer.")
def command(out_dir: Path, seed: int, steps: int | None, quick: bool, draft_of: Path | None) -> None:
    """Train a small Llama (GQA 4/2 heads) on the Python standard library and
    write it to OUT_DIR in Hugging Face format."""
    from toolchain.tinymodel import build_tiny_model  # torch/transformers load only when this command runs

    build_tiny_model(out_dir, seed=seed, steps=steps, quick=quick, draft_of=draft_of, log=click.echo)
