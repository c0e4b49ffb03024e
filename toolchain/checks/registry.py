"""The check registry: what a check is (a stable id, the stages it guards, the paths and devices it applies to
and a function of the `Context` returning (status, message) whose message names the fix), the `@check`
decorator the check modules register with, and the `Context` every check reads, computed once.
`toolchain.checks.preflight` imports every check module and runs them. A check never compares target names:
it declares the paths and devices it applies to, and reads the target's row (`ctx.row`, toolchain/targets.py)
for the rest, so a new target is a row there and no check changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from toolchain.errors import ToolchainError
from toolchain import eos as eos_mod
from toolchain import gpus, targets
from toolchain.archs import Family, get_family
from toolchain.archs.layout import layout_problems
from toolchain.plan.model import ModelInfo, load_model, read_json
from toolchain.plan.plan import DraftModel, MemoryPlan, plan_memory
from toolchain.quant.view import Quantization, quantization_of
from toolchain.speculative import DRAFT_ENGINE, mode_of

if TYPE_CHECKING:
    from toolchain.spec import DeploymentSpec
    from toolchain.workspace import Workspace

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
ENGINE = ("convert", "build-engine")
SERVING = ("model-repo", "serve")
GUARDED = ("convert", "build-engine", "model-repo", "serve", "deploy")
# The two flows a spec can take: engines (targets trtllm, cpu) or the LLM API (llmapi, llmapi-cpu).
ENGINE_PATH, LLMAPI_PATH = (targets.ENGINE,), (targets.LLMAPI,)
BOTH_PATHS = ENGINE_PATH + LLMAPI_PATH
# The devices a target runs on: GPU hosts (TensorRT-LLM itself) or this host's CPU engine standing in for it.
GPU_ONLY, CPU_ONLY = (targets.GPU,), (targets.CPU,)
BOTH_DEVICES = GPU_ONLY + CPU_ONLY
UNREGISTERED = "model config not readable here or not a registered family; the stage reports why"
# Stages that read artefacts of earlier stages without rebuilding them; deploy
# rebuilds first, so a stale engine there is not a finding.
_ARTEFACT_STAGES = ("plan", "model-repo", "serve")


@dataclass(frozen=True)
class CheckResult:
    id: str
    status: str
    message: str

    def as_dict(self) -> dict:
        return {"id": self.id, "status": self.status, "message": self.message}


@dataclass(frozen=True)
class Check:
    id: str
    stages: tuple[str, ...]
    """Stages it guards; () = only `toolchain plan` (the stage enforces the rule itself)."""
    doc: str
    fn: Callable[["Context"], tuple[str, str]]
    paths: tuple[str, ...] = BOTH_PATHS
    """The flows it applies to: an engine-only rule (trtllm-build, the tensorrtllm backend) is no finding
    on the LLM-API path, and the reverse."""
    devices: tuple[str, ...] = BOTH_DEVICES
    """The devices it applies to: a rule of TensorRT-LLM's own engine build or runtime says nothing about the
    CPU engine standing in for it; on another device the check is listed as skipped (`device_skip`)."""
    elsewhere: tuple[str, str] | None = None
    """(status, message) on another device, where that is no skip (a rule the CPU engine meets by design)."""

    def device_skip(self, path: str) -> str:
        """The skip message on a device the check does not apply to: the targets of `path` it applies to."""
        return "applies to target " + " or ".join(targets.named(path, d) for d in self.devices)


REGISTRY: dict[str, Check] = {}


def check(check_id: str, stages: tuple[str, ...], doc: str, paths: tuple[str, ...] = BOTH_PATHS,
          devices: tuple[str, ...] = BOTH_DEVICES, elsewhere: tuple[str, str] | None = None):
    """Register a check function under a stable id."""
    def register(fn):
        if check_id in REGISTRY:
            raise ValueError(f"check id {check_id} registered twice")
        REGISTRY[check_id] = Check(check_id, tuple(stages), doc, fn, tuple(paths), tuple(devices), elsewhere)
        return fn
    return register


@dataclass
class Context:
    """Everything a check reads, computed once."""

    spec: DeploymentSpec
    stage: str
    workspace: Workspace | None
    quant: Quantization
    """The quantization view (quant/view.py), resolved here once with the checkpoint's config."""
    device: gpus.Gpu | None
    model: ModelInfo | None = None
    model_error: str | None = None
    draft: ModelInfo | None = None
    draft_error: str | None = None
    memory: MemoryPlan | None = None
    eos: eos_mod.EosResolution | None = None
    tokenizer: eos_mod.TokenizerInfo | None = None
    _engine_config: dict | None = field(default=None, repr=False)

    @property
    def row(self) -> targets.Target:
        """The spec's target's row (path, device, launches). Named `row`, not `target`, because
        `ctx.spec.target` is the target's name."""
        return targets.target_of(self.spec)

    def family(self) -> tuple[Family, str] | None:
        """The registered family of the spec's model and its architecture; None when its config is unreadable
        here or no family registers it (checks then skip with UNREGISTERED: the stage reports why)."""
        if self.model is None:
            return None
        arch = self.model.params.architecture
        return get_family(arch), arch

    @property
    def artefacts(self) -> bool:
        return self.stage in _ARTEFACT_STAGES and self.workspace is not None

    def engine_dir(self) -> Path | None:
        return Path(self.workspace.engine_dir(self.spec)) if self.workspace is not None else None

    def engine_config(self) -> dict | None:
        """The built engine's config.json when artefacts are checked at this stage and one exists."""
        engine_dir = self.engine_dir()
        if not self.artefacts or engine_dir is None:
            return None
        if self._engine_config is None:
            path = engine_dir / "config.json"
            try:
                self._engine_config = read_json(path) if path.is_file() else None
            except ToolchainError:
                self._engine_config = {"_unreadable": str(path)}
        return self._engine_config


