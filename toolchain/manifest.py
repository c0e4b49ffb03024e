"""Stage manifests: what a stage produced, from which spec and inputs.

A stage is reused only when its manifest exists (the directory was renamed into
place complete) and records the same key: spec hash, input hashes and tool
versions. Anything else rebuilds.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from toolchain import __version__
from toolchain.fsutil import atomic_file

MANIFEST = "manifest.json"


def tool_versions() -> dict[str, str]:
    versions = {"toolchain": __version__, "python": platform.python_version()}
    for mod in ("torch", "safetensors", "transformers", "tokenizers", "tritonclient"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover - optional at some stages
            continue
    return versions


@dataclass
class Manifest:
    stage: str
    spec_hash: str
    inputs: dict[str, str]
    tools: dict[str, str] = field(default_factory=tool_versions)
    outputs: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    seconds: float = 0.0

    def key(self) -> dict:
        return {"stage": self.stage, "spec_hash": self.spec_hash, "inputs": self.inputs, "tools": self.tools}

    def write(self, directory: Path) -> None:
        with atomic_file(Path(directory) / MANIFEST) as fh:
            json.dump(asdict(self), fh, indent=2, sort_keys=True)
            fh.write("\n")

    @classmethod
    def read(cls, directory: Path) -> "Manifest | None":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            return None


def content_hash(directory: Path) -> str:
    """sha256 of a stage's manifest without its time fields (`created`, `seconds`): what the next
    stage records as its input, so a rerun that rebuilt the same output leaves the next stage current
    (and its manifest byte-identical). An unreadable manifest hashes as its bytes; "missing" when
    there is none."""
    import hashlib

    path = Path(directory) / MANIFEST
    if not path.is_file():
        return "missing"
    have = Manifest.read(directory)
    if have is None:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    data = {k: v for k, v in asdict(have).items() if k not in ("created", "seconds")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def current_manifest(directory: Path, wanted: Manifest) -> Manifest | None:
    """The manifest `directory` holds when it is a complete output built from the same key, else None."""
    have = Manifest.read(directory)
    return have if have is not None and have.key() == wanted.key() else None


def is_current(directory: Path, wanted: Manifest) -> bool:
    """True when `directory` holds a complete output built from the same key."""
    return current_manifest(directory, wanted) is not None
