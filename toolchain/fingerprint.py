"""The fingerprint of a stage's input file, for the manifests that decide whether a stage reruns.

A small file is hashed whole; a big one (a multi-GB safetensors shard) by its size, mtime and its first and
last MiB, so that checking a 70B checkpoint costs milliseconds rather than minutes."""

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
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(EDGE))
        fh.seek(st.st_size - EDGE)
        h.update(fh.read(EDGE))
    return "fingerprint:" + h.hexdigest()
