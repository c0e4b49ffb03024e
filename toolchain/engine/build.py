"""The build-engine stage.

Target `cpu`: the "engine" is the converted checkpoint plus an engine
`config.json` shaped like trtllm-build's output (`pretrained_config` +
`build_config`), so the CPU engine reads exactly what a GPU engine directory
describes; `write_cpu_engine` lays that directory out, for this stage, `eval`
and the benchmarks alike. Target `trtllm`: runs a trtllm-build of the 1.2 line
(found on PATH or at build.trtllm_build) with the flags of `engine/trtllm.py`,
under mpirun with one log per rank when there are several ranks and mpirun is
present, then checks the engine's config.json against the spec. draft_target
also builds the draft model (converted by the convert stage into
`Workspace.draft_checkpoint_dir`) into engine/draft/engine. Either way the
output is written to a temporary directory, renamed into place when complete,
and reused while its manifest matches: the build settings (`build_settings`,
not the whole spec, so a changed SLO, port or workload reuses the engine), the
checkpoints' manifests and the TensorRT-LLM version, and while its files are
those the build wrote (a truncated rank file builds again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from toolchain.archs.params import trained_positions
from toolchain.engine import trtllm
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir
from toolchain.manifest import Manifest, content_hash, reusable
from toolchain.spec import DeploymentSpec
from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.targets import CPU_ENGINE, TRTLLM_BUILD, target_of
from toolchain.workspace import Workspace

ENGINE_FORMAT_VERSION = "toolchain-cpu-2"  # 2: plugin_config.tokens_per_block


def build_config(spec: DeploymentSpec) -> dict:
    """The build limits, under the names trtllm-build writes into its config.json."""
    lim = spec.limits
    return {
        "max_batch_size": lim.max_batch_size,
        "max_input_len": lim.max_input_len,
        "max_seq_len": lim.max_seq_len,
        "max_num_tokens": lim.max_num_tokens,
        "max_beam_width": spec.build.max_beam_width,
        "kv_cache_type": "PAGED",
        # As trtllm-build records it (--gather_context_logits): the executor returns context logits only then.
        "gather_context_logits": spec.build.gather_context_logits,
        # As trtllm-build records them: the most draft tokens a request may bring (0: none).
        "max_draft_len": spec.speculative.max_draft_len if spec.speculative.mode != "none" else 0,
        "plugin_config": {"remove_input_padding": True, "paged_kv_cache": True,
                          "use_paged_context_fmha": spec.build.use_paged_context_fmha,
                          "tokens_per_block": spec.build.tokens_per_block},
    }


def _limit_warnings(spec: DeploymentSpec, pretrained: dict) -> list[str]:
    max_pos = pretrained.get("max_position_embeddings")
    if not max_pos:
        return []
    trained = trained_positions(max_pos, pretrained.get("rotary_scaling"))
    # trtllm-build only warns here (TensorRT-LLM tensorrt_llm/builder.py): RoPE extrapolates,
    # quality degrades.
    if spec.limits.max_seq_len > trained:
        return [f"limits.max_seq_len ({spec.limits.max_seq_len}) exceeds the model's trained positions "
                f"({trained}); quality past that length is not guaranteed"]
    return []


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # other filesystem, or links not allowed
        shutil.copy2(src, dst)


def write_cpu_engine(checkpoint_dir: Path, out: Path, build: dict, *, version: str = ENGINE_FORMAT_VERSION) -> dict:
    """Lay out a CPU engine directory in `out` (existing, empty) over the TensorRT-LLM checkpoint in
    `checkpoint_dir`: its rank files hard-linked (or copied) and an engine config.json with the
    checkpoint's config as `pretrained_config` and `build` as `build_config`, as trtllm-build writes
    them. Returns {"ranks", "bytes", "pretrained"}."""
    pretrained = json.loads((checkpoint_dir / "config.json").read_text())
    ranks = sorted(checkpoint_dir.glob("rank*.safetensors"))
    world = pretrained["mapping"]["world_size"]
    if len(ranks) != world:
        raise ToolchainError(f"checkpoint {checkpoint_dir} has {len(ranks)} rank files, config says {world}",
                             "rerun `toolchain convert --force`")
    for rank_file in ranks:
        _link_or_copy(rank_file, out / rank_file.name)
    if pretrained.get("max_draft_len") and not build.get("max_draft_len"):
        # trtllm-build takes max_draft_len 0 from a Medusa/EAGLE checkpoint (tensorrt_llm/commands/build.py).
        build = {**build, "max_draft_len": pretrained["max_draft_len"]}
    engine_config = {"version": version, "target": "cpu", "pretrained_config": pretrained, "build_config": build}
    (out / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
    return {"ranks": len(ranks), "bytes": sum(p.stat().st_size for p in ranks), "pretrained": pretrained}


def draft_build_config(spec: DeploymentSpec) -> dict:
    """The draft as upstream deploys it: its own engine at tp 1, same limits, no drafts of its own, and
    generation logits gathered as trtllm-build --gather_generation_logits records them when the BLS
    may send them on (the tensorrt_llm model refuses return_generation_logits otherwise)."""
    return {**build_config(spec), "max_draft_len": 0, "gather_generation_logits": spec.speculative.use_draft_logits}


def with_lora(build: dict, spec: DeploymentSpec, checkpoint_dir: Path) -> dict:
    """`build` plus what trtllm-build records for LoRA (`lora_config`, `plugin_config.lora_plugin` = the engine dtype)
    when the spec serves adapters; `build` unchanged otherwise."""
    # Imported here: lora_setup reads the adapters' files, which `plan` never needs.
    from toolchain.checkpoint.lora_setup import lora_setup
    from toolchain.engine.cpu.lora import lora_build_config

    setup = lora_setup(spec.lora)
    if setup is None:
        return build
    dtype = json.loads((checkpoint_dir / "config.json").read_text())["dtype"]
    return {**build, "lora_config": lora_build_config(setup.target_modules, setup.max_lora_rank),
            "plugin_config": {**build["plugin_config"], "lora_plugin": dtype}}


def lora_inputs(spec: DeploymentSpec) -> dict:
    """The engine's LoRA settings as a build input (empty without LoRA, so other engines keep their digests)."""
    from toolchain.checkpoint.lora_setup import lora_setup

    setup = lora_setup(spec.lora)
    if setup is None:
        return {}
    return {"lora": {"max_lora_rank": setup.max_lora_rank, "target_modules": list(setup.target_modules)}}


