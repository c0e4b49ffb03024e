"""The engine path's converted LoRA adapters, written by the `convert` stage beside the checkpoint.

`engines/<name>/lora/` holds one digit-named directory per adapter, its LoRA task id (`lora/<task_id>/`
model.lora_weights.npy + model.lora_config.npy, whole and unsharded, as NVIDIA/TensorRT-LLM
`examples/hf_lora_convert.py` writes them), and `adapters.json` (name -> task id). The directory is the tensorrt_llm
model's `lora_prefetch_dir`: the C++ PeftCacheManager `prefetchLoraWeights` loads every sub-folder whose name is all
digits as that task id (tensorrtllm_backend docs/lora.md: "you must name the folder by digit because the lora cache
manager will view these name as lora task ids").

The directory has its own manifest, keyed by the adapters' files, their task ids and the storage dtype, and is
written into a temporary directory renamed into place, as every stage's output is. A spec without adapters writes
nothing here, so its checkpoint and manifest are exactly what they were.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from toolchain.checkpoint.layout import Plan
from toolchain.checkpoint.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, STORAGE_DTYPES, convert_adapter, module_dims
from toolchain.checkpoint.lora_setup import lora_setup, setup_problems
from toolchain.errors import ToolchainError
from toolchain.fingerprint import input_hash
from toolchain.fsutil import atomic_dir
from toolchain.manifest import Manifest, reusable
from toolchain.spec import DeploymentSpec
from toolchain.workspace import Workspace

STAGE = "convert-lora"
ADAPTERS_FILE = "adapters.json"
# Bump when what is written for the same adapters changes.
LORA_CONVERTER_VERSION = 1


def lora_refusal(spec: DeploymentSpec, plan: Plan) -> None:
    """Refuse, before anything is written, a LoRA spec this base cannot serve on the engine path: a MoE or MLA
    family (only the dense Llama-style modules are mapped), a bfloat16 checkpoint (tensorrt_llm's config.pbtxt
    declares lora_weights TYPE_FP16 while the runtime wants the engine dtype, and np.save has no bfloat16), or
    adapters that do not fit the base (lora_setup.setup_problems)."""
    if not spec.lora.enabled:
        return
    p = plan.params
    if p.is_moe or p.mla is not None:
        kind = "mixture-of-experts" if p.is_moe else "multi-head latent attention"
        raise ToolchainError(f"lora: {p.architecture} is a {kind} family; LoRA is served for dense Llama-style "
                             "families only", "remove the lora section or use a dense base model")
    dtype = plan.config.get("dtype")
    if dtype not in STORAGE_DTYPES:
        raise ToolchainError(f"lora: a {dtype} engine cannot take LoRA on the engine path (tensorrt_llm's "
                             "lora_weights input is TYPE_FP16 and the runtime wants the engine dtype)",
                             "set model.dtype to float16 (or float32), or serve the adapters on the LLM-API path")
    setup = lora_setup(spec.lora)
    assert setup is not None  # enabled
    dims = module_dims(p.hidden_size, p.intermediate_size, p.num_attention_heads, p.num_key_value_heads, p.head_size)
    problems = setup_problems(setup, dims, p.num_hidden_layers, plan.options.tp)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ToolchainError(problems[0] + more, "fix the lora section of the spec (`toolchain plan SPEC` lists all)")


def lora_settings(spec: DeploymentSpec, dtype: str) -> dict:
    return {"converter": LORA_CONVERTER_VERSION, "dtype": dtype,
            "adapters": {name: spec.lora.task_id(name) for name in spec.lora.adapters}}


def run_convert_lora(spec: DeploymentSpec, workspace: Workspace, dtype: str, force: bool = False,
                     keep_edits: bool = False, echo: Callable[[str], None] | None = None) -> Manifest | None:
    """Convert spec.lora.adapters into workspace.lora_dir(spec) in the checkpoint's `dtype`; reused while current.
    None (and nothing written) when the spec names no adapters."""
    if not spec.lora.adapters:
        return None
    if dtype not in STORAGE_DTYPES:  # lora_refusal says it first when convert plans; this guards other callers
        raise ToolchainError(f"lora: a {dtype} engine cannot take LoRA on the engine path",
                             "set model.dtype to float16 (or float32)")
    final = workspace.lora_dir(spec)
    settings = lora_settings(spec, dtype)
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    inputs = {f"{name}/{file}": input_hash(Path(path) / file)
              for name, path in spec.lora.adapters.items() for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
              if (Path(path) / file).is_file()}
    wanted = Manifest(stage=STAGE, spec_hash=hashlib.sha256(blob.encode()).hexdigest(), inputs=inputs)
    say = echo or (lambda _msg: None)
    if not force and (have := reusable(final, wanted, redo="converting the LoRA adapters again",
                                       keep_edits=keep_edits, say=say)) is not None:
        return have
    start = time.monotonic()
    with atomic_dir(final) as tmp:
        files = {}
        for name, path in spec.lora.adapters.items():
            task_id = spec.lora.task_id(name)
            convert_adapter(Path(path), tmp / str(task_id), dtype)
            files[name] = {"task_id": task_id, "source": str(Path(path).resolve())}
        (tmp / ADAPTERS_FILE).write_text(json.dumps({"adapters": settings["adapters"], "dtype": dtype}, indent=2)
                                         + "\n")
        wanted.outputs = {"dtype": dtype, "adapters": files}
        wanted.seconds = round(time.monotonic() - start, 3)
        wanted.write(tmp)
    say(f"converted {len(files)} LoRA adapter(s) into {final}")
    return wanted
