"""The five models of the TensorRT-LLM 1.2 inflight-batching repository as typed configs.

`build_models(RepoOptions)` returns ensemble, preprocessing, tensorrt_llm,
postprocessing and tensorrt_llm_bls with the tensors of `tensors.py`. Target
`cpu` and target `trtllm` render the same repository except for the
`tensorrt_llm` backend (`python` running the CPU engine, or the C++
`tensorrtllm` backend) and the parameters only one of them reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolchain.targets import TARGETS, Builder
from toolchain.triton.config import (EMPTY, ConfigError, DynamicBatching, EnsembleStep, InstanceGroup, ModelConfig,
                                     Tensor)
from toolchain.triton.tensors import (BLS_INPUTS, ENSEMBLE_INPUTS, ENSEMBLE_STEPS, POSTPROCESSING_INPUTS,
                                      POSTPROCESSING_OUTPUTS, PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS,
                                      TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS, TEXT_OUTPUTS)

MODEL_NAMES = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
# Python-backend models whose 1/model.py ships inside toolchain.triton.backend_models.
PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")


@dataclass(frozen=True)
class RepoOptions:
    """Every value the five configs need; built from the spec by repo.py."""

    target: str  # "cpu" or "trtllm"
    max_batch_size: int
    decoupled: bool
    instance_count: int
    max_queue_delay_microseconds: int
    engine_dir: Path
    tokenizer_dir: Path
    kv_cache_free_gpu_mem_fraction: float
    exclude_input_in_output: bool
    toolchain_path: Path  # fallback sys.path entry for the CPU model (the stub ignores PYTHONPATH)
    engine_threads: int = 1  # torch threads of the CPU engine (target cpu)
    max_tokens_in_paged_kv_cache: int | None = None
    batch_scheduler_policy: str = "guaranteed_no_evict"
    enable_kv_cache_reuse: bool = False
    enable_chunked_context: bool = False
    # Resolved from generation_config.json (toolchain/eos.py): the preprocessing model's
    # default end_id, and the other EOS ids it always adds as stop words.
    end_id: int | None = None
    stop_ids: tuple[int, ...] = ()
    max_queue_size: int = 0  # 0 = unbounded, as fill_template.py defaults it
    accumulate_tokens: bool = False  # the BLS streams the text so far instead of each new piece
    logits_dtype: str = "TYPE_FP32"
    encoder_features_dtype: str = "TYPE_FP16"
    prompt_table_dtype: str = "TYPE_FP16"
    # target trtllm: parameters from the spec's build and speculative sections
    # (toolchain.engine.trtllm.triton_parameters), and the draft-target draft engine.
    trtllm_parameters: tuple[tuple[str, object], ...] = ()
    # lora (both targets): the lora_cache_* parameters and lora_prefetch_dir (repo.py lora_parameters).
    lora_parameters: tuple[tuple[str, object], ...] = ()
    draft_engine_dir: Path | None = None
    draft_kv_cache_free_gpu_mem_fraction: float = 0.1
    draft_gpu_device_ids: str = "0"  # target trtllm: the draft engine's GPU (speculative.draft_gpu_device_ids)
    draft_ngram_size: int = 0  # speculative.mode ngram: the BLS drafts by prompt lookup (0: off)
    decoding_mode: str = "top_k_top_p"  # target cpu: "medusa" for a Medusa engine
    medusa_choices: str | None = None  # target cpu, Medusa: the draft tree ("{0}, {0, 0}, {1}")
    # model.trust_remote_code: pre/postprocessing pass it to AutoTokenizer (upstream's hard-code True).
    trust_remote_code: bool = False
    # serving.guided_decoding_backend, and the tokenizer-info file model-repo writes for it (repo.py).
    guided_decoding_backend: str | None = None
    xgrammar_tokenizer_info_path: Path | None = None
    max_beam_width: int = 1  # build.max_beam_width: the widest beam search requests may ask for


def _tensors(rows, opts: RepoOptions) -> list[Tensor]:
    symbolic = {"LOGITS": opts.logits_dtype, "ENCODER_FEATURES": opts.encoder_features_dtype,
                "PROMPT_TABLE": opts.prompt_table_dtype}
    out = []
    for name, dtype, dims, flags in rows:
        dtype = symbolic.get(dtype, dtype)
        out.append(Tensor(name, dtype if dtype.startswith("TYPE_") else f"TYPE_{dtype}", dims,
                          optional="optional" in flags, reshape=() if "scalar" in flags else None,
                          ragged="ragged" in flags))
    return out


def _batching(opts: RepoOptions) -> DynamicBatching:
    return DynamicBatching((opts.max_batch_size,), opts.max_queue_delay_microseconds, opts.max_queue_size)


def tensorrt_llm_parameters(opts: RepoOptions) -> dict[str, object]:
    """The tensorrt_llm parameters (tensorrtllm_backend docs/model_config.md) a deployment sets;
    the rest are left out so the backend applies its documented defaults (never a literal `${...}`)."""
    params: dict[str, object] = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": opts.engine_dir,
        "max_beam_width": opts.max_beam_width,
        "batch_scheduler_policy": opts.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": opts.kv_cache_free_gpu_mem_fraction,
        # Written explicitly either way: the C++ default for reuse is on.
        "enable_kv_cache_reuse": opts.enable_kv_cache_reuse,
        "enable_chunked_context": opts.enable_chunked_context,
        "exclude_input_in_output": opts.exclude_input_in_output,
        "normalize_log_probs": True,
        "decoding_mode": opts.decoding_mode,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        # Read without a fallback by the C++ backend (getGuidedDecodingConfigFromParams in
        # NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm/src/model_instance_state.cc, 1.2):
        # a missing key fails the load; empty means guided decoding off.
        "tokenizer_dir": opts.tokenizer_dir,
        "guided_decoding_backend": opts.guided_decoding_backend or EMPTY,
        "xgrammar_tokenizer_info_path": (str(opts.xgrammar_tokenizer_info_path) if opts.xgrammar_tokenizer_info_path
                                         else EMPTY),
    }
    if opts.max_tokens_in_paged_kv_cache is not None:
        params["max_tokens_in_paged_kv_cache"] = opts.max_tokens_in_paged_kv_cache
    if opts.medusa_choices:
        params["medusa_choices"] = opts.medusa_choices
    if _gpu_backend(opts):
        params["FORCE_CPU_ONLY_INPUT_TENSORS"] = "no"
        params["executor_worker_path"] = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
        params.update(dict(opts.trtllm_parameters))
    else:
        params["toolchain_path"] = opts.toolchain_path
        params["engine_threads"] = opts.engine_threads
    params.update(dict(opts.lora_parameters))
    return params


def _engine_builder(opts: RepoOptions) -> Builder:
    """What built the engine these configs serve: the engine path's targets only."""
    row = TARGETS.get(opts.target)
    if row is None or row.engine_builder is None:
        raise ConfigError(f"unknown target {opts.target!r}", "use target: cpu or target: trtllm")
    return row.engine_builder


