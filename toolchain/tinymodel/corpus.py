"""The training text: the running interpreter's own standard library.

Every Python install carries it, so the default model can be rebuilt offline
on any machine, and it is code, which makes greedy samples easy to judge by
eye. Tests are left out because they hold large generated data blobs and
deliberately odd encodings.
"""

from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HOLDOUT_EVERY = 20


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]

    def describe(self) -> str:
        return (f"Python {sys.version.split()[0]} standard library .py sources under {self.root} "
                f"(excluding {', '.join(sorted(EXCLUDED_DIRS))}); {len(self.train)} training files, "
                f"{len(self.heldout)} held out (every {HOLDOUT_EVERY}th file in sorted order)")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """Sorted by relative path so the file order, and so the split, is the
    same on every run and every filesystem."""
    found = [p for p in root.rglob("*.py")
             if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def split_holdout(files: list[Path], every: int = HOLDOUT_EVERY) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    train = tuple(f for i, f in enumerate(files) if i % every != 0)
    heldout = tuple(f for i, f in enumerate(files) if i % every == 0)
    return train, heldout


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """The stdlib split into training and held-out files; `max_files` keeps a
    prefix of the sorted list (for quick runs)."""
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_sources(root) if root.is_dir() else []
    if max_files is not None:
        files = files[:max_files]
    if len(files) < 2:
        raise ToolchainError(f"found no Python standard-library sources under {root}",
                             "run with an interpreter that ships its stdlib .py files (not a stripped build)")
    train, heldout = split_holdout(files)
    return Corpus(root=root, train=train, heldout=heldout)


def read_text(path: Path) -> str:
    # A few stdlib files carry latin-1 bytes; replacing them keeps the text
    # (and so the tokens) identical run to run instead of failing.
    return path.read_text(encoding="utf-8", errors="replace")
