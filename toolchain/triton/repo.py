"""The `model-repo` stage: render the Triton model repository for a spec.

Writes `model_repo/<name>/` atomically: one directory per model (config.pbtxt
rendered through Triton's protobuf and parsed back; `1/model.py` for the
Python-backend models) and `manifest.json` at the repository root.
tritonserver 2.51 only treats directories as models and ignores plain files
there (checked against the wheel's server), so the manifest can live in the
repository it describes.

The stage is keyed on the spec fields that reach the configs, the engine's manifest (so a rebuilt engine
re-renders the repository), the tokenizer files and the renderer's own
sources. The engine itself is not needed to render, only to serve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import toolchain
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir, sha256_file
from toolchain.manifest import MANIFEST, Manifest, content_hash, reusable
from toolchain.spec import DeploymentSpec
from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.targets import ENGINE, TARGETS, require_target, target_of
from toolchain.triton import backend_models
from toolchain.triton.config import ModelConfig, check_ensemble
from toolchain.triton.templates import PYTHON_MODELS, RepoOptions, build_models
from toolchain.workspace import Workspace
from toolchain.eos import read_tokenizer, resolve
from toolchain.engine.trtllm import triton_parameters

STAGE = "model-repo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "spiece.model")
_RENDERER_SOURCES = ("config.py", "tensors.py", "templates.py", "repo.py")
# The tokenizer-info file the tensorrt_llm model's xgrammar_tokenizer_info_path names, in the repository's root
# (tritonserver takes only directories there for models).
TOKENIZER_INFO = "xgrammar_tokenizer_info.json"


def _trtllm_options(spec: DeploymentSpec, workspace: Workspace) -> dict:
    """Backend parameters from the build/speculative sections (target trtllm), and the draft engine
    (draft_target, both targets)."""
    out: dict = {}
    row = mode_of(spec.speculative.mode)
    # The backend's Medusa decoding drafts along the tree convert recorded with the heads (medusa_choices).
    medusa = recorded_medusa_choices(spec, workspace) if row.decoding_mode == "medusa" else None
    builder = target_of(spec).engine_builder
    if builder is not None and not builder.python_model:  # the tensorrtllm backend's parameters
        out["trtllm_parameters"] = tuple(sorted(triton_parameters(spec, medusa_choices=medusa).items()))
    if spec.build.max_beam_width > 1:  # the backend's default decoding mode for beams (docs/model_config.md)
        out["decoding_mode"] = "beam_search"
    if row.prompt_lookup:
        out["draft_ngram_size"] = spec.speculative.ngram_size
    if medusa is not None:
        out["decoding_mode"] = "medusa"
        out["medusa_choices"] = medusa
    if row.adds == DRAFT_ENGINE:
        out["draft_engine_dir"] = Path(workspace.engine_dir(spec)).resolve() / "draft" / "engine"
        out["draft_kv_cache_free_gpu_mem_fraction"] = spec.speculative.draft_kv_cache_free_gpu_mem_fraction
        if spec.speculative.draft_gpu_device_ids is not None:
            out["draft_gpu_device_ids"] = ",".join(map(str, spec.speculative.draft_gpu_device_ids))
    return out


def lora_parameters(spec: DeploymentSpec, workspace: Workspace) -> dict[str, object]:
    """The tensorrt_llm model's LoRA cache parameters from spec.lora.cache (model_instance_state.cc
    getPeftCacheConfigFromParams reads them, defaults 8, 64, 0.05 and 1 GiB), and lora_prefetch_dir, the adapters
    convert wrote by task id (engines/<name>/lora/), where the spec names adapters; nothing without lora, so the
    backend's defaults apply (target trtllm writes those explicitly: engine/trtllm.py TRITON_DEFAULTS)."""
    lora = spec.lora
    if not lora.enabled:
        return {}
    cache = lora.cache
    params: dict[str, object] = {"lora_cache_optimal_adapter_size": cache.optimal_adapter_size,
                                 "lora_cache_max_adapter_size": cache.max_adapter_size,
                                 "lora_cache_host_memory_bytes": cache.host_memory_bytes}
    if cache.gpu_memory_fraction is not None:
        params["lora_cache_gpu_memory_fraction"] = cache.gpu_memory_fraction
    if lora.adapters:
        params["lora_prefetch_dir"] = Path(workspace.lora_dir(spec)).resolve()
    return params


