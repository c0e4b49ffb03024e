"""The `convert` stage: spec -> engines/<name>/checkpoint with a manifest.

All checks (spec, config.json, parallelism, tensor names, headers) run before
the output directory is touched, and the data is written into a temporary
directory renamed into place only when complete, so a failure leaves nothing
behind that could be mistaken for a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from toolchain.checkpoint.convert import calibrate, convert_checkpoint, plan_any, plan_checkpoint
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.checkpoint.layout import Plan
from toolchain.checkpoint.lora_stage import lora_refusal, run_convert_lora
from toolchain.checkpoint.eagle import attach_draft
from toolchain.checkpoint.medusa import attach_heads, medusa_tree
from toolchain.draft_tree import choices_text
from toolchain.checkpoint.writer import write_plan
from toolchain.errors import ToolchainError
from toolchain.fingerprint import input_hash
from toolchain.fsutil import atomic_dir
from toolchain.gpus import lookup
from toolchain.manifest import Manifest, reusable
from toolchain.quant.view import Quantization
from toolchain.spec import DeploymentSpec
from toolchain.speculative import DRAFT_ENGINE, mode_of, target_draft_layers
from toolchain.weights_source import source_record
from toolchain.targets import ENGINE, require_target
from toolchain.workspace import Workspace

# Bump when the converter's output changes for the same inputs, so old
# checkpoints are rebuilt rather than reused.
CONVERTER_VERSION = 1


def convert_settings(spec: DeploymentSpec) -> dict:
    """The spec fields that change what convert writes."""
    return {"converter": CONVERTER_VERSION, "target": spec.target, "dtype": spec.model.dtype,
            "tp": spec.parallelism.tp, "pp": spec.parallelism.pp,
            "use_parallel_embedding": spec.parallelism.parallel_embedding,
            "embedding_sharding_dim": spec.parallelism.embedding_sharding_dim,
            **_moe_settings(spec),
            "quantization": _quant_settings(spec), **_speculative_settings(spec)}


def _moe_settings(spec: DeploymentSpec) -> dict:
    """Expert parallelism, recorded only where set, so dense models' manifests stay as they were."""
    par = spec.parallelism
    return {k: v for k, v in (("moe_tp", par.moe_tp), ("moe_ep", par.moe_ep)) if v is not None}


# The modes whose networks convert puts in the checkpoint (their row's adds: checkpoint), each with its module's
# attach function and the key convert's manifest records speculative.heads under.
_ATTACH = {"medusa": (attach_heads, "heads"), "eagle": (attach_draft, "draft")}


def mtp_layers(spec: DeploymentSpec) -> int:
    """The model's own MTP layers convert keeps (checkpoint/mtp.py), as the mode's row says."""
    return target_draft_layers(spec.speculative.mode)


def _speculative_settings(spec: DeploymentSpec) -> dict:
    """Medusa heads, an EAGLE draft or the model's MTP layers change the checkpoint; other modes do not."""
    sp = spec.speculative
    if mtp_layers(spec):
        return {sp.mode: {"layers": mtp_layers(spec)}}
    if sp.mode not in _ATTACH:
        return {}
    _attach, heads_key = _ATTACH[sp.mode]
    return {sp.mode: {heads_key: str(sp.heads), "choices": sp.choices, "max_draft_len": sp.max_draft_len}}


def _quant_settings(spec: DeploymentSpec) -> dict:
    return spec.quantization.model_dump(mode="json")


def target_gpu(spec: DeploymentSpec) -> tuple[str | None, int | None] | None:
    """(name, SM) of the GPU the spec names, for the format checks (FP8 needs SM 89+)."""
    gpu = spec.gpu
    name, sm = gpu.name, gpu.sm
    if name and sm is None:
        try:
            sm = lookup(name).sm
        except ToolchainError:  # an unknown name is the planner's `gpu.known` check to report
            sm = None
    return (name, sm) if (name or sm) else None


