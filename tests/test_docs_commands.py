"""Every `toolchain ...` command shown in a fenced block of README.md or docs/ that needs no GPU and
no weights (`plan`, and anything with `--print`, `--dry-run` or `--manifests`) runs and exits 0.

A newcomer pastes these first; a doc example that fails is the first bug they meet. Each command runs
as a user would run it, as its own process from a directory where the repository's `build/` and
`models/` resolve as in the docs, so what it writes (manifests, engines/) lands in a scratch directory.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What a laptop can run: it reads config.json files and prints or writes text, nothing more.
OFFLINE_FLAGS = {"--print", "--dry-run", "--manifests"}


def _fenced_commands(path: Path) -> list[tuple[int, str]]:
    found, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            text = text.removeprefix("$ ")
            if text.startswith("toolchain "):
                found.append((number, text))
    return found


def _offline(argv: list[str]) -> bool:
    if len(argv) < 2:
        return False
    specs = [a for a in argv if a.endswith((".yaml", ".yml"))]
    # A placeholder such as SPEC or MODEL_DIR is prose, not a command to paste.
    if not specs or not all((ROOT / s).is_file() for s in specs):
        return False
    return argv[1] == "plan" or bool(OFFLINE_FLAGS & {a.split("=", 1)[0] for a in argv})


def _cases() -> list:
    cases = []
    for doc in DOCS:
        for number, text in _fenced_commands(doc):
            argv = shlex.split(text, comments=True)
            if _offline(argv):
                cases.append(pytest.param(argv, id=f"{doc.relative_to(ROOT)}:{number}"))
    return cases


CASES = _cases()


def test_the_docs_show_offline_commands():
    # The collector itself must keep finding the examples, or the test below would pass on nothing.
    assert len(CASES) >= 8, [c.id for c in CASES]


@pytest.mark.parametrize("argv", CASES)
def test_doc_command_runs(argv, tmp_path):
    for name in ("build", "models", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    cmd = [sys.executable, "-c", "import sys; from toolchain.cli import main; sys.exit(main())", *argv[1:]]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}"


def test_every_doc_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in DOCS[1:] if f"(docs/{p.name})" not in readme]
    assert unlinked == []


@pytest.mark.parametrize("path", ["tune/tiny-llama/tune.json", "tune/tiny-llama/specs/tiny-llama-tuned-1.yaml",
                                  "reports/tiny-llama/report.json", "engines/tiny-llama/config.json"])
def test_generated_outputs_are_ignored_by_git(path):
    """What the commands write under the root by default (`tune --out` defaults to tune/<name>) is never
    offered for a commit."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{path} is not git-ignored"