def _cpu_engine_outputs(spec: DeploymentSpec, checkpoint_dir: Path, out: Path, build: dict) -> dict:
    written = write_cpu_engine(checkpoint_dir, out, build)
    return {"ranks": written["ranks"], "bytes": written["bytes"],
            "warnings": _limit_warnings(spec, written["pretrained"])}


def _build_cpu(spec: DeploymentSpec, workspace: Workspace, out: Path) -> dict:
    checkpoint_dir = workspace.checkpoint_dir(spec)
    outputs = _cpu_engine_outputs(spec, checkpoint_dir, out, with_lora(build_config(spec), spec, checkpoint_dir))
    if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE:
        engine = out / "draft" / "engine"
        engine.mkdir(parents=True)
        outputs["draft"] = _cpu_engine_outputs(spec, _draft_checkpoint(spec, workspace), engine,
                                               draft_build_config(spec))
    return outputs


def planned_commands(spec: DeploymentSpec, workspace: Workspace) -> list[list[str]]:
    """The command lines `run_build` would run for target trtllm (the draft's second for
    draft_target), with the final output directories: what --dry-run and plan print."""
    engine = workspace.engine_dir(spec)
    jobs = [(False, workspace.checkpoint_dir(spec), engine, spec.parallelism.world_size)]
    if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE:
        jobs.append((True, workspace.draft_checkpoint_dir(spec), engine / "draft" / "engine", 1))
    out = []
    for draft, ckpt, dest, world in jobs:
        mpi = trtllm.planned_mpi(spec, world)
        cmd = trtllm.build_command(spec, ckpt, dest, str(spec.build.trtllm_build or "trtllm-build"), draft=draft,
                                   workers=1 if mpi else None)
        out.append(trtllm.mpi_command(cmd, world, dest / "logs", spec.gpu.hostfile) if mpi else cmd)
    return out


def _tail_error(log_dir: Path) -> str:
    """The last line of the build logs that reads like an error, for the one-line message."""
    for log in sorted(log_dir.glob("*.log")):
        for line in reversed(log.read_text(errors="replace").splitlines()):
            if any(word in line for word in ("Error", "error", "assert", "Traceback")):
                return f": {line.strip()[:200]}"
    return ""


