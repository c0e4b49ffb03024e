"""The slow list in conftest.py stays true to the tests it names: a renamed or deleted test would otherwise drop
out of it silently and land back in `make test-fast`'s tier with its full cost."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

from conftest import SLOW_UNIT_TESTS

ROOT = Path(__file__).resolve().parent.parent


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_every_slow_pattern_names_a_test_that_exists():
    stale = []
    for pattern in SLOW_UNIT_TESTS:
        file, _, name = pattern.partition("::")
        path = ROOT / file
        if not path.is_file():
            stale.append(f"{pattern}: no file {file}")
            continue
        base = name.split("[", 1)[0]
        names = _test_names(path)
        # A glob on the parameter ids ("*int4_awq*") matches test ids, not function names: only a name is checked.
        if base.startswith("*") or any(fnmatch.fnmatchcase(n, base) for n in names):
            continue
        stale.append(f"{pattern}: no test {base} in {file}")
    assert not stale, "conftest.py SLOW_UNIT_TESTS names tests that are gone:\n" + "\n".join(stale)
