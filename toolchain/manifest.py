"""Stage manifests: what a stage produced, from which spec and inputs.

A stage is reused only when its manifest exists (the directory was renamed into
place complete), records the same key (spec hash, input hashes and tool
versions) and the directory still holds the files the stage wrote, as the
manifest records them (`files`). Anything else rebuilds, saying which file
differs; a user who asked to keep hand edits (--keep-edits) keeps them, and the
manifest then names them (`edited_by_hand`), so `serve` accepts them and the
deploy report shows them.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from toolchain import __version__
from toolchain.fingerprint import output_hash
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
    # Every file the stage wrote (path relative to its directory -> fingerprint.output_hash), recorded by
    # write() once the output is complete, before it is renamed into place. None in a manifest written before
    # files were recorded: such an output is never reused (it rebuilds once).
    files: dict[str, str] | None = None
    # The files that differ from what the stage wrote and were kept at the user's request (--keep-edits);
    # `files` then records them as kept.
    edited_by_hand: list[str] = field(default_factory=list)

    def key(self) -> dict:
        return {"stage": self.stage, "spec_hash": self.spec_hash, "inputs": self.inputs, "tools": self.tools}

    def write(self, directory: Path) -> None:
        """Record every file under `directory` (the stage's complete output) in `files`, then write
        manifest.json there."""
        self.files = output_files(directory)
        self._dump(directory)

    def _dump(self, directory: Path) -> None:
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


def output_files(directory: Path) -> dict[str, str]:
    """Relative path -> fingerprint of every file under `directory` that its stage wrote: all but
    manifest.json, hidden names (this toolchain's temporary files, an editor's swap file) and __pycache__
    (Python writes it beside a model.py that tritonserver's Python backend imports)."""
    root = Path(directory)
    out = {}
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if parts == (MANIFEST,) or any(p.startswith(".") or p == "__pycache__" for p in parts) \
                or not path.is_file():
            continue
        out["/".join(parts)] = output_hash(path)
    return out


@dataclass(frozen=True)
class FileDiff:
    """How a stage's output directory differs from the files its manifest records (relative paths)."""

    changed: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    added: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.changed or self.missing or self.added)

    def names(self) -> list[str]:
        return sorted(self.changed + self.missing + self.added)

    def describe(self, directory: Path, stage: str) -> str:
        """One line naming the files (the first three) and what happened to each, e.g.
        "model_repo/x/tensorrt_llm_bls/1/model.py changed since model-repo wrote it"."""
        items = [f"{Path(directory) / name} {what}" for what, names in
                 (("changed", self.changed), ("removed", self.missing), ("added", self.added)) for name in names]
        return f"{_listing(items)} since {stage} wrote it"


def _listing(items: list[str]) -> str:
    """The first three of `items`, and how many more there are."""
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def diff_files(directory: Path, manifest: Manifest) -> FileDiff:
    """(changed, missing, added): how the files under `directory` differ from those `manifest` records."""
    recorded = manifest.files or {}
    found = output_files(directory)
    return FileDiff(changed=tuple(n for n in sorted(recorded) if n in found and found[n] != recorded[n]),
                    missing=tuple(n for n in sorted(recorded) if n not in found),
                    added=tuple(n for n in sorted(found) if n not in recorded))


def reusable(directory: Path, wanted: Manifest, *, redo: str, keep_edits: bool = False,
             say: Callable[[str], None] = lambda _msg: None) -> Manifest | None:
    """The manifest of `directory` when its stage may reuse the output: the same key (current_manifest) and
    the files the stage wrote. Otherwise None, and where it is the files, one line through `say` naming
    them and `redo` (what the stage does instead, e.g. "rendering again"). With `keep_edits` a changed,
    removed or added file is kept instead: the manifest records the files as they are now and names them
    in `edited_by_hand`, and `say` says so. A manifest that records no files (written before they were
    recorded) is never reused. Hand edits that a change of settings or inputs replaces are named too."""
    have = Manifest.read(directory)
    if have is None:
        return None
    if have.key() != wanted.key():
        edits = set(have.edited_by_hand) | set(diff_files(directory, have).names()) if have.files is not None else set()
        if edits:
            shown = _listing([str(Path(directory) / n) for n in sorted(edits)])
            say(f"{redo} for changed settings or inputs replaces hand edits: {shown}")
        return None
    if have.files is None:
        say(f"{directory} records no list of its files (written by an older toolchain); {redo}")
        return None
    diff = diff_files(directory, have)
    earlier = [n for n in have.edited_by_hand if n not in diff.names()]
    if not diff and not earlier:
        return have
    if not keep_edits:
        lines = ([diff.describe(directory, have.stage)] if diff else []) + \
                [f"{Path(directory) / n} was kept as a hand edit" for n in earlier]
        say(f"{'; '.join(lines)}; {redo} (--keep-edits keeps hand edits)")
        return None
    if diff:
        have.files = output_files(directory)
        have.edited_by_hand = sorted(set(earlier) | set(diff.names()))
        have._dump(directory)
    say(f"{directory}: keeping hand edits (--keep-edits); edited by hand: {', '.join(have.edited_by_hand)}")
    return have


def output_problem(directory: Path) -> str | None:
    """Why `directory` is not the output its stage wrote, in one line (hand edits kept with --keep-edits
    aside); None when it is. What serve asks before it starts a server on it."""
    have = Manifest.read(directory)
    if have is None:
        return f"{directory} has no readable {MANIFEST}, so its files cannot be checked"
    if have.files is None:
        return f"{directory} records no list of its files (written by an older toolchain)"
    diff = diff_files(directory, have)
    return diff.describe(directory, have.stage) if diff else None
