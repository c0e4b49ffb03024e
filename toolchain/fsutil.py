"""Filesystem helpers: atomic output directories and content hashes.

Every stage writes into a sibling temporary directory and renames it into
place only when complete, so an interrupted run never leaves a directory that
looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `final`; on success replace
    `final` with it, on any error remove it and leave `final` untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # mkdtemp makes the directory 0700; outputs are read by other users (a
    # tritonserver running as a service account), so open it up like mkdir.
    os.chmod(tmp, 0o777 & ~_umask())
    old = None
    if final.exists() or final.is_symlink():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        if old.is_symlink():
            old.unlink()  # a link that stood at `final` is dropped, never what it points to
        else:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(final: Path, mode: str = "w") -> Iterator:
    """Open a temporary file next to `final`; rename it into place on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; the result is a normal output file
        with os.fdopen(fd, mode) as fh:
            yield fh
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(root: Path, skip: tuple[str, ...] = ("manifest.json",)) -> str:
    """Hash of every regular file under `root` (relative name + content)."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.name in skip or any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        h.update(rel.encode())
        h.update(b"\0")
        h.update(sha256_file(path).encode())
    return h.hexdigest()
