"""The deployment spec: one validated object that flows through every stage.

A spec is a YAML file (`build/<name>.yaml`). Unknown keys are rejected with the
key and the file named; `--set a.b=value` overrides are applied to the raw
mapping before validation, so an override is validated exactly like the file.
Relative paths in the spec are resolved against the spec file's directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toolchain.errors import ToolchainError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelSection(_Section):
    checkpoint: Path = Path("checkpoint")
    """Hugging Face checkpoint directory (config.json + safetensors)."""
    tokenizer: Path | None = None
    """Tokenizer directory; defaults to the checkpoint directory."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weight dtype of the TensorRT-LLM checkpoint; `auto` takes HF `torch_dtype` (fp32 becomes fp16 as upstream does, except on target cpu)."""

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer or self.checkpoint


class ParallelismSection(_Section):
    tp: int = Field(1, ge=1, le=64)
    """Tensor-parallel size: each linear layer is split over this many ranks."""
    pp: int = Field(1, ge=1, le=64)
    """Pipeline-parallel size: the decoder layers are split into this many stages."""
    gpus: int | None = Field(None, ge=1)
    """GPUs available to the deployment; when given, tp x pp must not exceed it."""
    parallel_embedding: bool = False
    """Shard the input embedding over the TP ranks (TRT-LLM `use_parallel_embedding`)."""
    embedding_sharding_dim: Literal[0, 1] = 0
    """With parallel_embedding: 0 splits the vocabulary rows, 1 the hidden columns."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @model_validator(mode="after")
    def _fits_gpus(self) -> "ParallelismSection":
        if self.gpus is not None and self.tp * self.pp > self.gpus:
            raise ValueError(
                f"tp x pp = {self.tp} x {self.pp} = {self.tp * self.pp} ranks but only {self.gpus} GPUs are declared; "
                "lower tp or pp, or raise parallelism.gpus"
            )
        return self


class LimitsSection(_Section):
    max_batch_size: int = Field(8, ge=1)
    """Most requests in flight at once (engine and Triton max_batch_size)."""
    max_input_len: int = Field(512, ge=1)
    """Longest prompt in tokens."""
    max_seq_len: int = Field(1024, ge=2)
    """Longest prompt + generated tokens."""
    max_num_tokens: int = Field(4096, ge=1)
    """Most tokens processed in one engine step (batched prefill budget)."""

    @model_validator(mode="after")
    def _ordered(self) -> "LimitsSection":
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"limits.max_input_len ({self.max_input_len}) must be below limits.max_seq_len ({self.max_seq_len}) "
                "so at least one token can be generated"
            )
        return self


class ServingSection(_Section):
    host: str = "127.0.0.1"
    """Address tritonserver binds its HTTP, gRPC and metrics endpoints to."""
    http_port: int = Field(8000, ge=0, le=65535)
    """HTTP port (0 picks a free one)."""
    grpc_port: int = Field(8001, ge=0, le=65535)
    """gRPC port (0 picks a free one)."""
    metrics_port: int = Field(8002, ge=0, le=65535)
    """Prometheus metrics port (0 picks a free one)."""
    streaming: bool = True
    """Deploy decoupled models so clients can stream tokens."""
    tritonserver: Path | None = None
    """tritonserver binary; default: `tritonserver` on PATH, else the one inside the nvidia-pytriton wheel."""
    startup_timeout_s: float = Field(180.0, gt=0)
    """Seconds to wait for the server to report ready."""
    instance_count: int = Field(1, ge=1)
    """Instances of preprocessing, postprocessing and the BLS."""
    max_queue_delay_microseconds: int = Field(0, ge=0)
    """Dynamic batcher delay in front of the models."""
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, le=1)
    """Share of free GPU memory given to the KV cache (GPU target)."""
    exclude_input_in_output: bool = True
    """Default for responses: return only generated tokens."""
    engine_threads: int = Field(1, ge=1, le=256)
    """torch threads of the CPU engine inside the server (target cpu); small models decode fastest on one."""


class WorkloadSection(_Section):
    num_requests: int = Field(32, ge=1)
    """Measured requests."""
    warmup_requests: int = Field(2, ge=0)
    """Requests sent first and excluded from the report."""
    concurrency: int = Field(4, ge=1)
    """Requests kept outstanding at once (closed loop)."""
    input_tokens: int = Field(64, ge=1)
    """Mean prompt length in tokens."""
    input_tokens_stddev: float = Field(0.0, ge=0)
    """Standard deviation of the prompt length."""
    output_tokens: int = Field(32, ge=1)
    """Requested output tokens (max_tokens)."""
    seed: int = 0
    """Seed for prompt sampling."""
    endpoint: Literal["ensemble", "tensorrt_llm_bls"] = "ensemble"
    """Triton model the bench streams to."""
    ignore_eos: bool = True
    """Send end_id = -1 so every request generates exactly output_tokens tokens."""


class SloSection(_Section):
    ttft_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile time to first token must be at most this."""
    tpot_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile time per output token must be at most this."""
    e2e_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile end-to-end latency must be at most this."""


