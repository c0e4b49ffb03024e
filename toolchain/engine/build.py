"""The build-engine stage.

Target `cpu`: the "engine" is the converted checkpoint plus an engine
`config.json` shaped like trtllm-build's output (`pretrained_config` +
`build_config`), so the CPU engine reads exactly what a GPU engine directory
describes. Target `trtllm`: runs a trtllm-build of the 1.2 line (found on PATH
or at build.trtllm_build) with the flags of `engine/trtllm.py`, under mpirun
with one log per rank when there are several ranks and mpirun is present,
then checks the engine's config.json against the spec; draft_target also
converts and builds the draft model into engine/draft/. Either way the output
is written to a temporary directory, renamed into place when complete, and
reused while its manifest (spec, checkpoint, TensorRT-LLM version) matches.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from toolchain.archs.params import trained_positions
from toolchain.engine import trtllm
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir
from toolchain.manifest import Manifest, current_manifest, content_hash
from toolchain.spec import DeploymentSpec
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
        "max_beam_width": 1,
        "kv_cache_type": "PAGED",
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


def _write_cpu_engine(spec: DeploymentSpec, checkpoint_dir: Path, out: Path) -> dict:
    outputs = _cpu_engine_dir(spec, checkpoint_dir, out, build_config(spec))
    if spec.speculative.mode == "draft_target":
        from toolchain.checkpoint.convert import convert_checkpoint

        # The draft as upstream deploys it: its own engine at tp 1, same limits, no drafts of its own, and
        # generation logits gathered as trtllm-build --gather_generation_logits records them when the BLS
        # may send them on (the tensorrt_llm model refuses return_generation_logits otherwise).
        ckpt, engine = out / "draft" / "checkpoint", out / "draft" / "engine"
        ckpt.mkdir(parents=True)
        engine.mkdir()
        convert_checkpoint(_draft_model(spec), ckpt, tp=1, pp=1, dtype=spec.model.dtype, target="cpu")
        draft = {**build_config(spec), "max_draft_len": 0,
                 "gather_generation_logits": spec.speculative.use_draft_logits}
        outputs["draft"] = _cpu_engine_dir(spec, ckpt, engine, draft)
        shutil.rmtree(ckpt)  # the engine's rank file is a hard link (or copy) of the weights
    return outputs


def _cpu_engine_dir(spec: DeploymentSpec, checkpoint_dir: Path, out: Path, build: dict) -> dict:
    pretrained = json.loads((checkpoint_dir / "config.json").read_text())
    ranks = sorted(checkpoint_dir.glob("rank*.safetensors"))
    world = pretrained["mapping"]["world_size"]
    if len(ranks) != world:
        raise ToolchainError(f"checkpoint {checkpoint_dir} has {len(ranks)} rank files, config says {world}",
                             "rerun `toolchain convert --force`")
    for rank_file in ranks:
        _link_or_copy(rank_file, out / rank_file.name)
    if pretrained.get("max_draft_len") and not build["max_draft_len"]:
        # trtllm-build takes max_draft_len 0 from a Medusa/EAGLE checkpoint (tensorrt_llm/commands/build.py).
        build = {**build, "max_draft_len": pretrained["max_draft_len"]}
    engine_config = {"version": ENGINE_FORMAT_VERSION, "target": "cpu",
                     "pretrained_config": pretrained, "build_config": build}
    (out / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
    return {"ranks": len(ranks), "bytes": sum(p.stat().st_size for p in ranks),
            "warnings": _limit_warnings(spec, pretrained)}


def planned_commands(spec: DeploymentSpec, workspace: Workspace) -> list[list[str]]:
    """The command lines `run_build` would run for target trtllm (the draft's second for
    draft_target), with the final output directories: what --dry-run and plan print."""
    engine = workspace.engine_dir(spec)
    jobs = [(False, workspace.checkpoint_dir(spec), engine, spec.parallelism.world_size)]
    if spec.speculative.mode == "draft_target":
        jobs.append((True, engine / "draft" / "checkpoint", engine / "draft" / "engine", 1))
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
    problems = trtllm.check_engine(spec, out, draft=draft)
    if problems:
        raise ToolchainError(f"the engine trtllm-build wrote disagrees with the spec: {'; '.join(problems)}",
                             f"see {logs}; rerun with --force after fixing the build host")
    display = trtllm.build_command(spec, checkpoint_dir, final, "trtllm-build", draft=draft,
                                   workers=1 if mpi else None)
    return {"ranks": world, "command": shlex.join(display), "mpi": mpi,
            "logs": sorted(p.name for p in logs.iterdir())}


def _build_draft(spec: DeploymentSpec, binary: str, out: Path, final: Path) -> dict:
    """draft_target: convert the draft model at tp 1 and build it into out/draft/engine."""
    from toolchain.checkpoint.convert import convert_checkpoint

    ckpt = out / "draft" / "checkpoint"
    ckpt.mkdir(parents=True)
    convert_checkpoint(_draft_model(spec), ckpt, tp=1, pp=1, dtype=spec.model.dtype, target="trtllm")
    engine = out / "draft" / "engine"
    engine.mkdir()
    result = _trtllm_build(spec, binary, ckpt, engine, final / "draft" / "engine", draft=True)
    shutil.rmtree(ckpt)  # the engine holds the weights now
    return result


def _draft_model(spec: DeploymentSpec) -> Path:
    draft = spec.speculative.draft_model
    if draft is None:  # `toolchain plan` checks this, but build may run without it
        raise ToolchainError("speculative.mode draft_target needs speculative.draft_model",
                             "set speculative.draft_model to the draft's HF checkpoint directory")
    return draft


def _run_trtllm_build(spec: DeploymentSpec, checkpoint_dir: Path, out: Path, final: Path, binary: str) -> dict:
    outputs = _trtllm_build(spec, binary, checkpoint_dir, out, final)
    if spec.speculative.mode == "draft_target":
        outputs["draft"] = _build_draft(spec, binary, out, final)
    return outputs


def run_build(spec: DeploymentSpec, workspace: Workspace, force: bool = False,
              converted: bool = False) -> tuple[Manifest, bool]:
    """Build the engine for `spec`; returns (manifest, reused). Converts first
    unless the caller just did (`converted`, as `deploy` does)."""
    if spec.llmapi_path:
        raise ToolchainError(f"target {spec.target} has no engine to build: the PyTorch backend loads the checkpoint "
                             "when the server starts", "run `toolchain model-repo SPEC` next")
    if not converted:
        # Imported here: the converter pulls in torch, which `plan` (a build-command
        # preview that must answer in well under two seconds) never needs.
        from toolchain.checkpoint.stage import run_convert

        run_convert(spec, workspace, force=False)  # the engine's input; its manifest is hashed below
    checkpoint_dir = workspace.checkpoint_dir(spec)
    final = workspace.engine_dir(spec)
    inputs = {"checkpoint": content_hash(checkpoint_dir), "target": spec.target}
    if spec.target == "cpu":
        inputs["format"] = ENGINE_FORMAT_VERSION
    binary = None
    if spec.target == "trtllm":
        # Found (and its version checked) first: without it nothing can be built, and
        # an engine from another TensorRT-LLM version must not count as current.
        binary = trtllm.find_trtllm_build(spec, trtllm.build_command(spec, checkpoint_dir, final))
        inputs["tensorrt_llm"] = trtllm.installed_version(Path(binary)) or "unknown"

    if spec.speculative.mode == "draft_target" and spec.speculative.draft_model is not None:
        inputs["draft_model"] = _config_hash(spec.speculative.draft_model)
    wanted = Manifest(stage="build-engine", spec_hash=spec.spec_hash(), inputs=inputs)
    if not force and (have := current_manifest(final, wanted)) is not None:
        return have, True
    start = time.perf_counter()
    with atomic_dir(final) as out:
        if spec.target == "cpu":
            wanted.outputs = _write_cpu_engine(spec, checkpoint_dir, out)
        else:
            assert binary is not None  # found above: the target is trtllm
            wanted.outputs = _run_trtllm_build(spec, checkpoint_dir, out, final, binary)
        wanted.seconds = round(time.perf_counter() - start, 3)
        wanted.write(out)
    return wanted, False


def _config_hash(hf_dir: Path) -> str:
    """Names, sizes and times of the draft model's files: a changed draft rebuilds."""
    files = sorted(Path(hf_dir).glob("*.json")) + sorted(Path(hf_dir).glob("*.safetensors"))
    return ",".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)
