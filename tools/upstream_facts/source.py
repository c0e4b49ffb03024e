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


# The TensorRT-LLM release the toolchain targets, and why no fact is read at it: what a reader of a fact file needs
# to weigh the commits the entries name (checked 2026-12 with the code index and tensorrtllm_backend's history).
PINNED_TRTLLM_RELEASE = {
    "version": "1.2.1",
    "held_by_code_index": False,
    "note": ("The code index stores no NVIDIA/TensorRT-LLM file at release 1.2.1: its tensorrt_llm/version.py "
             "versions say 1.0.0rc4 and 1.2.0rc2, and no stored file names 1.2.1. Triton's 26.04 container "
             "(tensorrtllm_backend r26.04, built from TensorRT-LLM's release/1.2.1 branch) pins the tensorrt_llm "
             "submodule at triton-inference-server/TensorRT-LLM 2fdb9e66302b15db9a9b5e71d3ac45d5921ea45d (before "
             "it 376f7e1bd8ed543f75014309e3fd4b237e9b0e73; r26.05 to r26.07 at "
             "ca88df0a400515b8206a19eb30cd047eb7661035, facts containers.json), commits the index does not store "
             "either. So every "
             "fact names the commit of the stored file it was read from, and `version` (where present) is the "
             "version file gathered with them; no fact here is read at 1.2.1 itself."),
}


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

    def gitlink(self, path: str) -> str | None:
        """The commit a git source's submodule at `path` points to, or None where there is none."""
        out = subprocess.run(["git", "--git-dir", str(_git_dir(self.root)), "ls-tree", self.commit, path],
                             capture_output=True, text=True, check=True).stdout.split()
        return out[2] if len(out) >= 3 and out[1] == "commit" else None

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
        if self.repository == "NVIDIA/TensorRT-LLM":
            out["pinned_release"] = dict(PINNED_TRTLLM_RELEASE)
        return out


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path
