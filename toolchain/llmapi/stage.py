"""The convert stage of the LLM-API path: what the PyTorch backend is pointed at.

There is no engine and no TensorRT-LLM checkpoint on this path. Unquantized,
the Hugging Face checkpoint is served as it is: convert checks that it can be
split as the spec asks and records it. Quantized, convert writes the Hugging
Face-format checkpoint the PyTorch backend loads pre-quantized (ModelOpt's
`export_hf_checkpoint` layout) into engines/<name>/checkpoint. Either way the
stage's manifest names the directory (`outputs.model_dir`) that model.yaml and
the trtllm-serve config pass as `model`.

On target llmapi-cpu convert also prepares the CPU engine that stands in for
LLM() on those arguments (engines/<name>/cpu-llm), once: the Triton llmapi
model and the OpenAI server of the deployment load it from there
(toolchain/llmapi/cpu_llm.py, $TOOLCHAIN_CPU_LLM_DIR).
"""

from __future__ import annotations

import hashlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from toolchain.archs import get_family
from toolchain.archs.layout import layout_problems, splits_tp
from toolchain.errors import ToolchainError
from toolchain.fingerprint import input_hash
from toolchain.fsutil import atomic_dir
from toolchain.llmapi.args import llm_args
from toolchain.llmapi.cpu_llm import LlmArgsError, prepare_engine
from toolchain.manifest import Manifest, reusable
from toolchain.spec import DeploymentSpec
from toolchain.targets import CPU_STAND_IN, target_of
from toolchain.weights_source import source_record
from toolchain.workspace import Workspace
from toolchain.plan.model import load_model
from toolchain.quant.recipe import ModelShape, check_pytorch_per_group, check_tiles
from toolchain.quant.view import Quantization, quantization_of

STAGE = "convert"
FORMAT_VERSION = 1  # bump when what this stage writes changes for the same inputs


def _settings(spec: DeploymentSpec) -> dict:
    return {"path": "llmapi", "format": FORMAT_VERSION, "target": spec.target, "dtype": spec.model.dtype,
            "quantization": spec.quantization.model_dump(mode="json") if Quantization.of(spec.quantization).active
            else None}


def _check_layout(spec: DeploymentSpec) -> None:
    """The split the PyTorch backend does at load time must exist (heads, KV heads, MLP, layers)."""

    model = load_model(spec.model.checkpoint)
    params = model.params
    # LLM() is given no embedding split (llmapi/args.py): the PyTorch backend's own is not the spec's to check
    layout = dataclasses.replace(spec.parallelism.layout, parallel_embedding=False)
    tp, pp = layout.tp, layout.pp
    problems = layout_problems(params, layout)
    for axis, text in problems:
        if axis == "attention_dp":
            raise ToolchainError(text, "remove parallelism.attention_dp")
    if problems:
        raise ToolchainError(f"tp={tp} x pp={pp} cannot split {spec.model.checkpoint} "
                             f"({params.num_attention_heads} heads, {params.num_key_value_heads} KV heads, "
                             f"{params.num_hidden_layers} layers)", "`toolchain plan` names a split that works")
    quant = quantization_of(spec.quantization, model.hf_config, hf_quant_config=model.hf_quant_config)
    shape = ModelShape.of(params, get_family(params.architecture))
    if quant.per_group:  # written here or stored so: the PyTorch backend splits it as it loads
        check_pytorch_per_group(shape, quant.weight_group_size, tp, lambda t: splits_tp(params, layout, t))
    check_tiles(quant, shape, tp, lambda t: splits_tp(params, layout, t))  # FP8 block scales' fused grids, likewise


def served_model_dir(spec: DeploymentSpec, workspace: Workspace) -> Path:
    """The directory passed as `model` to LLM(): the converted one when quantized, else the source."""
    if Quantization.of(spec.quantization).active:
        return Path(workspace.checkpoint_dir(spec)).resolve()
    return Path(spec.model.checkpoint).resolve()


def run_convert_llmapi(spec: DeploymentSpec, workspace: Workspace, force: bool = False,
                       echo: Callable[[str], None] | None = None, keep_edits: bool = False) -> Manifest:
    say = echo or (lambda _msg: None)
    manifest = _convert(spec, workspace, force, say, keep_edits)
    if target_of(spec).llm_runtime == CPU_STAND_IN:
        work = workspace.cpu_llm_dir(spec)
        say(f"preparing the CPU engine LLM() loads in {work}")
        try:
            prepare_engine(llm_args(spec, served_model_dir(spec, workspace)), work)
        except LlmArgsError as err:
            raise ToolchainError(str(err), "fix the spec so LLM() accepts its arguments") from None
    return manifest


def _convert(spec: DeploymentSpec, workspace: Workspace, force: bool, say: Callable[[str], None],
             keep_edits: bool) -> Manifest:
    source = Path(spec.model.checkpoint)
    if not (source / "config.json").is_file():
        raise ToolchainError(f"no config.json in {source}", "set model.checkpoint to a Hugging Face checkpoint directory")
    _check_layout(spec)
    inputs = {p.name: input_hash(p) for p in sorted(source.iterdir())
              if p.is_file() and (p.suffix in (".json", ".safetensors") or p.name.endswith(".model"))}
    blob = json.dumps(_settings(spec), sort_keys=True, separators=(",", ":"))
    wanted = Manifest(stage=STAGE, spec_hash=hashlib.sha256(blob.encode()).hexdigest(), inputs=inputs)
    final = workspace.checkpoint_dir(spec)
    if not force and (have := reusable(final, wanted, redo="converting again", keep_edits=keep_edits,
                                       say=say)) is not None:
        say(f"{final} is current; reusing it (--force rebuilds)")
        return have
    start = time.monotonic()
    with atomic_dir(final) as tmp:
        if Quantization.of(spec.quantization).active:
            from toolchain.checkpoint.hf_quant import export_hf_quantized

            say(f"quantizing {source} ({spec.quantization.method}, KV {spec.quantization.kv_cache}) "
                "into the Hugging Face format")
            wanted.outputs = export_hf_quantized(source, tmp, spec.quantization, spec.model.dtype,
                                                 tokenizer_dir=spec.model.tokenizer_dir)
        else:
            wanted.outputs = {"format": "hf", "quantized": False}
        wanted.outputs["model_dir"] = str(served_model_dir(spec, workspace))
        wanted.outputs["source"] = source_record(spec)
        wanted.seconds = round(time.monotonic() - start, 3)
        wanted.write(tmp)
    return wanted