def convert_hash(spec: DeploymentSpec) -> str:
    blob = json.dumps(convert_settings(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _outputs(spec: DeploymentSpec, plan: Plan, files: dict[str, int]) -> dict:
    out = {"world_size": plan.options.world_size, "tp": plan.options.tp, "pp": plan.options.pp,
           "dtype": plan.options.dtype, "architecture": plan.config["architecture"],
           "bytes": sum(files.values()), "files": files, "dropped_hf_tensors": plan.dropped}
    if plan.medusa is not None:
        # The draft tree the heads were attached for (speculative.choices, else the one recorded with the
        # heads), recorded so that model-repo renders it from here rather than reading the heads again.
        out["medusa_choices"] = choices_text(medusa_tree(spec, plan.medusa))
    return out


def _plan_options(spec: DeploymentSpec, loaded_by: str | None = None) -> dict:
    par = spec.parallelism
    return {"tp": par.tp, "pp": par.pp, "dtype": spec.model.dtype, "target": spec.target, "path": loaded_by,
            "use_parallel_embedding": par.parallel_embedding, "embedding_sharding_dim": par.embedding_sharding_dim,
            "quantization": Quantization.of(spec.quantization), "gpu": target_gpu(spec), "moe_tp": par.moe_tp,
            "moe_ep": par.moe_ep, "mtp_layers": mtp_layers(spec)}


def plan_convert(spec: DeploymentSpec) -> Plan:
    """What `run_convert` would write (per rank names, shapes, bytes); reads no
    weights, and needs none: a directory with config.json alone is planned from it."""
    return _with_heads(plan_any(spec.model.checkpoint, **_plan_options(spec)), spec)


def _with_heads(plan: Plan, spec: DeploymentSpec) -> Plan:
    if spec.speculative.mode in _ATTACH:
        attach, _heads_key = _ATTACH[spec.speculative.mode]
        attach(plan, spec)
    return plan


def run_convert(spec: DeploymentSpec, workspace: Workspace, force: bool = False,
                echo: Callable[[str], None] | None = None, keep_edits: bool = False,
                notes: Callable[[str], None] | None = None, loaded_by: str | None = None) -> Manifest:
    """Convert spec.model.checkpoint into workspace.checkpoint_dir(spec); reuse
    a current output unless `force` (one whose files changed since only with
    `keep_edits`). Returns the manifest of what is there. `echo` hears every
    line; `notes` (default `echo`) the lines about changed files, which
    build-engine passes on while it keeps the others to itself. `loaded_by`: the path whose runtime loads the
    checkpoint (plan_checkpoint's `path`), where it is not the target's: CpuLLM's llmapi.
    The engine path's convert; toolchain/pipeline.py gives each path its own."""
    require_target(spec, f"target {spec.target} has no TensorRT-LLM checkpoint (the LLM-API path serves the HF checkpoint)",
            "run `toolchain convert SPEC`, which takes the spec's path", path=ENGINE)
    say = echo or (lambda _msg: None)
    note = notes or say
    final = workspace.checkpoint_dir(spec)
    ckpt = HFCheckpoint(spec.model.checkpoint)
    with ckpt:
        # Planning validates config, parallelism, names and headers before any write.
        plan = _with_heads(plan_checkpoint(ckpt.directory, **_plan_options(spec, loaded_by), ckpt=ckpt), spec)
        lora_refusal(spec, plan)
        inputs = {p.name: input_hash(p) for p in ckpt.input_files}
        hf_quant = ckpt.directory / "hf_quant_config.json"
        if hf_quant.is_file():  # a ModelOpt HF-format export: its format (algo, group size, exclusions) is read here
            inputs[hf_quant.name] = input_hash(hf_quant)
        if plan.medusa is not None:
            for name in ("medusa_lm_head.safetensors", "config.json"):
                inputs[f"medusa_heads/{name}"] = input_hash(plan.medusa.directory / name)
        if plan.eagle is not None:
            draft_dir = plan.eagle[0].directory
            for path in sorted(p for p in draft_dir.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"):
                inputs[f"eagle_draft/{path.name}"] = input_hash(path)
        if plan.quant is not None and plan.quant.quantization.needs_calibration \
                and plan.quant.quantization.calibration_dataset != "builtin":
            inputs["calibration"] = input_hash(Path(plan.quant.quantization.calibration_dataset))
        wanted = Manifest(stage="convert", spec_hash=convert_hash(spec), inputs=inputs)
        if not force and (have := reusable(final, wanted, redo="converting again", keep_edits=keep_edits,
                                           say=note)) is not None:
            say(f"checkpoint {final} is current (same settings and inputs); reusing it (--force rebuilds)")
            run_convert_draft(spec, workspace, force=force, keep_edits=keep_edits, echo=note)
            run_convert_lora(spec, workspace, plan.config["dtype"], force=force, keep_edits=keep_edits, echo=note)
            return have
        created = _missing_dirs(final.parent, workspace.root)
        start = time.monotonic()
        try:
            with atomic_dir(final) as tmp:
                calibrate(plan, ckpt.directory, tokenizer_dir=spec.model.tokenizer_dir, echo=say,
                          trust_remote_code=spec.model.trust_remote_code)
                files = write_plan(plan, ckpt, tmp)
                (tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
                wanted.outputs = {**_outputs(spec, plan, files), "source": source_record(spec)}
                wanted.seconds = round(time.monotonic() - start, 3)
                wanted.write(tmp)
        except BaseException:
            for directory in created:  # innermost first; only what this run created
                try:
                    directory.rmdir()
                except OSError:
                    break
            raise
    run_convert_draft(spec, workspace, force=force, keep_edits=keep_edits, echo=note)
    run_convert_lora(spec, workspace, plan.config["dtype"], force=force, keep_edits=keep_edits, echo=note)
    return wanted


DRAFT_STAGE = "convert-draft"


def draft_settings(spec: DeploymentSpec) -> dict:
    """What the draft's checkpoint is converted with: the draft as upstream deploys it, its own
    checkpoint at tp 1 in the target's dtype, unquantized."""
    return {"converter": CONVERTER_VERSION, "target": spec.target, "dtype": spec.model.dtype, "tp": 1, "pp": 1}


def run_convert_draft(spec: DeploymentSpec, workspace: Workspace, force: bool = False, keep_edits: bool = False,
                      echo: Callable[[str], None] | None = None) -> Manifest | None:
    """draft_target: convert speculative.draft_model into workspace.draft_checkpoint_dir(spec),
    with its own manifest (settings and the draft's files), which build-engine records as its input;
    reused while current. None for the other modes."""
    if mode_of(spec.speculative.mode).adds != DRAFT_ENGINE:
        return None
    draft = spec.speculative.draft_model
    if draft is None:  # `toolchain plan` checks this, but convert may run without it
        raise ToolchainError("speculative.mode draft_target needs speculative.draft_model",
                             "set speculative.draft_model to the draft's HF checkpoint directory")
    final = workspace.draft_checkpoint_dir(spec)
    blob = json.dumps(draft_settings(spec), sort_keys=True, separators=(",", ":"))
    inputs = {p.name: input_hash(p) for p in sorted(Path(draft).glob("*"))
              if p.is_file() and p.suffix in (".json", ".safetensors")}
    wanted = Manifest(stage=DRAFT_STAGE, spec_hash=hashlib.sha256(blob.encode()).hexdigest(), inputs=inputs)
    if not force and (have := reusable(final, wanted, redo="converting the draft again", keep_edits=keep_edits,
                                       say=echo or (lambda _msg: None))) is not None:
        return have
    start = time.monotonic()
    with atomic_dir(final) as tmp:
        config = convert_checkpoint(draft, tmp, tp=1, pp=1, dtype=spec.model.dtype, target=spec.target)
        files = {p.name: p.stat().st_size for p in sorted(tmp.glob("rank*.safetensors"))}
        wanted.outputs = {"world_size": 1, "tp": 1, "pp": 1, "dtype": config["dtype"],
                          "architecture": config["architecture"], "bytes": sum(files.values()), "files": files,
                          "source": str(Path(draft).resolve())}
        wanted.seconds = round(time.monotonic() - start, 3)
        wanted.write(tmp)
    return wanted


def _missing_dirs(directory: Path, root: Path) -> list[Path]:
    """`directory` and its ancestors below `root` that do not exist yet, innermost first."""
    out = []
    directory, root = Path(directory), Path(root)
    while not directory.exists() and directory != root and directory != directory.parent:
        out.append(directory)
        directory = directory.parent
    return out
