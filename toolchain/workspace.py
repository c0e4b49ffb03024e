"""Where each stage's output lives, for one spec.

Outputs are generated under a root directory (the current directory unless
`--root` says otherwise): engines/<name>/checkpoint, engines/<name>/engine,
model_repo/<name> and reports/<name>.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolchain.spec import DeploymentSpec


@dataclass(frozen=True)
class Workspace:
    root: Path

    def engine_root(self, spec: DeploymentSpec) -> Path:
        return self.root / "engines" / spec.name

    def checkpoint_dir(self, spec: DeploymentSpec) -> Path:
        """The TensorRT-LLM checkpoint written by `convert`."""
        return self.engine_root(spec) / "checkpoint"

    def engine_dir(self, spec: DeploymentSpec) -> Path:
        """The engine written by `build-engine` (trtllm-build output or the CPU engine)."""
        return self.engine_root(spec) / "engine"

    def model_repo_dir(self, spec: DeploymentSpec) -> Path:
        return self.root / "model_repo" / spec.name

    def report_dir(self, spec: DeploymentSpec) -> Path:
        return self.root / "reports" / spec.name
