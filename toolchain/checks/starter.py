"""A starting spec for a Hugging Face model directory (`toolchain init`).

The spec names the model, the target (llmapi on a GPU unless the user names
one or the LLM-API path refuses the spec, then trtllm), the GPU and the weight
format the user chose; limits come from the model's context length; tensor
parallelism is the smallest size whose KV cache holds max_batch_size sequences
of max_seq_len on a GPU, else the smallest the planner says fits (with a
note). Before anything is written the spec is
planned exactly as `toolchain plan` would plan it, so a written spec plans
clean or nothing is written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, get_args

import yaml

from toolchain import gpus
from toolchain.archs import family_for_config
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_file
from toolchain.spec import DeploymentSpec, QuantizationSection, spec_from_dict
from toolchain.checks.preflight import build_context, run_checks
from toolchain.checks.render import report_dict

TARGETS: tuple[str, ...] = get_args(DeploymentSpec.model_fields["target"].annotation)
QUANT_METHODS: tuple[str, ...] = get_args(QuantizationSection.model_fields["method"].annotation)
GPU_TARGETS = ("trtllm", "llmapi")
# Tensor-parallel sizes tried, smallest first, up to one node of `gpu.per_node` (8 by default).
TP_SIZES = (1, 2, 4, 8)
# Starting limits: the CPU engine on a small host wants short sequences; a GPU engine gets the
# model's context up to 8k tokens, with half of it for the prompt.
CPU_LIMITS = {"max_batch_size": 8, "max_seq_len": 1024, "max_num_tokens": 2048}
GPU_LIMITS = {"max_batch_size": 32, "max_seq_len": 8192, "max_num_tokens": 8192}


def default_name(source: str) -> str:
    """A valid spec name from a directory or hub id: 'Qwen/Qwen2.5-0.5B-Instruct' -> 'qwen2.5-0.5b-instruct'."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source.rstrip("/")).name).lower().lstrip("._-")
    return base or "model"