def recorded_medusa_choices(spec: DeploymentSpec, workspace: Workspace) -> str:
    """Medusa: the draft tree the convert stage attached the heads for and recorded in the
    checkpoint's manifest (Triton's `{0}, {0, 1}` syntax); the heads are not read again here."""
    checkpoint = workspace.checkpoint_dir(spec)
    have = Manifest.read(checkpoint)
    choices = (have.outputs or {}).get("medusa_choices") if have is not None else None
    if not choices:
        raise ToolchainError(f"no Medusa draft tree recorded with a converted checkpoint at {checkpoint}",
                             f"run `toolchain convert {spec.source or 'SPEC'}` first (with --force for a checkpoint "
                             "converted before convert recorded the tree)")
    return str(choices)


def _end_ids(spec: DeploymentSpec) -> dict:
    """end_id and extra stop ids from the checkpoint's config files, so that an
    instruct model stops at its chat terminator (TensorRT-LLM issue #2120) without the
    client sending end_id."""

    def read(name: str) -> dict | None:
        path = Path(spec.model.checkpoint) / name
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except ValueError:
            return None  # the convert stage reports a broken config.json

    eos = resolve(read("config.json") or {}, read("generation_config.json"), read_tokenizer(spec.model.tokenizer_dir))
    return {"end_id": eos.end_id, "stop_ids": tuple(eos.stop_ids)}


def repo_options(spec: DeploymentSpec, workspace: Workspace) -> RepoOptions:
    s = spec.serving
    return RepoOptions(
        target=spec.target,
        max_batch_size=spec.limits.max_batch_size,
        decoupled=s.streaming,
        instance_count=s.instance_count,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
        engine_dir=Path(workspace.engine_dir(spec)).resolve(),
        tokenizer_dir=Path(spec.model.tokenizer_dir).resolve(),
        kv_cache_free_gpu_mem_fraction=s.kv_cache_free_gpu_mem_fraction,
        max_tokens_in_paged_kv_cache=s.max_tokens_in_paged_kv_cache,
        batch_scheduler_policy=s.batch_scheduler_policy,
        max_queue_size=s.max_queue_size,
        enable_kv_cache_reuse=spec.build.kv_cache_reuse,
        enable_chunked_context=spec.build.chunked_context,
        exclude_input_in_output=s.exclude_input_in_output,
        accumulate_tokens=s.accumulate_tokens,
        toolchain_path=Path(toolchain.__file__).resolve().parent.parent,
        engine_threads=s.engine_threads,
        trust_remote_code=spec.model.trust_remote_code,
        guided_decoding_backend=s.guided_decoding_backend,
        xgrammar_tokenizer_info_path=(Path(workspace.model_repo_dir(spec)).resolve() / TOKENIZER_INFO
                                      if s.guided_decoding_backend else None),
        max_beam_width=spec.build.max_beam_width,
        lora_parameters=tuple(sorted(lora_parameters(spec, workspace).items())),
        **_end_ids(spec),
        **_trtllm_options(spec, workspace),
    )


def tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise ToolchainError(f"tokenizer directory not found: {tokenizer_dir}",
                             "set model.tokenizer (or model.checkpoint) to a directory holding the tokenizer")
    found = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not found:
        raise ToolchainError(f"no tokenizer files in {tokenizer_dir} "
                             f"(looked for {', '.join(TOKENIZER_FILES[:4])}, ...)",
                             "set model.tokenizer to a Hugging Face tokenizer directory")
    return found


