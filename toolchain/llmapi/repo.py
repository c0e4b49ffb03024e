"""Triton's `llmapi` model repository for the LLM-API path.

One model, `tensorrt_llm` (Python backend), as TensorRT-LLM's
`triton_backend/all_models/llmapi` lays it out:

    tensorrt_llm/config.pbtxt   the upstream tensors (upstream/facts/llmapi.json), rendered through
                                Triton's protobuf
    tensorrt_llm/1/model.yaml   LLM() arguments from the spec, plus triton_config
    tensorrt_llm/1/model.py     target llmapi: upstream's model.py and helpers.py (from --python-models);
                                target llmapi-cpu: the toolchain's CPU stand-in

There is no ensemble and no pre/post-processing: tokenization happens inside LLM().
Upstream's config.pbtxt leaves `max_batch_size` and `decoupled` to model.yaml's
triton_config, which only `auto_complete_config` applies; the launcher
(launch_triton_server.py) and this toolchain's server pass
`--disable-auto-complete-config`, which skips it. Both are therefore written in
config.pbtxt too, with the same values as triton_config.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import yaml

import toolchain
from toolchain import upstream
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir, sha256_file
from toolchain.llmapi.args import model_yaml, serve_config, triton_config
from toolchain.llmapi.launch import SERVE_CONFIG
from toolchain.manifest import Manifest, reusable
from toolchain.spec import DeploymentSpec
from toolchain.targets import CPU_STAND_IN, TENSORRT_LLM, target_of
from toolchain.triton.config import InstanceGroup, ModelConfig, Tensor
from toolchain.workspace import Workspace
from toolchain.llmapi.stage import served_model_dir

# Triton's llmapi Python-backend model (triton_model.py), copied verbatim into the repository as 1/model.py.
TRITON_MODEL = Path(__file__).with_name("triton_model.py")

MODEL = "tensorrt_llm"
UPSTREAM_FILES = ("model.py", "helpers.py")
# Triton's llmapi model of the 1.2 line sends no LoRARequest: model.py's execute() carries "# TODO : [JIRA-4040]
# Verify Lora" and calls generate_async(prompt, SamplingParams(...), streaming) (NVIDIA/TensorRT-LLM
# triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @b35ac1b6, 1.2.0rc2; 1.2.1's UNVERIFIED), and its
# config.pbtxt has no lora input. So a LoRA spec's repository loads the adapters' LLM (model.yaml's lora_config)
# and says in README.md that Triton requests run the base model; trtllm-serve and the OpenAI server pick adapters.
LORA_README = """# LoRA adapters and this repository

This deployment serves LoRA adapters ({names}), but Triton's `llmapi` model of TensorRT-LLM 1.2 has no input that
selects one: its model.py sends no LoRARequest ("TODO : [JIRA-4040] Verify Lora"). Requests through Triton run
the base model. model.yaml still carries `lora_config` / `peft_cache_config`, so the LLM it starts is the one
trtllm-serve runs.

Select an adapter through the OpenAI server instead: trtllm-serve takes a `lora_request` body field
({{"lora_name", "lora_int_id", "lora_path"}}); this toolchain's OpenAI server also takes `"model": "<adapter name>"`
and lists the adapters in /v1/models.
"""
_LAYOUTS = ("", "tensorrt_llm/1", "llmapi/tensorrt_llm/1", "all_models/llmapi/tensorrt_llm/1",
            "triton_backend/all_models/llmapi/tensorrt_llm/1")


def model_config(spec: DeploymentSpec) -> ModelConfig:
    tm = upstream.facts("llmapi")["triton_model"]

    def tensors(entries: dict) -> list[Tensor]:
        return [Tensor(name, e["data_type"], tuple(e["dims"]), optional=bool(e.get("optional")))
                for name, e in entries.items()]

    triton = triton_config(spec)
    params: dict[str, object] = {}
    if target_of(spec).llm_runtime == CPU_STAND_IN:  # the CPU stand-in for LLM() runs from this checkout
        params = {"toolchain_path": str(Path(toolchain.__file__).resolve().parent.parent),
                  "engine_threads": str(spec.serving.engine_threads)}
    return ModelConfig(
        name=MODEL, backend=tm["backend"], max_batch_size=triton["max_batch_size"],
        inputs=tensors(tm["inputs"]), outputs=tensors(tm["outputs"]),
        instance_group=[InstanceGroup(g["count"], g["kind"]) for g in tm["instance_group"]],
        decoupled=triton["decoupled"], parameters=params)


def upstream_model_files(directory: Path | str) -> Path:
    """The directory under `directory` holding upstream's llmapi `model.py` and `helpers.py`."""
    base = Path(directory).expanduser()
    for sub in _LAYOUTS:
        if all((base / sub / name).is_file() for name in UPSTREAM_FILES):
            return (base / sub).resolve()
    raise ToolchainError(f"--python-models {directory}: no llmapi model.py and helpers.py there",
                         "point it at TensorRT-LLM 1.2.1's triton_backend/all_models/llmapi (in a checkout or "
                         "the Triton trtllm container)")


