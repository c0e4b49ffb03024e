"""A deployment read from its repository and engines, written as a spec for target trtllm.

Which spec field drives which parameter or flag is the renderer's and the build's own mapping read backwards
(triton/repo.py repo_options, triton/templates.py, engine/trtllm.py build_flags and triton_parameters). Models that
disagree with each other where the spec holds one value (the tokenizer, the batch size, decoupled mode) are refused
in one line naming the files and fields; a setting the spec holds no field for is left to the round trip's report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from toolchain.errors import ToolchainError
from toolchain.importer.engine import Engine, default_opt_num_tokens, read_engine
from toolchain.importer.repo import BLS, ENGINE_MODEL, Model, Repository
from toolchain.importer.values import effective
from toolchain.quant.formats import BY_ALGO, KV_BY_ALGO, METHODS
from toolchain.spec import BuildSection, ModelSection

# The spec's own choices (spec.py), "auto" aside: what an engine's dtype and gemm plugin may map to.
DTYPES = tuple(v for v in get_args(ModelSection.model_fields["dtype"].annotation) if v != "auto")
GEMM_PLUGINS = tuple(v for v in get_args(BuildSection.model_fields["gemm_plugin"].annotation) if v != "auto")
# trtllm-build --speculative_decoding_mode -> speculative.mode the import writes (with the repository's layout).
MODES = {None: "none", "draft_tokens_external": "draft_target", "lookahead_decoding": "lookahead"}


@dataclass(frozen=True)
class Deployment:
    """What was read: the repository, the target engine, the draft engine (draft-target) and the HF checkpoint."""

    repo: Repository
    engine: Engine
    draft_engine: Engine | None
    hf: Path | None
    draft_hf: Path | None = None

    @property
    def trt(self) -> Model:
        return self.repo[ENGINE_MODEL]

    @property
    def beam_width(self) -> int:
        return int(self.engine.build.get("max_beam_width") or 1)

    @property
    def max_seq_len(self) -> int | None:
        return self.engine.build.get("max_seq_len")

    def value(self, key: str, model: str = ENGINE_MODEL) -> Any:
        return effective(self.repo[model], key, self.beam_width, self.max_seq_len)


def _disagree(a: Model, b: Model, what: str, va: Any, vb: Any) -> ToolchainError:
    return ToolchainError(f"{a.path}: {what} {va!r} disagrees with {b.path}: {what} {vb!r}",
                          "fill both models with the same value (the spec holds one)")


def read_deployment(repo: Repository, engine_dir: Path | None = None, hf: Path | None = None,
                    draft_hf: Path | None = None) -> Deployment:
    """The engines the repository names (or `engine_dir`), read and checked against the repository; `hf` and
    `draft_hf` the HF checkpoints of the target and the draft (model.checkpoint, speculative.draft_model)."""
    trt = repo[ENGINE_MODEL]
    given = Path(engine_dir) if engine_dir else None
    named = trt.param("gpt_model_path")
    if given is None and named is None:
        raise ToolchainError(trt.where("parameter gpt_model_path (engine_dir) is unset"),
                             "fill engine_dir, or pass --engine DIR")
    engine = read_engine(given or Path(named or ""))
    draft_engine = None
    if repo.draft:
        draft = repo[repo.draft]
        path = draft.param("gpt_model_path")
        if path is None:
            raise ToolchainError(draft.where("parameter gpt_model_path (engine_dir) is unset: the draft model names "
                                             "no engine"), f"fill {repo.draft} with engine_dir:DRAFT_ENGINE_DIR")
        draft_engine = read_engine(Path(path), role="draft engine")
    for flag, given_hf in (("--hf", hf), ("--draft-hf", draft_hf)):
        if given_hf is not None and not (Path(given_hf) / "config.json").is_file():
            raise ToolchainError(f"{flag} {given_hf} has no config.json", "pass a Hugging Face checkpoint directory")
    if draft_hf is not None and not repo.draft:
        raise ToolchainError(f"--draft-hf {draft_hf}: {repo.root} has no draft model (no tensorrt_llm_bls names "
                             "tensorrt_llm_draft_model_name)", "leave --draft-hf out")
    for given_hf, built in ((hf, engine), (draft_hf, draft_engine)):
        if given_hf is not None and built is not None:
            _check_checkpoint(Path(given_hf), built)
    dep = Deployment(repo, engine, draft_engine, Path(hf) if hf else None, Path(draft_hf) if draft_hf else None)
    _check_agreement(dep)
    return dep


# HF config.json key -> the engine's pretrained_config key holding the same size (checkpoint/config.py writes them).
SHAPE_KEYS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers", "vocab_size": "vocab_size",
              "num_attention_heads": "num_attention_heads"}


def _check_checkpoint(hf: Path, engine: Engine) -> None:
    """The HF checkpoint is the model the engine was built from: the sizes both record agree."""
    try:
        cfg = json.loads((hf / "config.json").read_text())
    except ValueError as err:
        raise ToolchainError(f"{hf / 'config.json'} is not JSON ({err})", "pass a Hugging Face checkpoint") from None
    for key, built_key in SHAPE_KEYS.items():
        mine, built = cfg.get(key), engine.pretrained.get(built_key)
        if mine is not None and built is not None and mine != built:
            raise ToolchainError(f"{hf / 'config.json'}: {key} {mine} disagrees with {engine.path}: "
                                 f"pretrained_config.{built_key} {built}: not the model this engine was built from",
                                 "pass the checkpoint the engine was converted from")


def _check_agreement(dep: Deployment) -> None:
    repo = dep.repo
    pre, post = repo["preprocessing"], repo["postprocessing"]
    tok_pre, tok_post = pre.param("tokenizer_dir"), post.param("tokenizer_dir")
    if tok_pre is None:
        raise ToolchainError(pre.where("parameter tokenizer_dir is unset"), "fill tokenizer_dir:DIR")
    if tok_post is not None and Path(tok_post) != Path(tok_pre):
        raise _disagree(pre, post, "tokenizer_dir", tok_pre, tok_post)
    first = repo["ensemble"]
    for model in repo.models.values():
        if model.config.max_batch_size != first.config.max_batch_size:
            raise _disagree(first, model, "max_batch_size (triton_max_batch_size)", first.config.max_batch_size,
                            model.config.max_batch_size)
    trt = dep.trt
    pairs = [(dep.engine, trt)]
    if dep.draft_engine is not None and repo.draft:
        pairs.append((dep.draft_engine, repo[repo.draft]))
    for engine, model in pairs:
        built = engine.build.get("max_batch_size")
        if built != model.config.max_batch_size:
            raise ToolchainError(f"{engine.path}: build_config.max_batch_size {built} disagrees with {model.path}: "
                                 f"max_batch_size {model.config.max_batch_size}",
                                 "fill triton_max_batch_size with the engine's max_batch_size (the spec holds one)")
        beam = effective(model, "max_beam_width")
        if beam != engine.build.get("max_beam_width", 1):
            raise ToolchainError(f"{engine.path}: build_config.max_beam_width {engine.build.get('max_beam_width')} "
                                 f"disagrees with {model.path}: parameter max_beam_width {beam}",
                                 "fill max_beam_width with the engine's")
    others = [repo[n] for n in (BLS, repo.draft) if n and n in repo.models]
    for model in others:
        if model.decoupled != trt.decoupled:
            raise _disagree(trt, model, "decoupled (decoupled_mode)", trt.decoupled, model.decoupled)


def _quantization(engine: Engine) -> dict[str, Any]:
    q = engine.quantization
    fmt = BY_ALGO.get(q.get("quant_algo"))
    if fmt is None or fmt.name not in METHODS:
        raise ToolchainError(f"{engine.path}: pretrained_config.quantization.quant_algo {q.get('quant_algo')!r} "
                             "is not a format the spec's quantization.method names",
                             f"use one of {', '.join(f.quant_algo or 'none' for f in METHODS.values())}")
    kv = KV_BY_ALGO.get(q.get("kv_cache_quant_algo"))
    if kv is None:
        raise ToolchainError(f"{engine.path}: pretrained_config.quantization.kv_cache_quant_algo "
                             f"{q.get('kv_cache_quant_algo')!r} is not INT8, FP8 or none", "rebuild it with one of them")
    out: dict[str, Any] = {"method": fmt.name, "kv_cache": kv.name}
    if fmt.per_group and q.get("group_size") in (64, 128):
        out["group_size"] = q["group_size"]
    return out


def _build(engine: Engine, dtype: str) -> dict[str, Any]:
    b, p = engine.build, engine.plugin
    gemm = p.get("gemm_plugin") or "disable"
    out: dict[str, Any] = {
        "gemm_plugin": "auto" if gemm == dtype else gemm,
        "context_fmha": bool(p.get("context_fmha", True)),
        "use_paged_context_fmha": bool(p.get("use_paged_context_fmha")),
        "tokens_per_block": int(p.get("tokens_per_block") or 32),
        "multiple_profiles": bool(p.get("multiple_profiles")),
        "reduce_fusion": bool(p.get("reduce_fusion")),
        "max_beam_width": int(b.get("max_beam_width") or 1),
        "gather_context_logits": bool(b.get("gather_context_logits")),
    }
    if out["gemm_plugin"] not in ("auto", *GEMM_PLUGINS):
        raise ToolchainError(f"{engine.path}: build_config.plugin_config.gemm_plugin {gemm!r} is not one the spec's "
                             "build.gemm_plugin offers", f"rebuild with --gemm_plugin one of {', '.join(GEMM_PLUGINS)}")
    opt = b.get("opt_num_tokens")
    derived = default_opt_num_tokens(b["max_num_tokens"], b["max_batch_size"], out["max_beam_width"])
    if opt is not None and opt != derived and not out["multiple_profiles"]:
        out["opt_num_tokens"] = opt
    return out


def _speculative(dep: Deployment) -> dict[str, Any]:
    mode = dep.engine.speculative_mode
    if mode not in MODES or (mode == "draft_tokens_external") != bool(dep.repo.draft):
        what = (f"build_config.speculative_decoding_mode {mode}" if mode else "no speculative decoding mode")
        layout = f"the repository's draft model {dep.repo.draft}" if dep.repo.draft else f"no draft model in {dep.repo.root}"
        raise ToolchainError(f"{dep.engine.path}: {what} with {layout}",
                             "import handles none, draft-target (a draft model named by the BLS) and lookahead")
    out: dict[str, Any] = {"mode": MODES[mode]}
    if mode is None:
        return out
    out["max_draft_len"] = int(dep.engine.build.get("max_draft_len") or 0)
    if mode == "lookahead_decoding":
        for key in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"):
            out[key] = int(dep.value(key) or 0)
    if dep.repo.draft and dep.draft_engine is not None:
        out["draft_kv_cache_free_gpu_mem_fraction"] = dep.value("kv_cache_free_gpu_mem_fraction", dep.repo.draft)
        out["use_draft_logits"] = bool(dep.draft_engine.build.get("gather_generation_logits"))
        if dep.draft_hf is not None:
            out["draft_model"] = str(dep.draft_hf)
        world = int(dep.engine.mapping.get("world_size", 1))
        for key, model, usual in (("target_gpu_device_ids", ENGINE_MODEL, list(range(world))),
                                  ("draft_gpu_device_ids", dep.repo.draft, [0])):
            ids = _gpu_ids(dep.repo[model].param("gpu_device_ids"))
            if ids is not None and ids != usual:
                out[key] = ids
    return out


def _gpu_ids(text: str | None) -> list[int] | None:
    """gpu_device_ids as the backend reads it ("0,1"); None where unset or not a list of indices (the round trip
    then reports it)."""
    try:
        return [int(x) for x in text.split(",")] if text else None
    except ValueError:
        return None


def _lora(dep: Deployment) -> dict[str, Any]:
    if (dep.engine.plugin.get("lora_plugin") or "disable") == "disable":
        return {}
    lora = dep.engine.build.get("lora_config") or {}
    cache = {"optimal_adapter_size": dep.value("lora_cache_optimal_adapter_size"),
             "max_adapter_size": dep.value("lora_cache_max_adapter_size"),
             "host_memory_bytes": dep.value("lora_cache_host_memory_bytes")}
    if dep.trt.param("lora_cache_gpu_memory_fraction") is not None:
        cache["gpu_memory_fraction"] = dep.value("lora_cache_gpu_memory_fraction")
    return {"max_lora_rank": lora.get("max_lora_rank"), "target_modules": list(lora.get("lora_target_modules") or []),
            "cache": cache}


def spec_name(out: Path | None, repo: Repository) -> str:
    stem = out.stem if out is not None else repo.root.resolve().name
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")
    return name or "imported"


def spec_dict(dep: Deployment, name: str) -> dict[str, Any]:
    """The spec (target trtllm) that renders this deployment, as the mapping written to YAML."""
    repo, trt, engine = dep.repo, dep.trt, dep.engine
    pre = repo["preprocessing"]
    tokenizer = Path(pre.param("tokenizer_dir") or "")
    dtype = str(engine.pretrained.get("dtype") or "auto")
    model: dict[str, Any] = {"checkpoint": str(dep.hf or tokenizer), "dtype": dtype if dtype in DTYPES else "auto"}
    if dep.hf is not None and Path(dep.hf) != tokenizer:
        model["tokenizer"] = str(tokenizer)
    mapping = engine.mapping
    par: dict[str, Any] = {"tp": int(mapping.get("tp_size", 1)), "pp": int(mapping.get("pp_size", 1))}
    if int(mapping.get("moe_ep_size") or 1) > 1:
        par["moe_tp"], par["moe_ep"] = int(mapping.get("moe_tp_size") or 1), int(mapping["moe_ep_size"])
    if engine.pretrained.get("use_parallel_embedding"):
        par["parallel_embedding"] = True
        par["embedding_sharding_dim"] = int(engine.pretrained.get("embedding_sharding_dim") or 0)
    b = engine.build
    batching = trt.config.dynamic_batching
    serving: dict[str, Any] = {
        "streaming": trt.decoupled,
        "instance_count": pre.instance_count,
        "max_queue_delay_microseconds": int(batching.max_queue_delay_microseconds),
        "max_queue_size": int(batching.default_queue_policy.max_queue_size),
        "kv_cache_free_gpu_mem_fraction": dep.value("kv_cache_free_gpu_mem_fraction"),
        "batch_scheduler_policy": dep.value("batch_scheduler_policy"),
        "exclude_input_in_output": bool(dep.value("exclude_input_in_output")),
    }
    if BLS in dep.repo.models and dep.value("accumulate_tokens", BLS):
        serving["accumulate_tokens"] = True
    if trt.param("max_tokens_in_paged_kv_cache") is not None:
        serving["max_tokens_in_paged_kv_cache"] = dep.value("max_tokens_in_paged_kv_cache")
    if trt.param("guided_decoding_backend") == "xgrammar":
        serving["guided_decoding_backend"] = "xgrammar"
    build = _build(engine, dtype)
    build["kv_cache_reuse"] = bool(dep.value("enable_kv_cache_reuse"))
    build["chunked_context"] = bool(dep.value("enable_chunked_context"))
    data: dict[str, Any] = {
        "name": name, "target": "trtllm", "model": model, "parallelism": par,
        "limits": {k: int(b[k]) for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")},
        "serving": serving, "build": build, "speculative": _speculative(dep),
        "quantization": _quantization(engine),
    }
    lora = _lora(dep)
    if lora:
        data["lora"] = lora
    return data
