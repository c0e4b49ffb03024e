"""The spec as `tensorrt_llm.LLM()` keyword arguments (PyTorch backend, TensorRT-LLM 1.2.1).

One mapping serves Triton's `model.yaml` (plus its `triton_config`), the
`trtllm-serve --extra_llm_api_options` file and the CPU stand-in. Every key is checked against
the pinned release's own argument names (`upstream/facts/llmapi.json`, read from
tensorrt_llm/llmapi/llm_args.py): `TorchLlmArgs` forbids unknown keys, so a typo
in `llmapi.options` would otherwise surface only when the server starts on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolchain import upstream
from toolchain.archs import ArchParams, Family, load_params
from toolchain.errors import ToolchainError
from toolchain.llmapi.lora import section_problem
from toolchain.spec import DeploymentSpec
from toolchain.speculative import mode_of

POLICY = {"guaranteed_no_evict": "GUARANTEED_NO_EVICT", "max_utilization": "MAX_UTILIZATION"}
# Spec sections each derived top-level key comes from, for the error naming what to set instead.
DERIVED_FROM = {
    "model": "model.checkpoint", "tokenizer": "model.tokenizer", "dtype": "model.dtype", "backend": "target",
    "trust_remote_code": "model.trust_remote_code",
    "reasoning_parser": "llmapi.reasoning_parser",  # trtllm-serve's --reasoning_parser, on every launch line
    "guided_decoding_backend": "serving.guided_decoding_backend",  # also the engine path's model parameter
    "tensor_parallel_size": "parallelism.tp", "pipeline_parallel_size": "parallelism.pp",
    "moe_tensor_parallel_size": "parallelism.moe_tp", "moe_expert_parallel_size": "parallelism.moe_ep",
    "enable_attention_dp": "parallelism.attention_dp",
    "max_batch_size": "limits.max_batch_size", "max_input_len": "limits.max_input_len",
    "max_seq_len": "limits.max_seq_len", "max_num_tokens": "limits.max_num_tokens",
    "enable_chunked_prefill": "build.chunked_context", "speculative_config": "speculative",
    "max_beam_width": "build.max_beam_width",
    "kv_cache_config.free_gpu_memory_fraction": "serving.kv_cache_free_gpu_mem_fraction",
    "kv_cache_config.max_tokens": "serving.max_tokens_in_paged_kv_cache",
    "kv_cache_config.enable_block_reuse": "build.kv_cache_reuse",
    "kv_cache_config.tokens_per_block": "build.tokens_per_block",
    "kv_cache_config.dtype": "quantization.kv_cache",
    "kv_cache_config.max_attention_window": "model.checkpoint (config.json's sliding windows)",
    "scheduler_config.capacity_scheduler_policy": "serving.batch_scheduler_policy",
    "lora_config": "lora", "peft_cache_config": "lora.cache",
}
# LLM() sections whose fields the facts do not record (LoraConfig is a dataclass in lora_helper.py, PeftCacheConfig
# was not extracted): checked against llmapi/lora.py's mirrors of those classes.
LORA_SECTIONS = ("lora_config", "peft_cache_config")
# Nested sections whose own field names are known from the facts.
SECTIONS = {"kv_cache_config": "kv_cache_config", "scheduler_config": "scheduler_config",
            "cuda_graph_config": "cuda_graph_config"}


def _facts() -> dict:
    return upstream.facts("llmapi")


def _fields(name: str) -> dict[str, Any]:
    """Field name -> fact of a class recorded in the facts (llm_args, kv_cache_config, ...)."""
    return (_facts().get(name) or {}).get("fields") or {}


def known_args() -> dict[str, Any]:
    return _fields("llm_args")


def speculative_config(spec: DeploymentSpec) -> dict | None:
    sp = spec.speculative
    if sp.mode == "none":
        return None
    row = mode_of(sp.mode)
    kind = row.decoding_type
    if kind is None:
        return None  # refused by the llmapi.speculative check
    if row.drafts_in_target:
        # The model's own MTP modules draft; their count is the draft length (MTPDecodingConfig).
        return {"decoding_type": kind, "num_nextn_predict_layers": sp.max_draft_len or 1}
    out: dict[str, Any] = {"decoding_type": kind, "max_draft_len": sp.max_draft_len}
    if row.draft == "draft_model":
        # EAGLE-3 is the Eagle decoding type with a separate draft checkpoint (eagle3_one_model by default).
        out["speculative_model_dir"] = str(sp.draft_model) if sp.draft_model else None
    else:
        out["max_matching_ngram_size"] = sp.ngram_size
    return out


def _model(checkpoint: Path | str) -> tuple[Family, ArchParams] | None:
    """The family and parameters of the HF model in `checkpoint` (None: its config.json cannot say)."""
    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        return load_params(cfg, str(Path(checkpoint) / "config.json"))
    except (OSError, ValueError, ToolchainError):  # absent, not JSON, or a family archs/ does not know
        return None


def _is_moe(checkpoint: Path) -> bool | None:
    """Whether the HF model in `checkpoint` is a mixture of experts (None: its config.json cannot say)."""
    model = _model(checkpoint)
    return None if model is None else model[1].is_moe


def attention_windows(params: ArchParams) -> list[int] | None:
    """`kv_cache_config.max_attention_window` for a model with sliding windows (None: every layer attends to the
    whole sequence).

    The PyTorch backend sizes its KV cache from this field alone: left unset, its KVCacheManager takes
    `[max_seq_len]` for every layer, one pool of full-length sequences; set, it clamps each entry to max_seq_len
    and, when they differ (VSWA), gives each window size its own pool in proportion to window x bytes per token
    (tensorrt_llm/_torch/pyexecutor/resource_manager.py, KVCacheManager.__init__: "Use max_seq_len as default
    max_attention_window", `is_vswa`, calculate_max_num_blocks_from_cpp -> blocks_per_window). KvCacheConfig
    declares it `Optional[List[int]]`, "repeated ... to the number of layers" when shorter
    (tensorrt_llm/llmapi/llm_args.py; facts/llmapi.json kv_cache_config). So it is written here, one entry per
    layer where layers differ (Gemma 3's local and global layers, as config.json runtime_defaults carries them on
    the engine path) and one entry for a window every layer shares (Mistral, Phi-3, windowed Qwen): the KV pool
    `plan` reports (memory.window_share, memory.sequence_tokens) is then the one the backend allocates, and
    upstream's own Gemma 3 tests pass the same per-layer windows (tests/integration/defs/accuracy/
    test_llm_api_pytorch.py, TestGemma3_1BInstruct: max_attention_window=[512, 512, 512, 512, 512, 32768])."""
    if params.layer_windows is not None:
        return list(params.layer_windows)
    return [params.sliding_window] if params.sliding_window else None


def windows_problem(windows: Any, checkpoint: Path | str, max_seq_len: int) -> str | None:
    """Why `windows` (a kv_cache_config.max_attention_window) would not attend as the model in `checkpoint` does,
    or None (also when its config.json cannot say). Compared as the backend reads it: repeated to the layer
    count, each entry clamped to max_seq_len."""
    if not (isinstance(windows, list) and windows
            and all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in windows)):
        return f"kv_cache_config.max_attention_window must be a non-empty list of positive integers, got {windows!r}"
    model = _model(checkpoint)
    if model is None:
        return None
    params = model[1]
    layers = params.num_hidden_layers
    own = attention_windows(params) or [max_seq_len]

    def per_layer(ws: list[int]) -> list[int]:
        return [min(ws[i % len(ws)], max_seq_len) for i in range(layers)]

    if per_layer(windows) != per_layer(own):
        return (f"kv_cache_config.max_attention_window {windows} is not the model's own windows {own} (at "
                f"max_seq_len {max_seq_len}); the CPU stand-in attends by config.json's, so leave it out")
    return None


def expert_parallel_args(spec: DeploymentSpec) -> dict[str, int]:
    """LLM()'s `moe_tensor_parallel_size` / `moe_expert_parallel_size` (BaseLlmArgs, both Optional[int], default
    None: tensorrt_llm/llmapi/llm_args.py, facts/llmapi.json llm_args), for a mixture-of-experts model only.

    Upstream turns None into -1 and its Mapping derives -1 as archs/layout.py `Layout` does (tensorrt_llm/mapping.py
    MappingBase.__init__: both unset gives moe_tp = tp, moe_ep = 1; one unset is tp // the other). Both are
    written, derived where the spec leaves one out, so model.yaml and trtllm-serve.yaml state the expert placement
    that plan, convert and the CPU engine use rather than leaving it to the release's defaults. A dense model gets
    neither (the moe.parallelism check refuses a non-trivial one there); a model whose config.json this host cannot
    read gets what the spec sets."""
    par = spec.parallelism
    moe = _is_moe(spec.model.checkpoint)
    if moe is False:
        return {}
    if moe is None:
        given = {"moe_tensor_parallel_size": par.moe_tp, "moe_expert_parallel_size": par.moe_ep}
        return {k: v for k, v in given.items() if v is not None}
    layout = par.layout
    return {"moe_tensor_parallel_size": layout.moe_tp, "moe_expert_parallel_size": layout.moe_ep}


def llm_args(spec: DeploymentSpec, model_dir: Path | str) -> dict[str, Any]:
    """LLM() keyword arguments for `spec`, serving the checkpoint in `model_dir`."""
    lim, s, b = spec.limits, spec.serving, spec.build
    kv: dict[str, Any] = {"free_gpu_memory_fraction": s.kv_cache_free_gpu_mem_fraction,
                          "enable_block_reuse": b.kv_cache_reuse, "tokens_per_block": b.tokens_per_block}
    if s.max_tokens_in_paged_kv_cache is not None:
        kv["max_tokens"] = s.max_tokens_in_paged_kv_cache
    if spec.quantization.kv_cache == "fp8":
        kv["dtype"] = "fp8"
    model = _model(spec.model.checkpoint)
    if model is not None:
        family, params = model
        windows = attention_windows(params)
        if windows is not None:
            kv["max_attention_window"] = windows
        if family.llmapi_no_reuse is not None:
            # Upstream's default is on (KvCacheConfig.enable_partial_reuse); the llmapi.kv-reuse check refuses
            # build.kv_cache_reuse for such a family, and this keeps partial reuse off with it.
            kv["enable_partial_reuse"] = False
    args: dict[str, Any] = {"model": str(model_dir), "backend": "pytorch"}
    if spec.model.tokenizer is not None:
        args["tokenizer"] = str(spec.model.tokenizer)
    if spec.model.dtype != "auto":
        args["dtype"] = spec.model.dtype
    # Always written, False unless the spec opts in: the model's own code never runs by default.
    args["trust_remote_code"] = spec.model.trust_remote_code
    args.update({
        "tensor_parallel_size": spec.parallelism.tp, "pipeline_parallel_size": spec.parallelism.pp,
        "max_batch_size": lim.max_batch_size, "max_input_len": lim.max_input_len, "max_seq_len": lim.max_seq_len,
        "max_num_tokens": lim.max_num_tokens, "enable_chunked_prefill": b.chunked_context,
        "kv_cache_config": kv,
        "scheduler_config": {"capacity_scheduler_policy": POLICY[s.batch_scheduler_policy]},
    })
    args.update(expert_parallel_args(spec))
    if spec.parallelism.attention_dp:
        # BaseLlmArgs.enable_attention_dp (bool, default False; facts/llmapi.json llm_args), handed to the Mapping
        # (_ParallelConfig.to_mapping); written only when on, so other deployments' files keep upstream's default.
        args["enable_attention_dp"] = True
    if b.max_beam_width > 1:
        # BaseLlmArgs.max_beam_width (Optional[int], default None: one beam; facts/llmapi.json llm_args): beam
        # search requests (use_beam_search, best_of or n beams) are served up to this width. Written only for
        # beams, so other deployments' files keep upstream's default.
        args["max_beam_width"] = b.max_beam_width
    if s.guided_decoding_backend is not None:
        # BaseLlmArgs.guided_decoding_backend (Optional[Literal['xgrammar', 'llguidance']], default None;
        # facts/llmapi.json llm_args): without it the LLM API and trtllm-serve refuse guided decoding
        # (response_format), so the spec field that turns it on for Triton's tensorrt_llm model turns it on here.
        args["guided_decoding_backend"] = s.guided_decoding_backend
    spec_cfg = speculative_config(spec)
    if spec_cfg is not None:
        args["speculative_config"] = spec_cfg
    args.update(lora_args(spec))
    return merge(args, spec.llmapi.options)


def lora_args(spec: DeploymentSpec) -> dict[str, Any]:
    """LLM()'s `lora_config` and `peft_cache_config` for a spec serving LoRA (empty otherwise), as upstream's
    multi-LoRA docs configure them (docs/source/features/lora.md @0c8de69: LoraConfig(lora_target_modules=...,
    max_lora_rank=..., max_loras=..., max_cpu_loras=...), PeftCacheConfig(host_cache_size=..., device_cache_percent=...)).

    lora_dir stays empty: the adapters are named per request (LoRARequest's lora_path) and loaded on first use, and
    with several dirs the PyTorch executor preloads none anyway (_torch/pyexecutor/_util.py create_py_executor_instance
    loads only a single lora_dir). lora_target_modules is given, q/k/v completed (lora_setup), so upstream neither
    infers nor defaults to all twelve modules. max_loras / max_cpu_loras only when the spec sets them (None sizes the
    pools by PeftCacheConfig); device_cache_percent only when set (upstream's default 0.02 otherwise)."""
    if not spec.lora.enabled:
        return {}
    from toolchain.checkpoint.lora_setup import lora_setup  # imports torch

    setup = lora_setup(spec.lora)
    assert setup is not None  # enabled
    cache = spec.lora.cache
    lora: dict[str, Any] = {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": setup.max_lora_rank,
                            "lora_target_modules": list(setup.target_modules)}
    for key in ("max_loras", "max_cpu_loras"):
        if getattr(cache, key) is not None:
            lora[key] = getattr(cache, key)
    peft: dict[str, Any] = {"host_cache_size": cache.host_memory_bytes}
    if cache.gpu_memory_fraction is not None:
        peft["device_cache_percent"] = cache.gpu_memory_fraction
    peft.update(optimal_adapter_size=cache.optimal_adapter_size, max_adapter_size=cache.max_adapter_size)
    return {"lora_config": lora, "peft_cache_config": peft}


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def triton_config(spec: DeploymentSpec) -> dict[str, Any]:
    """model.yaml's triton_config: batching happens inside the executor, so Triton's is 0."""
    return {"max_batch_size": 0, "decoupled": spec.serving.streaming,
            "cancellation_check_period_ms": spec.llmapi.cancellation_check_period_ms}


def model_yaml(spec: DeploymentSpec, model_dir: Path | str) -> dict[str, Any]:
    return {**llm_args(spec, model_dir), "triton_config": triton_config(spec)}


def serve_config(spec: DeploymentSpec) -> dict[str, Any]:
    """The `trtllm-serve MODEL --extra_llm_api_options FILE` YAML: the same arguments, MODEL given on the command line."""
    return {k: v for k, v in llm_args(spec, "").items() if k != "model"}


def _paths(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, dict) and key in SECTIONS and not prefix:
            out += _paths(value, f"{key}.")
    return out


def options_problem(spec: DeploymentSpec) -> str | None:
    """A key of llmapi.options that the spec already derives, or that the release does not know."""
    for path in _paths(spec.llmapi.options):
        if path in DERIVED_FROM:
            return (f"llmapi.options.{path} is derived from {DERIVED_FROM[path]}; set that instead, so the plan and "
                    "every stage see the same value")
    return llm_args_problem(spec.llmapi.options, partial=True)


def llm_args_problem(args: dict[str, Any], partial: bool = False) -> str | None:
    """Why TorchLlmArgs would refuse `args` (an unknown key, a bad section, a bad decoding type), or None.
    `partial`: `args` are extra options, so `model` need not be there."""
    facts = _facts()
    known = known_args()
    release = "TorchLlmArgs of the TensorRT-LLM 1.2 line"
    if not partial and not args.get("model"):
        return "LLM() needs `model` (a Hugging Face checkpoint directory)"
    for key, value in args.items():
        if known and key not in known:
            close = _closest(key, known)
            return f"unknown LLM-API argument '{key}' ({release} has no such field{close})"
        section = SECTIONS.get(key)
        fields = _fields(section) if section else {}
        if section and isinstance(value, dict) and fields:
            for sub in value:
                if sub not in fields:
                    return f"unknown key '{key}.{sub}' ({release}: {key} has no such field{_closest(sub, fields)})"
        elif section and value is not None and not isinstance(value, dict):
            return f"{key} must be a mapping, got {type(value).__name__}"
        if key in LORA_SECTIONS and (problem := section_problem(key, value)):
            return problem
    spec_cfg = args.get("speculative_config")
    if spec_cfg is not None:
        return _speculative_problem(spec_cfg, facts.get("speculative", {}).get("types", {}))
    return None


def _speculative_problem(cfg: Any, types: dict) -> str | None:
    if not isinstance(cfg, dict):
        return f"speculative_config must be a mapping with decoding_type, got {type(cfg).__name__}"
    kind = cfg.get("decoding_type")
    if types and kind not in types:
        return f"speculative_config.decoding_type {kind!r} is not one of {', '.join(sorted(types))}"
    fields = (types.get(kind) or {}).get("fields") or {}
    base = set(upstream.facts("llmapi").get("speculative", {}).get("base_fields", {}))
    for key in cfg:
        if fields and key != "decoding_type" and key not in fields and key not in base:
            return f"speculative_config ({kind}) has no field '{key}'{_closest(key, fields)}"
    return None


def _closest(name: str, choices) -> str:
    import difflib

    match = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean '{match[0]}'?" if match else ""
