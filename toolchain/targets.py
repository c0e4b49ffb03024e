"""The deployment targets, one row each: what a spec's `target` means for every stage.

A stage never compares target names; it reads the row of the spec's target (`target_of(spec)`) for what
varies with it: which path the spec takes (TensorRT-LLM engines built by trtllm-build and served by the
tensorrtllm backend, or the LLM API's `LLM()` on the PyTorch backend, with no engine build), the device it
runs on (GPUs elsewhere, or this host's CPU engine standing in for them), and how its ranks may be launched.
`toolchain/pipeline.py` maps the path to its stages. A new target is a row here plus what its path lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Protocol

# The spec's `target` values: a new target is its name here and its row below (tests/test_targets.py holds
# the two together).
TargetName = Literal["cpu", "trtllm", "llmapi", "llmapi-cpu"]
Path = Literal["engine", "llmapi"]
Device = Literal["gpu", "cpu"]
ENGINE: Final = "engine"
LLMAPI: Final = "llmapi"
GPU: Final = "gpu"
CPU: Final = "cpu"


@dataclass(frozen=True)
class Target:
    name: str
    path: Path
    """engine: convert to a TensorRT-LLM checkpoint, build an engine, serve it with the tensorrtllm backend;
    llmapi: hand the HF checkpoint (or its HF-format quantized export) to `LLM()`, no engine build."""
    device: Device
    """gpu: the artefacts and commands are for a GPU host (TensorRT-LLM 1.2.1); cpu: the CPU engine runs them
    here, behind the same repository layout and endpoints."""
    launches: tuple[str, ...]
    """serving.launch values the target accepts; () when the runtime starts its own rank workers."""
    default_launch: str | None
    """serving.launch when the spec leaves it unset."""
    doc: str

    @property
    def builds_engine(self) -> bool:
        return self.path == ENGINE

    @property
    def llmapi_path(self) -> bool:
        return self.path == LLMAPI

    @property
    def on_cpu(self) -> bool:
        return self.device == CPU

    @property
    def on_gpu(self) -> bool:
        return self.device == GPU


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("cpu", ENGINE, CPU, ("single", "mpirun"), "single",
           "the engine repository with the CPU engine standing in for the TensorRT-LLM engine"),
    Target("trtllm", ENGINE, GPU, ("mpirun",), "mpirun",
           "trtllm-build engines and the tensorrtllm backend (TensorRT-LLM 1.2.1)"),
    Target("llmapi", LLMAPI, GPU, (), None,
           "the LLM-API path (PyTorch backend, no engine build): Triton's llmapi model and trtllm-serve"),
    Target("llmapi-cpu", LLMAPI, CPU, (), None,
           "the LLM-API path's repository and OpenAI server on the CPU engine"),
)}


class _NamesTarget(Protocol):
    """A DeploymentSpec, as far as this table reads it (spec.py imports this module, not the reverse)."""

    @property
    def target(self) -> str: ...


def target_of(spec: _NamesTarget) -> Target:
    """The row of `spec.target` (the spec's Literal admits only these names)."""
    return TARGETS[spec.target]


def named(path: str, device: str) -> str:
    """The target of a path on a device, e.g. for messages that name the one to switch to."""
    return next(t.name for t in TARGETS.values() if t.path == path and t.device == device)
