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
    outputs: dict[str, object] = field(default_factory=dict)
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


def is_current(directory: Path, wanted: Manifest) -> bool:
    """True when `directory` holds a complete output built from the same key."""
    have = Manifest.read(directory)
    return have is not None and have.key() == wanted.key()
