"""`toolchain eval SPEC --adapter NAME`: the converted model under one of the spec's LoRA adapters against the
Hugging Face model with that adapter merged.

- The reference is PEFT's own arithmetic: the base checkpoint at float32 with the adapter loaded by PEFT's
  `PeftModel`, then `merge_and_unload()` (W + scale * B @ A folded into each weight), or `--reference
  DIR`, an HF checkpoint taken as that merged model (one merged elsewhere, or a full fine-tune to compare with).
- The converted side runs the adapter as each path's server runs it. The engine path (targets cpu and trtllm):
  the adapter `convert` wrote in TensorRT-LLM's format (engines/<name>/lora/<task id>/, the tensorrt_llm model's
  lora_prefetch_dir) put into the engine's LoRA cache as the Triton model puts it, so the files the server would
  load are the ones measured. The LLM-API path (llmapi-cpu): the PEFT directory read by the stand-in's adapter
  loader as a LoRARequest on first use (llmapi/lora.py AdapterLoader, what CpuLLM and the OpenAI server call).
  Either way every forward pass carries the adapter's task id (CpuEngine.forward_logits(ids, lora_task_id)).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolchain.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE
from toolchain.checkpoint.lora_setup import AdapterInfo, lora_setup
from toolchain.errors import ToolchainError
from toolchain.llmapi.lora import AdapterLoader, LoRARequest
from toolchain.spec import DeploymentSpec
from toolchain.targets import CPU_STAND_IN, target_of
from toolchain.workspace import Workspace


@dataclass(frozen=True)
class AdapterEval:
    """What `--adapter NAME [--reference DIR]` asks for, resolved against the spec."""

    info: AdapterInfo
    reference: Path | None = None
    """An HF checkpoint taken as the merged model; None: PEFT merges the adapter into the spec's checkpoint."""

    def describe(self) -> dict:
        a = self.info
        return {"name": a.name, "task_id": a.task_id, "path": str(a.path), "rank": a.rank, "scale": a.scale,
                "modules": list(a.modules),
                "reference": str(self.reference) if self.reference is not None
                else "PEFT merge_and_unload of the adapter into model.checkpoint (float32)"}


def adapter_eval(spec: DeploymentSpec, name: str, reference: Path | None = None) -> AdapterEval:
    """`name` among the spec's lora.adapters, or a one-line refusal naming the ones it has."""
    if not spec.lora.adapters:
        raise ToolchainError(f"--adapter {name}: spec {spec.name} serves no LoRA adapters (its lora.adapters is "
                             "empty)", "name the adapter's PEFT directory under lora.adapters, or drop --adapter")
    if name not in spec.lora.adapters:
        raise ToolchainError(f"--adapter {name}: no LoRA adapter of that name in {spec.name}'s lora.adapters",
                             f"name one of: {', '.join(spec.lora.adapters)}")
    setup = lora_setup(spec.lora)
    assert setup is not None  # adapters are named
    if reference is not None and not (Path(reference) / "config.json").is_file():
        raise ToolchainError(f"--reference {reference} is not a Hugging Face checkpoint (no config.json)",
                             "pass the directory of the merged model (save_pretrained of merge_and_unload())")
    return AdapterEval(setup.adapter(name), reference)


def load_adapter(engine, spec: DeploymentSpec, workspace: Workspace, chosen: AdapterEval) -> int:
    """Put the adapter in `engine`'s LoRA cache as the spec's server would; its task id."""
    a = chosen.info
    if engine.lora is None:
        raise ToolchainError(f"the engine evaluated for {spec.name} was built without LoRA, so adapter {a.name!r} "
                             "cannot run on it", f"rebuild it from the spec's lora section (toolchain build-engine "
                             f"{spec.source or 'SPEC'} --force)")
    if target_of(spec).llm_runtime == CPU_STAND_IN:  # LLM()'s stand-in reads the PEFT directory itself
        try:
            task = AdapterLoader(engine).task_id(LoRARequest(a.name, a.task_id, str(a.path)))
        except ValueError as err:
            raise ToolchainError(str(err)) from None
        assert task is not None  # a request was given
        return task
    converted = workspace.lora_dir(spec) / str(a.task_id)
    if not (converted / WEIGHTS_FILE).is_file():
        raise ToolchainError(f"adapter {a.name!r} has no converted files in {converted}",
                             f"run toolchain convert {spec.source or 'SPEC'}")
    engine.lora.put(a.task_id, np.load(converted / WEIGHTS_FILE), np.load(converted / CONFIG_FILE))
    return a.task_id