def _trtllm_build(spec: DeploymentSpec, binary: str, checkpoint_dir: Path, out: Path, final: Path, *,
                  draft: bool = False) -> dict:
    """One trtllm-build run into `out` with logs under out/logs (one per rank under MPI)."""
    world = 1 if draft else spec.parallelism.world_size
    mpi = trtllm.use_mpi(spec, world)
    cmd = trtllm.build_command(spec, checkpoint_dir, out, binary, draft=draft, workers=1 if mpi else None)
    logs = out / "logs"
    logs.mkdir(parents=True)
    run = trtllm.mpi_command(cmd, world, logs, spec.gpu.hostfile) if mpi else cmd
    with open(logs / ("mpirun.log" if mpi else "build.log"), "w") as fh:
        fh.write("$ " + shlex.join(run) + "\n")
        fh.flush()
        proc = subprocess.run(run, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        kept = final.parent / ("draft-build-logs.failed" if draft else "build-logs.failed")
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(logs, kept)
        raise ToolchainError(f"trtllm-build{' (draft)' if draft else ''} failed with exit status "
                             f"{proc.returncode}{_tail_error(logs)}", f"logs in {kept}")
    problems = trtllm.check_engine(spec, out, draft=draft, checkpoint_dir=checkpoint_dir)
    if problems:
        raise ToolchainError(f"the engine trtllm-build wrote disagrees with the spec: {'; '.join(problems)}",
                             f"see {logs}; rerun with --force after fixing the build host")
    display = trtllm.build_command(spec, checkpoint_dir, final, "trtllm-build", draft=draft,
                                   workers=1 if mpi else None)
    return {"ranks": world, "command": shlex.join(display), "mpi": mpi,
            "logs": sorted(p.name for p in logs.iterdir())}


def _draft_checkpoint(spec: DeploymentSpec, workspace: Workspace) -> Path:
    """draft_target: the draft's checkpoint the convert stage wrote (tp 1)."""
    ckpt = workspace.draft_checkpoint_dir(spec)
    if not (ckpt / "config.json").is_file():
        raise ToolchainError(f"no converted draft checkpoint at {ckpt}", f"run `toolchain convert {spec.source or 'SPEC'}`")
    return ckpt


def _run_trtllm_build(spec: DeploymentSpec, workspace: Workspace, out: Path, final: Path, binary: str) -> dict:
    outputs = _trtllm_build(spec, binary, workspace.checkpoint_dir(spec), out, final)
    if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE:
        # The draft at tp 1 into out/draft/engine, from the draft checkpoint convert wrote.
        (out / "draft").mkdir()
        outputs["draft"] = _trtllm_build(spec, binary, _draft_checkpoint(spec, workspace), out / "draft" / "engine",
                                         final / "draft" / "engine", draft=True)
    return outputs


def build_settings(spec: DeploymentSpec) -> dict:
    """The spec fields the build reads, and only those: the engine's limits, the build section,
    the parallelism, the dtype, the quantization, the speculative settings that reach the engine, and
    the MPI hosts and ranks per node trtllm-build runs under (gpu.hostfile, gpu.per_node). Serving,
    validation (workload and SLO), ports and names are left out: changing them reuses the engine."""
    sp = spec.speculative
    return {"target": spec.target, "dtype": spec.model.dtype,
            "parallelism": spec.parallelism.model_dump(mode="json"),
            "limits": spec.limits.model_dump(mode="json"), "build": spec.build.model_dump(mode="json"),
            "quantization": spec.quantization.model_dump(mode="json"),
            "speculative": {"mode": sp.mode, "max_draft_len": sp.max_draft_len,
                            "use_draft_logits": sp.use_draft_logits},
            "mpi_hosts": {"hostfile": str(spec.gpu.hostfile) if spec.gpu.hostfile else None,
                          "per_node": spec.gpu.per_node}}


def build_hash(spec: DeploymentSpec) -> str:
    blob = json.dumps(build_settings(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def run_build(spec: DeploymentSpec, workspace: Workspace, force: bool = False,
              converted: bool = False, keep_edits: bool = False,
              echo: Callable[[str], None] | None = None) -> tuple[Manifest, bool]:
    """Build the engine for `spec`; returns (manifest, reused). Converts first
    unless the caller just did (`converted`, as `deploy` does). An engine whose
    files changed since it was built is built again (`echo` says which file),
    or kept with `keep_edits`."""
    builder = target_of(spec).engine_builder
    if builder is None:
        raise ToolchainError(f"target {spec.target} has no engine to build: the PyTorch backend loads the checkpoint "
                             "when the server starts", "run `toolchain model-repo SPEC` next")
    if not converted:
        # Imported here: the converter pulls in torch, which `plan` (a build-command
        # preview that must answer in well under two seconds) never needs.
        from toolchain.checkpoint.stage import run_convert

        run_convert(spec, workspace, force=False, keep_edits=keep_edits, notes=echo)  # hashed below as an input
    checkpoint_dir = workspace.checkpoint_dir(spec)
    final = workspace.engine_dir(spec)
    inputs = {"checkpoint": content_hash(checkpoint_dir), "target": spec.target}
    if builder == CPU_ENGINE:
        inputs["format"] = ENGINE_FORMAT_VERSION
        inputs.update(lora_inputs(spec))
    binary = None
    if builder == TRTLLM_BUILD:
        # Found (and its version checked) first: without it nothing can be built, and
        # an engine from another TensorRT-LLM version must not count as current.
        binary = trtllm.find_trtllm_build(spec, trtllm.build_command(spec, checkpoint_dir, final))
        inputs["tensorrt_llm"] = trtllm.installed_version(Path(binary)) or "unknown"

    if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE:
        inputs["draft_checkpoint"] = content_hash(workspace.draft_checkpoint_dir(spec))
    wanted = Manifest(stage="build-engine", spec_hash=build_hash(spec), inputs=inputs)
    if not force and (have := reusable(final, wanted, redo="building again", keep_edits=keep_edits,
                                       say=echo or (lambda _msg: None))) is not None:
        return have, True
    start = time.perf_counter()
    with atomic_dir(final) as out:
        if builder == CPU_ENGINE:
            wanted.outputs = _build_cpu(spec, workspace, out)
        else:
            assert binary is not None  # found above: the builder is trtllm-build
            wanted.outputs = _run_trtllm_build(spec, workspace, out, final, binary)
        wanted.seconds = round(time.perf_counter() - start, 3)
        wanted.write(out)
    return wanted, False

