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

from toolchain.errors import ToolchainError

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
class Builder:
    """What builds a target's engine (the engine path only), and what the repository and checks read of it."""

    name: str
    rank_files: str
    """The glob of the per-rank engine files it writes."""
    beams: bool
    """It builds beam search (build.max_beam_width); otherwise the engine decodes one beam."""
    python_model: bool
    """Its engine runs as a Triton Python model (tensorrt_llm/1/model.py from toolchain/triton/backend_models),
    not on tensorrtllm_backend's C++ backend, whose parameters it then does not take."""


# NVIDIA's trtllm-build (tensorrt_llm/commands/build.py) writes rank{N}.engine, served by the tensorrtllm backend;
# this toolchain's CPU engine (toolchain/engine/cpu) writes rank{N}.safetensors and runs as a Python model.
TRTLLM_BUILD: Final = Builder("trtllm-build", "rank*.engine", beams=True, python_model=False)
CPU_ENGINE: Final = Builder("cpu-engine", "rank*.safetensors", beams=True, python_model=True)
# What runs `LLM()` on the LLM-API path: TensorRT-LLM's own (tensorrt_llm/llmapi/llm.py, behind upstream's Triton
# llmapi model.py and trtllm-serve), or this checkout's CPU stand-in (toolchain/llmapi/cpu_llm.py) on the CPU engine.
LlmRuntime = Literal["tensorrt_llm", "cpu-stand-in"]
TENSORRT_LLM: Final = "tensorrt_llm"
CPU_STAND_IN: Final = "cpu-stand-in"
# How a target is launched on a GPU host, and which Slurm and Kubernetes manifests it gets (toolchain/pipeline.py
# maps each to its printer and writer): tensorrtllm_backend's Triton under mpirun, or the LLM API's trtllm-serve
# and Triton llmapi model. The CPU targets run on this host and have neither.
Launcher = Literal["triton-mpirun", "llmapi-serve"]
TRITON_MPIRUN: Final = "triton-mpirun"
LLMAPI_SERVE: Final = "llmapi-serve"


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
    engine_builder: Builder | None = None
    """What builds the engine (engine path); None on the LLM-API path, which builds none."""
    narrows_float32: bool = False
    """dtype "auto" on a float32 checkpoint becomes float16, as TensorRT-LLM's `infer_dtype`
    (tensorrt_llm/models/convert_utils.py) does for the GPU engines trtllm-build builds."""
    compute_dtype: str | None = None
    """The dtype the runtime computes and caches in whatever the weights are; None: the weights' own. The CPU
    engine computes in float32 (toolchain/engine/cpu/kv_cache.py)."""
    llm_runtime: LlmRuntime | None = None
    """What runs LLM() (LLM-API path); None on the engine path, whose `engine_builder` says what runs."""
    gpu_launch: Launcher | None = None
    """How `serve --print` launches it on a GPU host, and the kind of Slurm and Kubernetes manifests
    `--manifests` writes; None: it runs on this host (`toolchain serve`)."""
    binds_ranks: bool = True
    """mpirun binds each rank to a core (Open MPI's default); False: its ranks run unbound (`--bind-to none`, and
    `--oversubscribe` where serving.oversubscribe asks), as a CPU engine rank's server, stubs and gloo threads
    would otherwise share one core (toolchain/triton/launch.py)."""
    budgets_host_ram: bool = False
    """Where the spec describes no GPU (gpu.name, gpu.memory_gib), the memory plan budgets against this host's
    RAM, which holds the CPU engine's weights and KV cache; otherwise it has no device to budget against."""
    predicts_from_host_profile: bool = False
    """`toolchain plan` predicts its throughput from this host's measured profile (`toolchain probe-host`, per
    serving.engine_threads) rather than from the GPU table's bandwidth and peak figures."""
    replica_fields: tuple[str, ...] = ()
    """The spec fields that run several copies of the deployment, which `toolchain tune` sets to the replicas it
    ranks: serving.replicas (`serve --print` and `--manifests` launch that many of tp x pp GPUs each,
    spec.py ServingSection.replicas) and, where `toolchain dynamo` serves it, dynamo.workers (its aggregated
    workers, DynamoSection.workers); () where serve starts one copy on this host."""

    @property
    def openai_beside_triton(self) -> bool:
        """serve and deploy start the OpenAI server beside tritonserver on this host: the CPU stand-in's LLM-API
        target (on a GPU host trtllm-serve is a command of its own, printed by serve --print)."""
        return self.llm_runtime == CPU_STAND_IN

    @property
    def serves_openai(self) -> bool:
        """Its deployment serves the LLM API's OpenAI server (llmapi.openai_port) too: trtllm-serve on a GPU host,
        the CPU stand-in's beside Triton here."""
        return self.llm_runtime is not None

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
           "the engine repository with the CPU engine standing in for the TensorRT-LLM engine",
           engine_builder=CPU_ENGINE, compute_dtype="float32", binds_ranks=False, budgets_host_ram=True,
           predicts_from_host_profile=True),
    Target("trtllm", ENGINE, GPU, ("mpirun",), "mpirun",
           "trtllm-build engines and the tensorrtllm backend (TensorRT-LLM 1.2.1)",
           engine_builder=TRTLLM_BUILD, narrows_float32=True, gpu_launch=TRITON_MPIRUN,
           replica_fields=("serving.replicas",)),
    Target("llmapi", LLMAPI, GPU, (), None,
           "the LLM-API path (PyTorch backend, no engine build): Triton's llmapi model and trtllm-serve",
           llm_runtime=TENSORRT_LLM, gpu_launch=LLMAPI_SERVE, replica_fields=("serving.replicas", "dynamo.workers")),
    Target("llmapi-cpu", LLMAPI, CPU, (), None,
           "the LLM-API path's repository and OpenAI server on the CPU engine", compute_dtype="float32",
           llm_runtime=CPU_STAND_IN, binds_ranks=False, budgets_host_ram=True, predicts_from_host_profile=True),
)}


class _NamesTarget(Protocol):
    """A DeploymentSpec, as far as this table reads it (spec.py imports this module, not the reverse)."""

    @property
    def target(self) -> str: ...


def engine_row(name: str) -> Target:
    """The row of an engine-path target named outside a spec (the converter's API), or a one-line error."""
    engine = [t.name for t in TARGETS.values() if t.engine_builder is not None]
    if name not in engine:
        raise ToolchainError(f"unknown target '{name}'", f"use one of {', '.join(engine)}")
    return TARGETS[name]


def target_of(spec: _NamesTarget) -> Target:
    """The row of `spec.target` (the spec's Literal admits only these names)."""
    return TARGETS[spec.target]


def require_target(spec: _NamesTarget, refusal: str, fix: str, *, path: str, device: str | None = None) -> Target:
    """The spec's row when its target takes `path` (on `device`, when given); else the one-line refusal of a
    stage the other targets do not take (toolchain/pipeline.py routes each spec to its own; a direct caller,
    or a command of one path only, may not)."""
    row = target_of(spec)
    if row.path != path or device is not None and row.device != device:
        raise ToolchainError(refusal, fix)
    return row


def named(path: str, device: str) -> str:
    """The target of a path on a device, e.g. for messages that name the one to switch to."""
    return next(t.name for t in TARGETS.values() if t.path == path and t.device == device)
