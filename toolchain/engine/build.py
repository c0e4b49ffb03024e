"""The build-engine stage.

Target `cpu`: the "engine" is the converted checkpoint plus an engine
`config.json` shaped like trtllm-build's output (`pretrained_config` +
`build_config`), so the CPU engine reads exactly what a GPU engine directory
describes. Target `trtllm`: runs `trtllm-build` with the spec's limits.
Either way the output is written to a temporary directory, renamed into place
when complete, and reused while its manifest matches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from toolchain.checkpoint.stage import run_convert
from toolchain.engine import trtllm
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir, sha256_file
from toolchain.manifest import MANIFEST, Manifest, is_current
from toolchain.spec import DeploymentSpec
from toolchain.workspace import Workspace

ENGINE_FORMAT_VERSION = "toolchain-cpu-1"


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
        "plugin_config": {"remove_input_padding": True, "paged_kv_cache": True, "use_paged_context_fmha": True},
    }


def _limit_warnings(spec: DeploymentSpec, pretrained: dict) -> list[str]:
    max_pos = pretrained.get("max_position_embeddings")
    scaling = pretrained.get("rotary_scaling") or {}
    factor = 1.0
    # llama3/longrope already report the long context in max_position_embeddings (§1.3).
    if scaling.get("type") not in (None, "llama3", "longrope", "su"):
        factor = float(scaling.get("factor", 1.0))
    # trtllm-build only warns here (§1.3): RoPE extrapolates, quality degrades.
    if max_pos and spec.limits.max_seq_len > max_pos * factor:
        return [f"limits.max_seq_len ({spec.limits.max_seq_len}) exceeds the model's trained positions "
                f"({int(max_pos * factor)}); quality past that length is not guaranteed"]
    return []


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # other filesystem, or links not allowed
        shutil.copy2(src, dst)


def _write_cpu_engine(spec: DeploymentSpec, checkpoint_dir: Path, out: Path) -> dict:
    pretrained = json.loads((checkpoint_dir / "config.json").read_text())
    ranks = sorted(checkpoint_dir.glob("rank*.safetensors"))
    world = pretrained["mapping"]["world_size"]
    if len(ranks) != world:
        raise ToolchainError(f"checkpoint {checkpoint_dir} has {len(ranks)} rank files, config says {world}",
                             "rerun `toolchain convert --force`")
    for rank_file in ranks:
        _link_or_copy(rank_file, out / rank_file.name)
    engine_config = {"version": ENGINE_FORMAT_VERSION, "target": "cpu",
                     "pretrained_config": pretrained, "build_config": build_config(spec)}
    (out / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
    return {"ranks": len(ranks), "bytes": sum(p.stat().st_size for p in ranks),
            "warnings": _limit_warnings(spec, pretrained)}


def _run_trtllm_build(spec: DeploymentSpec, checkpoint_dir: Path, out: Path, final: Path) -> dict:
    cmd = trtllm.build_command(spec, checkpoint_dir, final)
    binary = trtllm.require_trtllm_build(cmd)
    cmd = [binary, *cmd[1:]]
    cmd[cmd.index("--output_dir") + 1] = str(out)
    log = out / "build.log"
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        keep = final.parent / "build.failed.log"
        shutil.copy2(log, keep)
        raise ToolchainError(f"trtllm-build failed with exit status {proc.returncode}", f"see {keep}")
    return {"ranks": spec.parallelism.world_size, "command": cmd}


def run_build(spec: DeploymentSpec, workspace: Workspace, force: bool = False) -> tuple[Manifest, bool]:
    """Build the engine for `spec`; returns (manifest, reused)."""
    ckpt_manifest = run_convert(spec, workspace, force=False)
    if isinstance(ckpt_manifest, tuple):  # tolerate (manifest, reused) from the convert stage
        ckpt_manifest = ckpt_manifest[0]
    checkpoint_dir = workspace.checkpoint_dir(spec)
    final = workspace.engine_dir(spec)
    wanted = Manifest(
        stage="build-engine",
        spec_hash=spec.spec_hash(),
        inputs={"checkpoint": sha256_file(checkpoint_dir / MANIFEST), "target": spec.target},
    )
    if not force and is_current(final, wanted):
        return Manifest.read(final), True
    start = time.perf_counter()
    with atomic_dir(final) as out:
        if spec.target == "cpu":
            wanted.outputs = _write_cpu_engine(spec, checkpoint_dir, out)
        else:
            wanted.outputs = _run_trtllm_build(spec, checkpoint_dir, out, final)
        wanted.seconds = round(time.perf_counter() - start, 3)
        wanted.write(out)
    return wanted, False
