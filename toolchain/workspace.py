"""Where each stage's output lives, for one spec.

Outputs are generated under a root directory (the current directory unless
`--root` says otherwise): engines/<name>/checkpoint, engines/<name>/engine,
model_repo/<name> and reports/<name>.

Every path handed out stays inside the root: the spec's name cannot hold a
separator or `..` (its pattern in spec.py), and a symlink on the way (engines/,
model_repo/, reports/ themselves or <name> below them) that leads outside the
root is refused before any stage writes, because a stage replaces its output
directory wholesale and would otherwise write, or delete, somewhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec


@dataclass(frozen=True)
class Workspace:
    root: Path

    def engine_root(self, spec: DeploymentSpec) -> Path:
        return self._inside(self.root / "engines" / spec.name)

    def checkpoint_dir(self, spec: DeploymentSpec) -> Path:
        """The TensorRT-LLM checkpoint written by `convert`."""
        return self._inside(self.engine_root(spec) / "checkpoint")

    def draft_checkpoint_dir(self, spec: DeploymentSpec) -> Path:
        """draft_target: the draft model's TensorRT-LLM checkpoint (tp 1) written by `convert`."""
        return self._inside(self.engine_root(spec) / "draft-checkpoint")

    def cpu_llm_dir(self, spec: DeploymentSpec) -> Path:
        """target llmapi-cpu: the CPU engine `convert` prepares for LLM()'s stand-in, which the Triton
        llmapi model and the OpenAI server load rather than each converting the checkpoint again."""
        return self._inside(self.engine_root(spec) / "cpu-llm")

    def lora_dir(self, spec: DeploymentSpec) -> Path:
        """The converted LoRA adapters `convert` writes for lora.adapters (lora/<task_id>/ and adapters.json): the
        tensorrt_llm model's lora_prefetch_dir."""
        return self._inside(self.engine_root(spec) / "lora")

    def engine_dir(self, spec: DeploymentSpec) -> Path:
        """The engine written by `build-engine` (trtllm-build output or the CPU engine)."""
        return self._inside(self.engine_root(spec) / "engine")

    def model_repo_dir(self, spec: DeploymentSpec) -> Path:
        return self._inside(self.root / "model_repo" / spec.name)

    def report_dir(self, spec: DeploymentSpec) -> Path:
        return self._inside(self.root / "reports" / spec.name)

    def _inside(self, path: Path) -> Path:
        """`path` itself, once it is known to resolve inside the root (existing symlinks followed;
        the parts not there yet are taken as written, and the spec name pattern keeps `..` out)."""
        root = Path(os.path.realpath(self.root))
        real = Path(os.path.realpath(path))
        if real == root or root in real.parents:
            return path
        link = _first_link(self.root, path)
        where = f"{link} is a symlink to {os.readlink(link)}" if link else f"{path} resolves to {real}"
        raise ToolchainError(f"{where}, outside the workspace root {root}; refusing to write there",
                             "remove the link, or pass --root to put the workspace where the outputs should go")


def _first_link(root: Path, path: Path) -> Path | None:
    """The first component of `path` below `root` that resolves outside the root (a symlink, as
    its parent resolves inside), for the error; None when there is none to name."""
    real_root = Path(os.path.realpath(root))
    current = Path(root)
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        return None
    for part in parts:
        current = current / part
        real = Path(os.path.realpath(current))
        if real != real_root and real_root not in real.parents:
            return current if current.is_symlink() else None
    return None