def _renderer_hash(python_models: Path | None) -> str:
    h = hashlib.sha256()
    paths = [Path(__file__), Path(__file__).with_name("args.py"), TRITON_MODEL]
    paths += [python_models / n for n in UPSTREAM_FILES] if python_models else []
    for path in paths:
        h.update(path.name.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()


def run_model_repo_llmapi(spec: DeploymentSpec, workspace: Workspace, force: bool = False,
                          python_models: Path | str | None = None, keep_edits: bool = False,
                          echo: Callable[[str], None] | None = None) -> Manifest:

    started = time.monotonic()
    upstream_dir = upstream_model_files(python_models) if python_models is not None else None
    if target_of(spec).llm_runtime == TENSORRT_LLM and upstream_dir is None:
        raise ToolchainError("target llmapi serves upstream's llmapi model.py, which this toolchain does not ship",
                             "pass --python-models DIR with TensorRT-LLM 1.2.1's triton_backend/all_models/llmapi "
                             "(a checkout, or /app/all_models/llmapi style copy from the trtllm container)")
    data = model_yaml(spec, served_model_dir(spec, workspace))
    config = model_config(spec)
    blob = json.dumps({"yaml": data, "config": config.render()}, sort_keys=True, default=str)
    wanted = Manifest(stage="model-repo", spec_hash=hashlib.sha256(blob.encode()).hexdigest(),
                      inputs={"renderer": _renderer_hash(upstream_dir)})
    repo = workspace.model_repo_dir(spec)
    if not force and (have := reusable(repo, wanted, redo="rendering again", keep_edits=keep_edits,
                                       say=echo or (lambda _msg: None))) is not None:
        return have
    header = (f"Generated by `toolchain model-repo` from {spec.source or '<spec>'} (deployment '{spec.name}', "
              f"target {spec.target}).\nEdit the spec and re-run; changes made here are overwritten.")
    with atomic_dir(repo) as tmp:
        version = tmp / MODEL / "1"
        version.mkdir(parents=True)
        config.write(tmp / MODEL, header)
        text = "# " + header.replace("\n", "\n# ") + "\n" + yaml.safe_dump(data, sort_keys=False)
        (version / "model.yaml").write_text(text)
        # The OpenAI server's config: the same LLM() arguments (trtllm-serve takes MODEL on its command line).
        serve = "# " + header.replace("\n", "\n# ") + "\n" + yaml.safe_dump(serve_config(spec), sort_keys=False)
        (tmp / SERVE_CONFIG).write_text(serve)
        if spec.lora.enabled:
            (tmp / "README.md").write_text(LORA_README.format(names=", ".join(spec.lora.adapters) or "sent per request"))
        if upstream_dir is not None:
            for name in UPSTREAM_FILES:
                shutil.copyfile(upstream_dir / name, version / name)
        else:
            shutil.copyfile(TRITON_MODEL, version / "model.py")
        wanted.outputs = {"models": [MODEL], "target": spec.target, "decoupled": config.decoupled,
                          "model_dir": data["model"],
                          "python_model": str(upstream_dir) if upstream_dir else "toolchain (CPU stand-in)"}
        wanted.seconds = round(time.monotonic() - started, 3)
        wanted.write(tmp)
    return wanted