def _renderer_hash() -> str:
    """Hash of the code that decides what is written, so a changed template or
    model.py re-renders even when the spec did not change."""
    here = Path(__file__).resolve().parent
    paths = [here / name for name in _RENDERER_SOURCES] + sorted(backend_models.HERE.glob("*.py"))
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()


def options_hash(opts: RepoOptions) -> str:
    """Hash of what the repository is rendered from: the spec fields that reach
    a config.pbtxt, not the whole spec, so a different port does not re-render."""
    fields = dataclasses.asdict(opts)
    if not fields["lora_parameters"]:  # a repository without LoRA keys as it did before LoRA existed
        del fields["lora_parameters"]
    if fields["draft_gpu_device_ids"] == "0":  # and one with the draft on GPU 0 as before it could move
        del fields["draft_gpu_device_ids"]
    blob = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def wanted_manifest(spec: DeploymentSpec, workspace: Workspace, python_models: Path | None = None) -> Manifest:
    return manifest_for(repo_options(spec, workspace), python_models)


def manifest_for(opts: RepoOptions, python_models: Path | None = None) -> Manifest:
    """The manifest a repository rendered from `opts` (and `python_models`) records."""
    engine_manifest = opts.engine_dir / MANIFEST
    inputs = {
        "engine_manifest": content_hash(opts.engine_dir) if engine_manifest.is_file() else "missing",
        "renderer": _renderer_hash(),
    }
    if python_models is not None:  # a changed upstream model.py re-renders
        for name in PYTHON_MODELS:
            for path in _python_model_files(python_models, name):
                inputs[f"python_models/{path.relative_to(python_models)}"] = sha256_file(path)
    for path in tokenizer_files(opts.tokenizer_dir):
        inputs[f"tokenizer/{path.name}"] = sha256_file(path)
    return Manifest(stage=STAGE, spec_hash=options_hash(opts), inputs=inputs)


# Where an `all_models/inflight_batcher_llm` tree may sit under the directory a user names.
_UPSTREAM_LAYOUTS = ("", "inflight_batcher_llm", "all_models/inflight_batcher_llm",
                     "triton_backend/all_models/inflight_batcher_llm")


def upstream_python_models(directory: Path | str) -> Path:
    """The `inflight_batcher_llm` tree under `directory` holding tensorrtllm_backend's own
    preprocessing, postprocessing and tensorrt_llm_bls `1/model.py` (as the GPU container ships
    them); a ToolchainError naming what is missing otherwise."""
    base = Path(directory).expanduser()
    if not base.is_dir():
        raise ToolchainError(f"--python-models {directory}: no such directory",
                             "point it at tensorrtllm_backend's all_models/inflight_batcher_llm")
    for sub in _UPSTREAM_LAYOUTS:
        root = base / sub
        if all((root / name / "1" / "model.py").is_file() for name in PYTHON_MODELS):
            return root.resolve()
    missing = [n for n in PYTHON_MODELS if not (base / n / "1" / "model.py").is_file()]
    raise ToolchainError(f"--python-models {directory}: no {missing[0]}/1/model.py there",
                         "point it at tensorrtllm_backend's all_models/inflight_batcher_llm "
                         f"(needs {', '.join(f'{n}/1/model.py' for n in PYTHON_MODELS)})")


def _python_model_files(root: Path, name: str) -> list[Path]:
    version = root / name / "1"
    return sorted(p for p in version.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def render_repository(models: dict[str, ModelConfig], out: Path, target: str, header: str = "",
                      python_models: Path | None = None) -> None:
    """Write every model of `models` under `out` (an existing, empty directory). With
    `python_models` (an upstream inflight_batcher_llm tree), preprocessing, postprocessing and
    tensorrt_llm_bls run NVIDIA's own model.py and helpers; only their configs are rendered."""
    check_ensemble(models["ensemble"], models)
    builder = TARGETS[target].engine_builder
    ours = PYTHON_MODELS + (("tensorrt_llm", "tensorrt_llm_draft") if builder is not None and builder.python_model
                            else ())
    for name, model in models.items():
        version_dir = Path(out) / name / "1"
        version_dir.mkdir(parents=True)
        model.write(version_dir.parent, header)
        if python_models is not None and name in PYTHON_MODELS:
            for src in _python_model_files(python_models, name):
                dest = version_dir / src.relative_to(python_models / name / "1")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest)
        elif name in ours:
            # The draft is served by the same CPU model as the target, on its own engine.
            source = "tensorrt_llm" if name == "tensorrt_llm_draft" else name
            shutil.copyfile(backend_models.source(source), version_dir / "model.py")