def build_context(spec, stage: str = "plan", workspace=None, quant: Quantization | None = None) -> Context:
    """Load what the checks need. For `plan` a config that cannot be read is an
    error (exit 2); before a stage the model-dependent checks are skipped and the
    stage reports the problem in its own words."""
    ctx = Context(spec, stage, workspace, quant or quantization_of(spec.quantization), gpus.resolve(spec))
    try:
        ctx.model = load_model(spec.model.checkpoint)
    except ToolchainError as err:
        if stage == "plan":
            raise
        ctx.model_error = str(err)
    if quant is None and ctx.model is not None:  # a checkpoint stored quantized plans in its own format
        try:
            ctx.quant = quantization_of(spec.quantization, ctx.model.hf_config,
                                        hf_quant_config=ctx.model.hf_quant_config)
        except ToolchainError as err:  # a stored format convert cannot import, or a request it refuses on one
            if stage == "plan":
                raise
            ctx.model_error = str(err)
    sp = spec.speculative
    if mode_of(sp.mode).adds == DRAFT_ENGINE and sp.draft_model is not None:
        try:
            ctx.draft = load_model(sp.draft_model)
        except ToolchainError as err:
            ctx.draft_error = str(err)
    # only a split convert accepts has a memory plan (archs/layout.py layout_problems)
    if ctx.model is not None and ctx.device is not None and not layout_problems(ctx.model.params, spec.parallelism.layout):
        draft = DraftModel(ctx.draft) if ctx.draft is not None else None
        ctx.memory = plan_memory(spec, ctx.model, ctx.quant, ctx.device, draft)
    ctx.tokenizer = eos_mod.read_tokenizer(spec.model.tokenizer_dir)
    if ctx.model is not None:
        ctx.eos = eos_mod.resolve(ctx.model.hf_config, ctx.model.generation_config, ctx.tokenizer)
    return ctx


def applies(chk: Check, stage: str) -> bool:
    if stage == "plan":
        return True
    if stage == "deploy":
        return bool(chk.stages)
    return stage in chk.stages
