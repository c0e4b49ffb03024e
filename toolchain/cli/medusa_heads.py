"""`toolchain medusa-heads TARGET OUT_DIR`: train Medusa heads for a target model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click


@click.command()
@click.argument("target", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--heads", "num_heads", type=click.IntRange(1, 16), default=None,
              help="Number of heads: head h proposes the token h + 2 ahead [default: 4, or 3 with --quick].")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps [default: 240, 6 with --quick].")
@click.option("--tree-size", type=click.IntRange(1, 1024), default=None,
              help="Draft tokens per step: nodes of the tree written as medusa_choices [default: 24, 8 with --quick].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="A few steps on a slice of the corpus (seconds; for tests).")
def command(target: Path, out_dir: Path, num_heads: int | None, steps: int | None, tree_size: int | None,
            seed: int, quick: bool) -> None:
    """Train Medusa heads for TARGET (a model written by `toolchain tiny-model`: its tokenizer
    and training text) with the target frozen, and write them to OUT_DIR as a Hugging Face
    heads checkpoint (medusa_lm_head.safetensors + config.json with the measured tree) for
    `speculative.heads`."""
    from toolchain.tinymodel.medusa import QUICK_HEADS, HeadsRecipe, train_medusa_heads

    recipe = QUICK_HEADS if quick else HeadsRecipe()
    changes = {k: v for k, v in (("num_heads", num_heads), ("steps", steps), ("tree_size", tree_size)) if v is not None}
    train_medusa_heads(target, out_dir, recipe=dataclasses.replace(recipe, **changes), seed=seed, log=click.echo)