def write_tokenizer_info(opts: RepoOptions, path: Path) -> None:
    """The JSON file the tensorrt_llm backend reads from xgrammar_tokenizer_info_path (keys encoded_vocab,
    tokenizer_str, stop_token_ids: getGuidedDecodingConfigFromParams in TensorRT-LLM's
    triton_backend/inflight_batcher_llm/src/model_instance_state.cc), from the deployment's tokenizer and the
    engine's vocabulary size. Upstream writes it with a script of its own (UNVERIFIED path); this is that file's
    content as XGrammar reads it."""
    from toolchain.engine.cpu.guided import tokenizer_info_dict

    vocab_size = 0  # without a built engine (rendered ahead of a GPU build): the tokenizer's own
    engine_config = opts.engine_dir / "config.json"
    if engine_config.is_file():
        vocab_size = int(json.loads(engine_config.read_text()).get("pretrained_config", {}).get("vocab_size") or 0)
    path.write_text(json.dumps(tokenizer_info_dict(opts.tokenizer_dir, vocab_size, opts.trust_remote_code)))


def run_model_repo(spec: DeploymentSpec, workspace: Workspace, force: bool = False,
                   python_models: Path | str | None = None, keep_edits: bool = False,
                   echo: Callable[[str], None] | None = None) -> Manifest:
    """Render `workspace.model_repo_dir(spec)` for the engine path (the LLM-API path's repository is
    toolchain/llmapi/repo.py's; toolchain/pipeline.py picks); reuse it when its manifest is current
    and its files are those rendered (a hand-edited file renders again, `echo` says which, unless
    `keep_edits`). `python_models`: an upstream inflight_batcher_llm tree whose Python models to use."""
    require_target(spec, f"target {spec.target} takes the LLM-API path, which has its own model repository",
            "run `toolchain model-repo SPEC`, which takes the spec's path", path=ENGINE)
    started = time.monotonic()
    repo_dir = workspace.model_repo_dir(spec)
    upstream = upstream_python_models(python_models) if python_models is not None else None
    opts = repo_options(spec, workspace)  # once: the manifest's key and what is rendered
    manifest = manifest_for(opts, upstream)
    if not force and (have := reusable(repo_dir, manifest, redo="rendering again", keep_edits=keep_edits,
                                       say=echo or (lambda _msg: None))) is not None:
        return have
    models = build_models(opts)
    source = spec.source or "<spec>"
    header = (f"Generated by `toolchain model-repo` from {source} (deployment '{spec.name}', target {spec.target}).\n"
              "Edit the spec and re-run; changes made here are overwritten.")
    with atomic_dir(repo_dir) as tmp:
        render_repository(models, tmp, opts.target, header, upstream)
        if opts.xgrammar_tokenizer_info_path is not None:
            write_tokenizer_info(opts, tmp / TOKENIZER_INFO)
        manifest.outputs = {
            "models": sorted(models),
            "target": opts.target,
            "backend": models["tensorrt_llm"].backend,
            "decoupled": opts.decoupled,
            "max_batch_size": opts.max_batch_size,
            "engine_dir": str(opts.engine_dir),
            "tokenizer_dir": str(opts.tokenizer_dir),
            "python_models": {name: str(upstream / name / "1") if upstream else "toolchain"
                              for name in PYTHON_MODELS},
        }
        manifest.seconds = round(time.monotonic() - started, 3)
        manifest.write(tmp)
    return manifest