class ValidationSection(_Section):
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    """The load `toolchain bench` applies."""
    slo: SloSection = Field(default_factory=SloSection)
    """Service-level objectives the report is judged against."""


class DeploymentSpec(_Section):
    name: str = Field("model", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Deployment name: output directories are engines/<name>, model_repo/<name>, reports/<name>."""
    target: Literal["cpu", "trtllm"] = "cpu"
    """`cpu`: the CPU engine under the Triton Python backend; `trtllm`: trtllm-build engines and the tensorrtllm backend."""
    model: ModelSection = Field(default_factory=ModelSection)
    """Source checkpoint and dtype."""
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    """Tensor and pipeline parallelism."""
    limits: LimitsSection = Field(default_factory=LimitsSection)
    """Engine build limits."""
    serving: ServingSection = Field(default_factory=ServingSection)
    """Triton server settings."""
    validation: ValidationSection = Field(default_factory=ValidationSection)
    """Latency workload and SLOs."""

    source: Path | None = Field(None, exclude=True)
    """The file this spec was loaded from (set by the loader)."""

    def spec_hash(self) -> str:
        """Stable hash of every field (paths as resolved), for manifests."""
        data = self.model_dump(mode="json")
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _set_path(data: dict, dotted: str, raw: str, origin: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ToolchainError(f"bad override '{dotted}={raw}'", "write --set section.field=value")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ToolchainError(f"override '{dotted}': '{key}' is not a section in {origin}")
        node = child
    # YAML parsing gives `--set a.b=8` an int, `true` a bool, `null` None.
    node[keys[-1]] = yaml.safe_load(raw) if raw != "" else ""


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ToolchainError(f"bad override '{item}'", "write --set section.field=value, e.g. --set parallelism.tp=2")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _format_validation_error(err: ValidationError, origin: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<top level>"
    if first["type"] == "extra_forbidden":
        return f"unknown key '{loc}' in {origin}; remove it or check its spelling"
    msg = first["msg"].removeprefix("Value error, ")
    return f"invalid '{loc}' in {origin}: {msg}"


def _resolve_paths(spec: DeploymentSpec, base: Path) -> None:
    def resolve(p: Path | None) -> Path | None:
        if p is None:
            return None
        p = Path(p).expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    spec.model.checkpoint = resolve(spec.model.checkpoint)
    spec.model.tokenizer = resolve(spec.model.tokenizer)
    if spec.serving.tritonserver is not None and "/" in str(spec.serving.tritonserver):
        spec.serving.tritonserver = resolve(spec.serving.tritonserver)


def spec_from_dict(data: dict[str, Any], base: Path, origin: str = "<spec>") -> DeploymentSpec:
    try:
        spec = DeploymentSpec.model_validate(data)
    except ValidationError as err:
        raise ToolchainError(_format_validation_error(err, origin)) from None
    _resolve_paths(spec, base)
    return spec


def load_spec(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> DeploymentSpec:
    """Load, override and validate a spec file."""
    path = Path(path)
    if not path.is_file():
        raise ToolchainError(f"spec file not found: {path}", "pass a YAML spec such as build/tiny-llama.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ToolchainError(f"malformed YAML in {path}{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise ToolchainError(f"{path} must hold a mapping of sections (name, model, parallelism, ...)")
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value, str(path))
    spec = spec_from_dict(data, path.parent.resolve(), str(path))
    spec.source = path.resolve()
    return spec
