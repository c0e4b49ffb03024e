"""Typed Triton model configurations, rendered through Triton's own protobuf.

A `ModelConfig` here is a plain dataclass; `to_proto()` fills
`tritonclient.grpc.model_config_pb2.ModelConfig` (the schema tritonserver
parses) and `render()` serialises it with `google.protobuf.text_format` and
parses the text back, so a file we write is one Triton can read. Nothing is
substituted into text: a value that is missing, empty or still looks like a
`${placeholder}` is refused before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from toolchain.errors import ToolchainError

DTYPES = frozenset(name for name in pb.DataType.keys() if name != "TYPE_INVALID")
KINDS = frozenset(pb.ModelInstanceGroup.Kind.keys())


class ConfigError(ToolchainError):
    """A model configuration that cannot be rendered as given."""


@dataclass(frozen=True)
class Tensor:
    """One input or output. `dims` exclude the batch dimension (Triton adds it
    when max_batch_size > 0); `reshape=()` makes a `[1]` input arrive as a scalar
    per batch row (`reshape: { shape: [ ] }`)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    ragged: bool = False


@dataclass(frozen=True)
class InstanceGroup:
    count: int
    kind: str = "KIND_CPU"


@dataclass(frozen=True)
class DynamicBatching:
    """`dynamic_batching {}` when every field is left at its default."""

    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_microseconds: int | None = None
    max_queue_size: int | None = None


@dataclass(frozen=True)
class EnsembleStep:
    model_name: str
    input_map: dict[str, str]  # step model input -> ensemble tensor
    output_map: dict[str, str]  # step model output -> ensemble tensor
    model_version: int = -1


@dataclass
class ModelConfig:
    name: str
    max_batch_size: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    backend: str | None = None
    platform: str | None = None
    instance_group: list[InstanceGroup] = field(default_factory=list)
    dynamic_batching: DynamicBatching | None = None
    decoupled: bool | None = None  # None: no model_transaction_policy block
    parameters: dict[str, object] = field(default_factory=dict)
    ensemble_steps: list[EnsembleStep] = field(default_factory=list)

    def input(self, name: str) -> Tensor:
        return _by_name(self.inputs, name, f"input of '{self.name}'")

    def output(self, name: str) -> Tensor:
        return _by_name(self.outputs, name, f"output of '{self.name}'")

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        where = f"model '{self.name}'"
        _need_text(self.name, f"{where}: name")
        if (self.backend is None) == (self.platform is None):
            raise ConfigError(f"{where}: exactly one of backend or platform must be set")
        _need_text(self.backend or self.platform, f"{where}: backend/platform")
        if not isinstance(self.max_batch_size, int) or isinstance(self.max_batch_size, bool) or self.max_batch_size < 0:
            raise ConfigError(f"{where}: max_batch_size must be an integer >= 0, got {self.max_batch_size!r}")
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            seen = set()
            for t in tensors:
                _need_text(t.name, f"{where}: {kind} name")
                if t.name in seen:
                    raise ConfigError(f"{where}: {kind} '{t.name}' declared twice")
                seen.add(t.name)
                if t.dtype not in DTYPES:
                    raise ConfigError(f"{where}: {kind} '{t.name}' has data type {t.dtype!r}",
                                      f"use one of {', '.join(sorted(DTYPES))}")
                if not t.dims or any(not isinstance(d, int) or d == 0 or d < -1 for d in t.dims):
                    raise ConfigError(f"{where}: {kind} '{t.name}' has invalid dims {t.dims!r}")
        for group in self.instance_group:
            if group.kind not in KINDS or not isinstance(group.count, int) or group.count < 1:
                raise ConfigError(f"{where}: invalid instance group {group!r}")
        for key, value in self.parameters.items():
            _need_text(key, f"{where}: parameter name")
            if value is EMPTY:  # a key the backend must find, meaning "off" (e.g. guided decoding)
                continue
            _need_text(_param_text(value), f"{where}: parameter '{key}'")
        if self.platform == "ensemble" and not self.ensemble_steps:
            raise ConfigError(f"{where}: an ensemble needs at least one step")
        for step in self.ensemble_steps:
            _need_text(step.model_name, f"{where}: ensemble step model name")
            for k, v in (*step.input_map.items(), *step.output_map.items()):
                _need_text(k, f"{where}: step '{step.model_name}' map key")
                _need_text(v, f"{where}: step '{step.model_name}' map value for '{k}'")

    # ---- protobuf ---------------------------------------------------------------------------------------------
    def to_proto(self) -> pb.ModelConfig:
        self.validate()
        cfg = pb.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        if self.backend is not None:
            cfg.backend = self.backend
        if self.platform is not None:
            cfg.platform = self.platform
        for t in self.inputs:
            item = cfg.input.add(name=t.name, data_type=pb.DataType.Value(t.dtype), dims=list(t.dims),
                                 optional=t.optional, allow_ragged_batch=t.ragged)
            if t.reshape is not None:
                item.reshape.SetInParent()  # an empty shape is meaningful: "scalar per row"
                item.reshape.shape.extend(t.reshape)
        for t in self.outputs:
            item = cfg.output.add(name=t.name, data_type=pb.DataType.Value(t.dtype), dims=list(t.dims))
            if t.reshape is not None:
                item.reshape.SetInParent()
                item.reshape.shape.extend(t.reshape)
        for group in self.instance_group:
            cfg.instance_group.add(count=group.count, kind=pb.ModelInstanceGroup.Kind.Value(group.kind))
        if self.dynamic_batching is not None:
            db = self.dynamic_batching
            cfg.dynamic_batching.SetInParent()
            cfg.dynamic_batching.preferred_batch_size.extend(db.preferred_batch_size)
            if db.max_queue_delay_microseconds is not None:
                cfg.dynamic_batching.max_queue_delay_microseconds = db.max_queue_delay_microseconds
            if db.max_queue_size is not None:
                cfg.dynamic_batching.default_queue_policy.max_queue_size = db.max_queue_size
        if self.decoupled is not None:
            cfg.model_transaction_policy.SetInParent()
            cfg.model_transaction_policy.decoupled = self.decoupled
        for key, value in self.parameters.items():
            cfg.parameters[key].string_value = _param_text(value)
        for step in self.ensemble_steps:
            item = cfg.ensemble_scheduling.step.add(model_name=step.model_name, model_version=step.model_version)
            item.input_map.update(step.input_map)
            item.output_map.update(step.output_map)
        return cfg

    def render(self, header: str = "") -> str:
        """config.pbtxt text; parsed back and compared before it is returned."""
        proto = self.to_proto()
        text = text_format.MessageToString(proto)
        if "${" in text:
            raise ConfigError(f"model '{self.name}': rendered config still contains a '${{...}}' placeholder")
        check_text(text, self.name, expected=proto)
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        return comment + text

    def write(self, model_dir: Path, header: str = "") -> Path:
        path = Path(model_dir) / "config.pbtxt"
        path.write_text(self.render(header))
        check_text(path.read_text(), self.name)
        return path


