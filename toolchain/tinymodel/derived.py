"""What the models derived from the embedded tiny Llama share (the tiny Mixtral, the tiny LoRA adapters): the
source's checks, and the provenance record that makes a rebuild a no-op while it matches."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from toolchain.errors import ToolchainError


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def llama_config(src: Path, fix: str) -> dict:
    """`src`'s config.json, refused in one line (`fix` says what to pass) unless `src` is a HF Llama directory."""
    if not (src / "model.safetensors").is_file() or not (src / "config.json").is_file():
        raise ToolchainError(f"{src} is not a Hugging Face Llama directory (config.json, model.safetensors)",
                             "pass the embedded tiny model, models/tiny-llama")
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ToolchainError(f"{src}: model_type {config.get('model_type')!r}, expected 'llama'", fix)
    return config


def is_current(out: Path, provenance: dict, src: Path, log: Callable[[str], None]) -> bool:
    """`out` was made from `src` by the same recipe (its provenance.json is `provenance`); says so when it was."""
    record = out / "provenance.json"
    if record.is_file() and json.loads(record.read_text()) == provenance:
        log(f"{out} is current (provenance.json matches {src}); nothing to do")
        return True
    return False