def _choice(kind: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ToolchainError(f"unknown {kind} '{value}'", f"use one of {', '.join(choices)}")
    return value


def resolve_options(target: str | None, gpu: str | None, quant: str) -> tuple[str, str | None, str]:
    """Validated (target, canonical GPU name, quant method); every refusal names the valid choices."""
    gpu_name = None
    if gpu:
        try:
            gpu_name = gpus.lookup(gpu).name
        except ToolchainError:
            raise ToolchainError(f"unknown --gpu '{gpu}'", f"use one of {', '.join(g.name for g in gpus.GPUS)}, "
                                 "or pass the nearest and correct it with gpu.memory_gib and gpu.sm") from None
    # On a GPU the LLM-API path is the advice for new deployments (README, "Which target to choose"): the engine
    # flow ends with the 1.2 line; init falls back to trtllm where that path refuses the spec (fit_parallelism).
    target = _choice("--target", target or ("llmapi" if gpu_name else "cpu"), TARGETS)
    quant = _choice("--quant", quant, QUANT_METHODS)
    table = ", ".join(g.name for g in gpus.GPUS)
    if target in GPU_TARGETS and gpu_name is None:
        raise ToolchainError(f"target {target} runs on GPUs: the plan needs to know which",
                             f"pass --gpu with one of {table}")
    if target not in GPU_TARGETS and gpu_name is not None:
        raise ToolchainError(f"--gpu applies to targets {', '.join(GPU_TARGETS)}; target {target} runs on this "
                             "host's CPU and plans against its RAM", "drop --gpu, or pass --target llmapi")
    return target, gpu_name, quant


def _limits(hf_config: dict, on_cpu: bool) -> dict[str, int]:
    base = CPU_LIMITS if on_cpu else GPU_LIMITS
    context = hf_config.get("max_position_embeddings") or base["max_seq_len"]
    seq = max(2, min(int(context), base["max_seq_len"]))
    return {"max_batch_size": base["max_batch_size"], "max_input_len": seq // 2, "max_seq_len": seq,
            "max_num_tokens": base["max_num_tokens"]}


def spec_data(checkpoint: Path, spec_path: Path, *, name: str, target: str, gpu: str | None, quant: str,
              hf_config: dict) -> dict[str, Any]:
    on_cpu = target not in GPU_TARGETS
    # Relative to the spec file (as load_spec resolves it), so the spec moves with its model.
    rel = os.path.relpath(checkpoint.resolve(), spec_path.parent.resolve())
    data: dict[str, Any] = {
        "name": name, "target": target,
        # The CPU engine computes in float32 (fp16 matmuls are slow on CPUs); GPUs take the HF dtype.
        "model": {"checkpoint": rel, "dtype": "float32" if on_cpu else "auto"},
        "parallelism": {"tp": 1, "pp": 1},
        "limits": _limits(hf_config, on_cpu),
    }
    if gpu:
        data["gpu"] = {"name": gpu}
    if quant != "none":
        data["quantization"] = {"method": quant}
    if target == "llmapi" and _family_runs_without_reuse(hf_config):
        # The llmapi.kv-reuse check refuses block reuse for such a family (Gemma 3); the starting spec asks for
        # what the PyTorch backend can serve rather than one the plan refuses.
        data["build"] = {"kv_cache_reuse": False}
    return data


def _family_runs_without_reuse(hf_config: dict) -> bool:
    try:
        return family_for_config(hf_config).llmapi_no_reuse is not None
    except ToolchainError:  # an unregistered family: the plan says why
        return False


def _plan(data: dict, spec_path: Path):
    """The `toolchain plan` report of the spec `data` would be at `spec_path`."""

    spec = spec_from_dict(data, spec_path.parent.resolve(), str(spec_path))
    context = build_context(spec, "plan")
    return report_dict(context, run_checks(context))


def _fit(data: dict, spec_path: Path, sizes: tuple[int, ...]) -> tuple[int | None, str | None, dict]:
    """(tp, note, the last plan report): on a GPU the smallest size of `sizes` whose plan passes and whose KV cache
    holds limits.max_batch_size sequences of max_seq_len at once; else the smallest whose plan passes, with a
    note saying how many it holds; tp None when none passes. The smallest tp that merely fits can leave the KV
    cache a few sequences wide (Llama-3-70B on two H100s: 2 of 32), so requests queue for it whatever the
    batch limit says; a larger tp adds every GPU's free memory to the cache."""
    first: tuple[int, dict] | None = None
    report: dict = {}
    for tp in sizes:
        data["parallelism"]["tp"] = tp
        report = _plan(data, spec_path)
        if not report["ok"]:
            continue
        batch = data["limits"]["max_batch_size"]
        if data["target"] not in GPU_TARGETS or (report["concurrency"] or 0) >= batch:
            return tp, None, report
        first = first or (tp, report)
    if first is None:
        return None, None, report
    tp, fitting = first
    return tp, (f"tp {tp}: its KV cache holds {fitting['concurrency']} sequences of {fitting['sequence_tokens']} "
                f"tokens, below limits.max_batch_size {data['limits']['max_batch_size']}, and no tp up to "
                f"{sizes[-1]} holds them all; lower limits.max_batch_size or limits.max_seq_len, or quantize "
                "the KV cache (quantization.kv_cache)"), report


def fit_parallelism(data: dict, spec_path: Path, source: str, sizes: tuple[int, ...] = TP_SIZES,
                    fallback: str | None = None) -> tuple[dict, list[str]]:
    """`data` at the tensor-parallel size `_fit` picks, and notes to print; refuses when no size passes, with
    what the plan said at the largest. `fallback`: the target to try when the LLM-API path itself refuses the
    spec at every size (a failed llmapi.* check: a weight format or architecture only the engines run)."""
    notes = []
    tp, note, report = _fit(data, spec_path, sizes)
    refused = [f"{c['id']}: {c['message']}" for c in report.get("checks", [])
               if c["id"] in report["failed_checks"] and c["id"].startswith("llmapi.")]
    if tp is None and fallback and refused:
        notes.append(f"target {fallback}: the LLM-API path refuses this spec ({'; '.join(refused)})")
        data["target"] = fallback
        tp, note, report = _fit(data, spec_path, sizes)
    if tp is None:
        failed = [f"{c['id']}: {c['message']}" for c in report["checks"] if c["id"] in report["failed_checks"]]
        raise ToolchainError(f"no starting spec for {source} passes the plan at tp up to {sizes[-1]}: "
                             + ("; ".join(failed) or report["verdict"]),
                             "try another --quant or --gpu, or --set the fields named")
    data["parallelism"]["tp"] = tp
    return data, notes + ([note] if note else [])


def render(data: dict, source: str, architecture: str, notes: list[str] | None = None) -> str:
    head = (f"# Starting spec written by `toolchain init` from {source} ({architecture}).\n"
            "# It passed `toolchain plan` when written; every field and its default: docs/spec-reference.md\n"
            "# (`toolchain schema` prints the JSON Schema for editors).\n"
            + "".join(f"# note: {n}\n" for n in notes or []))
    return head + yaml.safe_dump(data, sort_keys=False)


def refuse_existing(path: Path, force: bool, alternative: str) -> None:
    if path.exists() and not force:
        raise ToolchainError(f"{path} already exists", f"pass --force to overwrite it, {alternative}")


def write_spec(path: Path, text: str) -> None:
    with atomic_file(path) as fh:
        fh.write(text)
