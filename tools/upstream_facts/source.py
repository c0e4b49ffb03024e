"""Read files of one upstream checkout: a git directory at a ref, or a plain
directory of files whose commit is given (for TensorRT-LLM, too large to clone
whole, its files are gathered one by one). A plain directory may hold
`.commits.json` (path -> commit) for files gathered from other commits than
the one named; each fact then records the commit of the file it came from."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    name: str
    repository: str
    ref: str
    commit: str
    root: Path
    git: bool

    @classmethod
    def open(cls, name: str, repository: str, spec: str) -> "Source":
        """`spec` is `GITDIR@REF` (bare or not) or `DIR@COMMIT` for a plain directory."""
        root, _, ref = spec.partition("@")
        path = Path(root)
        if not path.exists():
            raise SystemExit(f"{name}: {root} does not exist")
        is_git = (path / "HEAD").is_file() or (path / ".git").exists()
        if is_git:
            ref = ref or "HEAD"
            commit = subprocess.run(["git", "--git-dir", str(_git_dir(path)), "rev-parse", f"{ref}^{{commit}}"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        else:
            if not ref:
                raise SystemExit(f"{name}: a plain directory needs @COMMIT")
            commit = ref
        return cls(name, repository, ref, commit, path, is_git)

    def read(self, path: str) -> str:
        if self.git:
            return subprocess.run(["git", "--git-dir", str(_git_dir(self.root)), "show", f"{self.commit}:{path}"],
                                  capture_output=True, text=True, check=True).stdout
        return (self.root / path).read_text()

    def branches(self, pattern: str) -> list[str]:
        """Branch names of a git source matching the regular expression `pattern`, in order."""
        out = subprocess.run(["git", "--git-dir", str(_git_dir(self.root)), "for-each-ref", "--format=%(refname:short)",
                              "refs/heads"], capture_output=True, text=True, check=True).stdout.split()
        return sorted(b for b in out if re.fullmatch(pattern, b))

    def at(self, ref: str) -> "Source":
        """The same git source at another ref."""
        return Source.open(self.name, self.repository, f"{self.root}@{ref}")

    def commit_of(self, path: str) -> str:
        """The commit file `path` was taken from."""
        if self.git:
            return self.commit
        manifest = self.root / ".commits.json"
        commits = json.loads(manifest.read_text()) if manifest.is_file() else {}
        return commits.get(path, self.commit)

    def record(self) -> dict[str, str]:
        out = {"repository": self.repository, "ref": self.ref, "commit": self.commit}
        try:  # TensorRT-LLM names its version in one file
            m = re.search(r'__version__\s*=\s*"([^"]+)"', self.read("tensorrt_llm/version.py"))
            if m:
                out["version"] = m.group(1)
        except (OSError, subprocess.CalledProcessError):
            pass
        return out


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path
