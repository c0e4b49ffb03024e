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
from toolchain.errors import ToolchainError
from toolchain.procgroup import pid_running


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `final`; on success replace
    `final` with it, on any error remove it and leave `final` untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
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


def _sweep_stale(final: Path) -> None:
    """Remove what a killed run left beside `final`: its temporary (`.NAME.tmp-PID-*`) and displaced
    (`.NAME.old-PID`) directories, once the process that made them is gone (a live one may be writing)."""
    for leftover in final.parent.glob(f".{final.name}.*"):
        kind, _, tail = leftover.name[len(final.name) + 2:].partition("-")
        pid = tail.split("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and leftover.is_dir() and not leftover.is_symlink() \
                and not pid_running(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def write_dir(out_dir: Path | str, texts: dict[str, str], *, option: str, executable: tuple[str, ...] = ()) -> list[Path]:
    """Replace `out_dir` as a whole, atomically, with one file per entry of `texts` (names ending in
    `executable` made runnable); refused when it is a file or holds files it would not write, as it
    then is not a directory a previous run wrote. `option` names the flag that chose it."""

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ToolchainError(f"{option} {out} is a file", "give a directory (it is created or replaced)")
    if out.is_dir() and any(p.name not in texts for p in out.iterdir()):
        raise ToolchainError(f"{option} {out} holds other files", "give a new directory or one this command wrote")
    with atomic_dir(out) as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text)
            if executable and name.endswith(executable):
                (tmp / name).chmod(0o755)
    return [out / name for name in texts]


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
