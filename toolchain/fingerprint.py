"""The fingerprints of a stage's input files and of the files it wrote, for the manifests that decide whether
a stage reruns.

A small file is hashed whole; a big one (a multi-GB safetensors shard or engine rank file) by its size and
its first and last MiB (and, for an input, its mtime), so that checking a 70B checkpoint costs milliseconds
rather than minutes."""

from __future__ import annotations

import hashlib
from pathlib import Path

from toolchain.fsutil import sha256_file

# Files above this are fingerprinted instead of fully hashed (see input_hash).
FULL_HASH_LIMIT = 256 << 20
EDGE = 1 << 20


def input_hash(path: Path) -> str:
    """sha256 of a small file; for a big one, of its size, mtime and first and
    last MiB. Hashing tens of GB on every run would cost minutes; a changed
    download changes size or mtime, and an edit in place almost surely touches
    the header (first MiB). `--force` covers the rest."""
    st = path.stat()
    if st.st_size <= FULL_HASH_LIMIT:
        return "sha256:" + sha256_file(path)
    return "fingerprint:" + _edges(path, st.st_size, f"{st.st_size}:{st.st_mtime_ns}")


def output_hash(path: Path) -> str:
    """What a stage records of a file it wrote (Manifest.files): sha256 of a small file (configs, a
    repository's model.py), and of a big one (a rank's tensors) its size and first and last MiB, where a
    safetensors or engine header lives. A truncated or replaced file changes its size or header. No mtime,
    unlike input_hash: a workspace copied or moved whole is still what the stage wrote."""
    size = path.stat().st_size
    if size <= FULL_HASH_LIMIT:
        return "sha256:" + sha256_file(path)
    return "edges:" + _edges(path, size, f"{size}")


def _edges(path: Path, size: int, salt: str) -> str:
    """sha256 of `salt` and the first and last EDGE bytes of `path` (`size` bytes long)."""
    h = hashlib.sha256(salt.encode())
    with open(path, "rb") as fh:
        h.update(fh.read(EDGE))
        fh.seek(size - EDGE)
        h.update(fh.read(EDGE))
    return h.hexdigest()