def _gpu_backend(opts: RepoOptions) -> bool:
    """The engine runs on the tensorrtllm backend (trtllm-build's engines), not in the CPU engine's
    Python model."""
    return not _engine_builder(opts).python_model


def _preprocessing_parameters(opts: RepoOptions) -> dict[str, object]:
    # multimodal_model_path is read without a fallback by tensorrtllm_backend's
    # preprocessing model.py (a KeyError when absent); empty means text only, as
    # for max_num_images and hf_model_path (the Qwen2-VL / LLaVA processors' path).
    params: dict[str, object] = {"tokenizer_dir": opts.tokenizer_dir, "add_special_tokens": True,
                                 "gpt_model_path": opts.engine_dir, "multimodal_model_path": EMPTY,
                                 "max_num_images": EMPTY, "hf_model_path": EMPTY,
                                 "trust_remote_code": opts.trust_remote_code}
    if opts.end_id is not None:
        params["end_id"] = opts.end_id
    if opts.stop_ids:
        params["stop_token_ids"] = ",".join(str(i) for i in opts.stop_ids)
    return params


def build_models(opts: RepoOptions) -> dict[str, ModelConfig]:
    """The five model configs for `opts`, keyed by model name."""
    _engine_builder(opts)
    mbs = opts.max_batch_size
    cpu = [InstanceGroup(opts.instance_count, "KIND_CPU")]
    models = {
        "ensemble": ModelConfig(
            "ensemble", mbs, _tensors(ENSEMBLE_INPUTS, opts), _tensors(TEXT_OUTPUTS, opts), platform="ensemble",
            ensemble_steps=[EnsembleStep(m, dict(i), dict(o)) for m, i, o in ENSEMBLE_STEPS]),
        "preprocessing": ModelConfig(
            "preprocessing", mbs, _tensors(PREPROCESSING_INPUTS, opts), _tensors(PREPROCESSING_OUTPUTS, opts),
            backend="python", instance_group=cpu, dynamic_batching=_batching(opts),
            parameters=_preprocessing_parameters(opts)),
        "tensorrt_llm": ModelConfig(
            "tensorrt_llm", mbs, _tensors(TENSORRT_LLM_INPUTS, opts), _tensors(TENSORRT_LLM_OUTPUTS, opts),
            backend="tensorrtllm" if _gpu_backend(opts) else "python",
            # One instance: GPU placement is MPI's business, and on CPU one engine
            # owns the in-flight batch.
            instance_group=[InstanceGroup(1, "KIND_CPU")], dynamic_batching=_batching(opts),
            decoupled=opts.decoupled, parameters=tensorrt_llm_parameters(opts)),
        "postprocessing": ModelConfig(
            "postprocessing", mbs, _tensors(POSTPROCESSING_INPUTS, opts), _tensors(POSTPROCESSING_OUTPUTS, opts),
            backend="python", instance_group=cpu, dynamic_batching=DynamicBatching(),
            parameters={"tokenizer_dir": opts.tokenizer_dir, "skip_special_tokens": True,
                        "trust_remote_code": opts.trust_remote_code}),
        "tensorrt_llm_bls": ModelConfig(
            "tensorrt_llm_bls", mbs, _tensors(BLS_INPUTS, opts), _tensors(TEXT_OUTPUTS, opts), backend="python",
            instance_group=cpu, decoupled=opts.decoupled,
            # Empty names mean "none" to tensorrtllm_backend's BLS (get_valid_param_value).
            parameters={"accumulate_tokens": opts.accumulate_tokens, "tensorrt_llm_model_name": "tensorrt_llm",
                        "tensorrt_llm_draft_model_name": EMPTY, "multimodal_encoders_name": EMPTY}),
    }
    if opts.draft_engine_dir is not None:
        # Draft-target (TensorRT-LLM examples/draft_target_model/README.md): a copy of tensorrt_llm
        # on the draft engine, driven by the BLS.
        params = tensorrt_llm_parameters(opts) | {
            "gpt_model_path": opts.draft_engine_dir,
            "kv_cache_free_gpu_mem_fraction": opts.draft_kv_cache_free_gpu_mem_fraction}
        if _gpu_backend(opts):
            params["gpu_device_ids"] = opts.draft_gpu_device_ids
        models["tensorrt_llm_draft"] = ModelConfig(
            "tensorrt_llm_draft", mbs, _tensors(TENSORRT_LLM_INPUTS, opts), _tensors(TENSORRT_LLM_OUTPUTS, opts),
            backend="tensorrtllm" if _gpu_backend(opts) else "python",
            instance_group=[InstanceGroup(1, "KIND_CPU")], dynamic_batching=_batching(opts),
            decoupled=opts.decoupled, parameters=params)
        models["tensorrt_llm_bls"].parameters["tensorrt_llm_draft_model_name"] = "tensorrt_llm_draft"
    if opts.draft_ngram_size:
        models["tensorrt_llm_bls"].parameters["draft_ngram_size"] = opts.draft_ngram_size
    # The BLS assembles speculative responses itself: it needs tensorrt_llm's default for them.
    models["tensorrt_llm_bls"].parameters["exclude_input_in_output"] = opts.exclude_input_in_output
    return models