def check_text(text: str, name: str = "?", expected: pb.ModelConfig | None = None) -> pb.ModelConfig:
    """Parse config.pbtxt text as Triton would; raise ConfigError on any mismatch."""
    parsed = pb.ModelConfig()
    try:
        text_format.Parse(text, parsed)
    except text_format.ParseError as err:
        raise ConfigError(f"model '{name}': config.pbtxt does not parse as inference.ModelConfig: {err}") from None
    if expected is not None and parsed != expected:
        raise ConfigError(f"model '{name}': config.pbtxt parses back differently from what was rendered")
    if parsed.name != name and name != "?":
        raise ConfigError(f"model '{name}': config.pbtxt names the model '{parsed.name}'")
    return parsed


def check_ensemble(ensemble: ModelConfig, models: dict[str, ModelConfig]) -> None:
    """Every step names a known model, maps only tensors that model declares, reads
    only tensors that exist by then and covers the model's required inputs; every
    ensemble input is read and every output produced; max_batch_size does not
    exceed any step's (Triton's own rule)."""
    where = f"ensemble '{ensemble.name}'"
    available = {t.name for t in ensemble.inputs}
    read = {v for step in ensemble.ensemble_steps for v in step.input_map.values()}
    unused = [t.name for t in ensemble.inputs if t.name not in read]
    if unused:
        raise ConfigError(f"{where}: input(s) {unused} are read by no step")
    for step in ensemble.ensemble_steps:
        model = models.get(step.model_name)
        if model is None:
            raise ConfigError(f"{where}: step model '{step.model_name}' is not in the repository")
        if ensemble.max_batch_size > model.max_batch_size:
            raise ConfigError(f"{where}: max_batch_size {ensemble.max_batch_size} exceeds "
                              f"'{model.name}' max_batch_size {model.max_batch_size}")
        declared_in = {t.name for t in model.inputs}
        for key, value in step.input_map.items():
            if key not in declared_in:
                raise ConfigError(f"{where}: step '{model.name}' maps unknown input '{key}'")
            if value not in available:
                raise ConfigError(f"{where}: step '{model.name}' input '{key}' reads '{value}', "
                                  "produced by no earlier step")
        missing = [t.name for t in model.inputs if not t.optional and t.name not in step.input_map]
        if missing:
            raise ConfigError(f"{where}: step '{model.name}' leaves required input(s) {missing} unmapped")
        declared_out = {t.name for t in model.outputs}
        for key, value in step.output_map.items():
            if key not in declared_out:
                raise ConfigError(f"{where}: step '{model.name}' maps unknown output '{key}'")
            available.add(value)
    unproduced = [t.name for t in ensemble.outputs if t.name not in available]
    if unproduced:
        raise ConfigError(f"{where}: output(s) {unproduced} are produced by no step")


def _by_name(tensors: list[Tensor], name: str, what: str) -> Tensor:
    for t in tensors:
        if t.name == name:
            return t
    raise KeyError(f"no {what} named '{name}'")


class _Empty:
    def __repr__(self) -> str:
        return "EMPTY"


EMPTY = _Empty()
"""A parameter value rendered as `string_value: ""`: the key is present and empty. The C++
tensorrtllm backend and tensorrtllm_backend's Python models require some keys even when
their feature is off (guided decoding's, multimodal_model_path). A plain "" stays refused,
as an accidentally unset value."""


def _param_text(value: object) -> str | None:
    if value is None:
        return None
    if value is EMPTY:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _need_text(value: str | None, what: str) -> None:
    if value is None or value == "":
        raise ConfigError(f"{what} is unset", "every rendered value must be given explicitly")
    if "${" in value:
        raise ConfigError(f"{what} is an unfilled placeholder: {value!r}", "pass a real value")
