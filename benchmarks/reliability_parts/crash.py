"""Part (d) of benchmarks/reliability.py: crash safety of the stages.

`toolchain convert`, `build-engine` and `model-repo` killed with SIGKILL at random points: the final
directory is never a partial one (absent, or the previous complete output), a planted temp directory is
never taken for the output, and the rerun is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from reliability_parts.common import REPO, SPEC, load_default_spec, log
from toolchain.manifest import Manifest

STAGES = ("convert", "build-engine", "model-repo")


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256, manifests without their time fields; hidden entries (temp dirs) left out."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        data = p.read_bytes()
        if p.name == "manifest.json":
            m = json.loads(data)
            m.pop("created", None)
            m.pop("seconds", None)
            data = json.dumps(m, sort_keys=True).encode()
        out[rel.as_posix()] = hashlib.sha256(data).hexdigest()
    return out


class StageCli:
    """`toolchain --root ROOT STAGE spec.yaml` for the embedded default, in a root of its own under `tmp`."""

    def __init__(self, tmp: Path):
        self.root = tmp / "crash"
        self.root.mkdir(parents=True)
        self.spec_path = self.root / "spec.yaml"
        text = SPEC.read_text().replace("../models/tiny-llama", str(REPO / "models" / "tiny-llama"))
        self.spec_path.write_text(text)
        spec = load_default_spec()
        engines = self.root / "engines" / spec.name
        self.outs = {"convert": engines / "checkpoint", "build-engine": engines / "engine",
                     "model-repo": self.root / "model_repo" / spec.name}
        self.exe = str(Path(sys.executable).parent / "toolchain")

    def cmd(self, stage: str, force: bool) -> list[str]:
        return [self.exe, "--root", str(self.root), stage, str(self.spec_path)] + (["--force"] if force else [])

    def run(self, stage: str, force: bool = False) -> float:
        """Run `stage` to the end; its seconds. A failure is the benchmark's error."""
        t = time.monotonic()
        p = subprocess.run(self.cmd(stage, force), capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{stage} failed: {p.stderr[-800:]}")
        return time.monotonic() - t

    def kill_after(self, stage: str, force: bool, seconds: float) -> None:
        """Start `stage` and SIGKILL its process group after `seconds`."""
        proc = subprocess.Popen(self.cmd(stage, force), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def plant_bogus(final: Path, k: int) -> Path:
    """Every fourth kill: a temp directory beside `final` that looks complete but is wrong (one file garbage)."""
    bogus = final.parent / f".{final.name}.tmp-planted{k}"
    if k % 4 == 1 and final.exists():
        shutil.copytree(final, bogus, symlinks=True)
        for f in sorted(bogus.rglob("*")):
            if f.is_file() and f.name != "manifest.json":
                f.write_bytes(b"garbage")
                break
    return bogus


def kill_and_rerun(cli: StageCli, stage: str, k: int, seconds: float, ref: dict, per: dict, results: dict) -> None:
    """Kill `k` of `stage` after `seconds`: classify what is left, rerun, compare with the reference `ref`."""
    final = cli.outs[stage]
    force = k % 3 != 2
    if k % 3 == 2 and final.exists():  # a run from nothing (the upstream stages complete)
        shutil.rmtree(final)
    # a planted temp directory that looks complete but is wrong: it must never be taken as the output
    bogus = plant_bogus(final, k)
    cli.kill_after(stage, force, seconds)
    per["kills"] += 1
    results["kills"] += 1
    if not final.exists():
        per["absent"] += 1
    elif Manifest.read(final) is None or tree_digest(final) != ref:
        per["partial"] += 1
        results["problems"].append(f"{stage} kill {k}: {final} present but not the complete output")
    else:
        per["complete"] += 1
    cli.run(stage, force=False)  # the rerun must finish what was interrupted, reusing only complete outputs
    got = tree_digest(final)
    if got != ref:
        per["mismatch"] += 1
        diff = sorted(set(got.items()) ^ set(ref.items()))[:3]
        results["problems"].append(f"{stage} kill {k}: rerun differs: {diff}")
    if bogus.exists():
        if os.path.samefile(bogus, final):
            results["tmp_read_as_output"] += 1
        shutil.rmtree(bogus)
    # downstream stages must also still rebuild to the reference


def part_d(kills_per_stage: int, tmp: Path, seed: int = 0, stages: tuple[str, ...] = STAGES) -> dict:
    """`kills_per_stage` kills of each of `stages` at random points, each followed by a rerun."""
    cli = StageCli(tmp)
    durations = {}
    for stage in stages:  # the uninterrupted run, in the same root (paths in the outputs must agree)
        durations[stage] = cli.run(stage, force=True)
    ref = {stage: tree_digest(cli.outs[stage]) for stage in stages}
    rng = random.Random(seed)
    results = {"kills": 0, "rerun_mismatches": 0, "partial_outputs_used": 0, "tmp_read_as_output": 0,
               "final_absent_after_kill": 0, "final_previous_after_kill": 0, "leftover_tmp_dirs": 0,
               "uninterrupted_s": {k: round(v, 2) for k, v in durations.items()}, "per_stage": {}, "problems": []}
    for stage in stages:
        final = cli.outs[stage]
        per = {"kills": 0, "absent": 0, "complete": 0, "partial": 0, "mismatch": 0}
        for k in range(kills_per_stage):
            kill_and_rerun(cli, stage, k, rng.uniform(0.0, durations[stage] * 1.05), ref[stage], per, results)
        leftovers = [p.name for p in final.parent.iterdir() if p.name.startswith(f".{final.name}.")]
        per["leftover_tmp_dirs"] = len(leftovers)
        results["leftover_tmp_dirs"] += len(leftovers)
        results["per_stage"][stage] = per
        results["rerun_mismatches"] += per["mismatch"]
        results["partial_outputs_used"] += per["partial"]
        results["final_absent_after_kill"] += per["absent"]
        results["final_previous_after_kill"] += per["complete"]
        log(f"  (d) {stage}: {per}")
    results["partial_outputs_used"] += results["tmp_read_as_output"]
    return results
