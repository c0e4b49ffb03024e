"""An engine-flow deployment (a spec for target trtllm, as `toolchain import` writes it) moved to the LLM-API path.

TensorRT-LLM keeps only the LLM API after 1.2.1 (the PyTorch backend behind trtllm-serve and Triton's llmapi model).
This toolchain already serves both paths from one spec, so the move is mostly "the same spec, target llmapi": every
setting the LLM API has is written by llmapi/args.py (`llm_args`, its table DERIVED_FROM names the spec field each
LLM() argument comes from), and `to_llmapi` reads that table rather than restating it. What is left is what the
engine path has and the PyTorch backend does not, and each such setting becomes one `Loss` line saying what the user
loses and the nearest choice the LLM-API path offers:

* spec fields only the engine build or the tensorrtllm backend reads (ENGINE_ONLY: plugin flags, the BLS's
  instances, Triton's queue), lost where their value asks for something the PyTorch backend does not do;
* a quantization format or KV cache the PyTorch backend does not load (checkpoint/hf_quant.py `hf_quant_problem`,
  from the format rows' hf_why_not), replaced by the nearest row that loads and runs on the spec's GPU;
* a speculative mode without an LLM-API decoding type (speculative.py `refusal`), replaced by none, the nearest
  mode named; draft_target's BLS-only controls;
* LoRA adapters, which Triton's llmapi model of the 1.2 line cannot select (no LoRA input in its config.pbtxt);
* tensorrt_llm model parameters the spec has no field for (PARAMETERS), given by the importer from the original
  config.pbtxt: carried into llmapi.options where llm_args has the field, a Loss where it has none.

Each rule names the llm_args fields it rests on (`present`) and the ones whose absence it rests on (`absent`);
tests/test_import_llmapi.py holds them to the pinned facts (upstream/facts/llmapi.json, from
tensorrt_llm/llmapi/llm_args.py). `compare_plans` runs `toolchain plan`'s checks and prediction on both specs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from toolchain import upstream
from toolchain.checks.llmapi import DRAFT_CHECKPOINT
from toolchain.checks.preflight import build_context, run_checks
from toolchain.checks.render import report_dict
from toolchain.engine.trtllm import TRITON_DEFAULTS
from toolchain.archs import Family, get_family
from toolchain.errors import ToolchainError
from toolchain.gpus import resolve
from toolchain.llmapi.args import DERIVED_FROM
from toolchain.llmapi.repo import MODEL as LLMAPI_MODEL
from toolchain.plan.model import load_model
from toolchain.quant.formats import KV_CACHE, METHODS, STORAGE_BYTES, Format, KvFormat, active, tensor_bytes
from toolchain.spec import DeploymentSpec, QuantizationSection, spec_from_dict
from toolchain.speculative import DRAFT_ENGINE, MODES, NOTHING, SpeculativeMode, mode_of, refusal
from toolchain.targets import ENGINE, GPU, LLMAPI, TARGETS, named, require_target
from toolchain.triton.backend_params import PARSERS, is_unset, parameters


@dataclass(frozen=True)
class Loss:
    """One setting of the engine-flow deployment with no LLM-API counterpart."""

    setting: str
    """The spec path (quantization.kv_cache) or tensorrt_llm model parameter (gpt_model_type)."""
    value: Any
    what_is_lost: str
    nearest: str
    """The nearest choice the LLM-API path offers."""

    def line(self) -> str:
        return f"{self.setting}={self.value}: {self.what_is_lost} -> nearest: {self.nearest}"


def _never(_value: Any, _spec: DeploymentSpec) -> bool:
    return False


@dataclass(frozen=True)
class Rule:
    what: str
    nearest: str
    lost: Callable[[Any, DeploymentSpec], bool] = _never
    """Whether the value asks for something the LLM-API path does not do; never: the setting only drives the engine
    build or its server and is dropped without loss."""
    present: tuple[str, ...] = ()
    """llm_args fields (section.field for kv_cache_config, scheduler_config, cuda_graph_config) the rule names."""
    absent: tuple[str, ...] = ()
    """llm_args fields whose absence from the pinned release is why the setting is lost."""
    to: str | None = None
    """A parameter carried over: the spec path its value is written to (llmapi.options.<LLM() argument>)."""


_NO_BUILD = Rule("how trtllm-build runs; the LLM-API path builds nothing", "none needed")
# The engine-only spec fields: read by trtllm-build (engine/trtllm.py build_flags) or by the engine repository
# (triton/repo.py repo_options) and by nothing on the LLM-API path (llmapi/args.py llm_args, llmapi/repo.py).
# Dropped from the llmapi spec; a Loss where the value asks for something.
ENGINE_ONLY: dict[str, Rule] = {
    "build.trtllm_build": _NO_BUILD, "build.workers": _NO_BUILD, "build.mpi": _NO_BUILD,
    "build.host_memory_gib": _NO_BUILD, "build.log_level": _NO_BUILD,
    "serving.launch": Rule("how the engine's ranks start; LLM() starts its own rank workers", "none needed"),
    "build.gemm_plugin": Rule(
        "trtllm-build's GEMM plugin; the PyTorch backend picks its GEMM kernels from the checkpoint's format and "
        "has no plugin argument", "quantization.method (the kernels follow the loaded format)",
        lambda v, _: v != "auto", absent=("gemm_plugin",)),
    "build.context_fmha": Rule(
        "unfused context attention; the PyTorch backend's attention backend always runs fused attention",
        "llmapi.options.attn_backend", lambda v, _: v is False, present=("attn_backend",), absent=("context_fmha",)),
    "build.use_paged_context_fmha": Rule(
        "context attention outside the paged KV cache; the PyTorch backend's KV cache is always paged "
        "(kv_cache_config) with no such switch", "on (no setting)", lambda v, _: v is False,
        present=("kv_cache_config.tokens_per_block",), absent=("use_paged_context_fmha",)),
    "build.multiple_profiles": Rule(
        "TensorRT optimisation profiles per token count; the PyTorch backend builds no TensorRT engine",
        "llmapi.options.cuda_graph_config.batch_sizes (the batch sizes captured as CUDA graphs)",
        lambda v, _: v is True, present=("cuda_graph_config.batch_sizes",), absent=("multiple_profiles",)),
    "build.opt_num_tokens": Rule(
        "the TensorRT profile's tuning point; the PyTorch backend builds no TensorRT engine",
        "llmapi.options.cuda_graph_config.batch_sizes", lambda v, _: v is not None,
        present=("cuda_graph_config.batch_sizes",), absent=("opt_num_tokens",)),
    "build.use_fused_mlp": Rule(
        "separate gate and up GEMMs; no LLM() argument chooses MLP fusion", "none (the model's own fusion)",
        lambda v, _: v is False, absent=("use_fused_mlp",)),
    "build.reduce_fusion": Rule(
        "trtllm-build's all-reduce + residual + norm fusion flag; LLM() has no argument of that name",
        "llmapi.options.allreduce_strategy", lambda v, _: v is True, present=("allreduce_strategy",),
        absent=("reduce_fusion",)),
    "build.gather_context_logits": Rule(
        "prompt (context) logits in the output; TorchLlmArgs has gather_generation_logits only",
        "none in LLM() (gather_generation_logits returns the generated tokens' logits)", lambda v, _: v is True,
        present=("gather_generation_logits",), absent=("gather_context_logits",)),
    "parallelism.parallel_embedding": Rule(
        "the embedding table split over the tp ranks (use_parallel_embedding); LLM() has no such argument",
        "none (the PyTorch backend splits the embedding by its own rule)", lambda v, _: v is True,
        absent=("use_parallel_embedding",)),
    "parallelism.embedding_sharding_dim": Rule("the split of parallel_embedding (reported with it)", "none"),
    "serving.instance_count": Rule(
        "several instances of preprocessing, postprocessing and the BLS; the llmapi repository has one "
        "tensorrt_llm model and LLM() tokenizes inside", "llmapi.options.num_postprocess_workers (detokenizing "
        "processes)", lambda v, _: v > 1, present=("num_postprocess_workers",)),
    "serving.max_queue_delay_microseconds": Rule(
        "Triton's dynamic-batcher delay; the llmapi model has max_batch_size 0 (the executor batches)",
        "llmapi.options.batch_wait_timeout_ms", lambda v, _: v > 0, present=("batch_wait_timeout_ms",)),
    "serving.max_queue_size": Rule(
        "a bound on the requests waiting for admission; no LLM() argument bounds the executor's queue",
        "none (requests wait without bound)", lambda v, _: v > 0, absent=("max_queue_size",)),
    "serving.accumulate_tokens": Rule(
        "streamed responses carrying the text so far (tensorrt_llm_bls's accumulate_tokens); the llmapi model "
        "streams each new piece and has no such LLM() argument", "join the streamed pieces in the client",
        lambda v, _: v is True, absent=("accumulate_tokens",)),
    "serving.exclude_input_in_output": Rule(
        "a model-wide default for returning the prompt with the output; Triton's llmapi model takes it per "
        "request only", "send sampling_param_exclude_input_from_output with each request", lambda v, _: v is False,
        absent=("exclude_input_in_output",)),
    "speculative.draft_kv_cache_free_gpu_mem_fraction": Rule(
        "the draft engine's own KV-cache share; speculative_config (DraftTarget) has no such field",
        "serving.kv_cache_free_gpu_mem_fraction (kv_cache_config.free_gpu_memory_fraction)",
        lambda _, spec: mode_of(spec.speculative.mode).adds == DRAFT_ENGINE,
        present=("kv_cache_config.free_gpu_memory_fraction",)),
    "speculative.use_draft_logits": Rule(
        "the BLS comparing draft and target logits; LLM() verifies the draft tokens itself",
        "token acceptance (DraftTarget's own)", lambda v, _: v is True),
}
# Spec fields the LLM-API path reads as they are, beside those written through llm_args (`counterparts`): the Triton
# and OpenAI servers, the workload, the GPU, Dynamo, the llmapi section and the rest of quantization (convert's HF
# export reads it). With ENGINE_ONLY and the fields `to_llmapi` rewrites (REWRITTEN) they cover every spec field
# (tests/test_import_llmapi.py), so a new field gets its place here.
CARRIED = ("name", "parallelism.gpus", "serving.host", "serving.http_port", "serving.grpc_port", "serving.metrics_port",
           "serving.metrics_host", "serving.admin_key_file", "serving.admin_key_env", "serving.tritonserver",
           "serving.startup_timeout_s", "serving.engine_threads", "serving.oversubscribe", "serving.replicas",
           "validation", "gpu", "quantization", "llmapi", "dynamo")
REWRITTEN = ("target", "build.kv_cache_reuse", "quantization.method", "quantization.kv_cache", "speculative.mode",
             "validation.workload.endpoint")
# Engine-repository models the workload may name; the llmapi repository has one model, which takes text.
ENGINE_ENDPOINTS = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")

# tensorrt_llm model parameters (config.pbtxt) and what each becomes. SPEC_HELD: the spec has a field for it (the
# importer writes that field; triton/repo.py and engine/trtllm.py triton_parameters render it back), so the field's
# own mapping above applies. PLUMBING: where the engine, tokenizer, workers and GPUs are, which the LLM-API
# deployment settles itself. The rest are rules: carried (`to`) or lost. Every parameter of the pinned backend
# (upstream/facts/backend_parameters.json, model_templates.json) is in one of the three.
SPEC_HELD = frozenset({
    "max_tokens_in_paged_kv_cache", "kv_cache_free_gpu_mem_fraction", "enable_kv_cache_reuse", "batch_scheduler_policy",
    "max_beam_width", "enable_chunked_context", "exclude_input_in_output", "guided_decoding_backend",
    "xgrammar_tokenizer_info_path", "decoding_mode", "medusa_choices", "eagle_choices", "lookahead_window_size",
    "lookahead_ngram_size", "lookahead_verification_set_size", "lora_cache_optimal_adapter_size",
    "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes",
    "lora_prefetch_dir", "tokenizer_dir", "gpt_model_path"})
PLUMBING = frozenset({"num_nodes", "participant_ids", "gpu_device_ids", "worker_path", "executor_worker_path",
                      "recv_poll_period_ms", "stats_check_period_ms", "encoder_model_path",
                      "FORCE_CPU_ONLY_INPUT_TENSORS"})


def _changed(name: str) -> Callable[[Any, DeploymentSpec], bool]:
    """Set to other than what the engine path writes by default (engine/trtllm.py TRITON_DEFAULTS)."""
    return lambda v, _: v is not None and v != TRITON_DEFAULTS.get(name)


def _carry(to: str) -> Rule:
    field = to.removeprefix("llmapi.options.")
    return Rule("carried", to, present=(field,), to=to)


PARAMETERS: dict[str, Rule] = {
    # KvCacheConfig fields (llm_args.py), not derived from the spec, so llmapi.options may set them.
    "kv_cache_host_memory_bytes": _carry("llmapi.options.kv_cache_config.host_cache_size"),
    "kv_cache_onboard_blocks": _carry("llmapi.options.kv_cache_config.onboard_blocks"),
    "sink_token_length": _carry("llmapi.options.kv_cache_config.sink_token_length"),
    "cross_kv_cache_fraction": _carry("llmapi.options.kv_cache_config.cross_kv_cache_fraction"),
    "iter_stats_max_iterations": _carry("llmapi.options.iter_stats_max_iterations"),
    "request_stats_max_iterations": _carry("llmapi.options.request_stats_max_iterations"),
    # model.yaml's triton_config (llmapi/args.py triton_config), the spec's own field.
    "cancellation_check_period_ms": Rule("carried", "llmapi.cancellation_check_period_ms",
                                         to="llmapi.cancellation_check_period_ms"),
    "gpt_model_type": Rule(
        "static batching (V1): a batch runs to completion before the next is admitted; the PyTorch executor "
        "batches in flight only", "in-flight batching with serving.batch_scheduler_policy guaranteed_no_evict "
        "(scheduler_config.capacity_scheduler_policy)", lambda v, _: str(v).upper() == "V1",
        present=("scheduler_config.capacity_scheduler_policy",)),
    "max_attention_window_size": Rule(
        "one attention window for every layer, below max_seq_len; the LLM-API path writes "
        "kv_cache_config.max_attention_window from the model's config.json (its sliding windows) and "
        "llmapi.options may not set it", "limits.max_seq_len (cap the sequence), or the model's own windows",
        lambda v, spec: bool(v) and min(v) < spec.limits.max_seq_len,
        present=("kv_cache_config.max_attention_window",)),
    "multi_block_mode": Rule(
        "multi-block attention turned off; no LLM() argument (the attention backend decides)", "none",
        _changed("multi_block_mode"), absent=("multi_block_mode",)),
    "enable_context_fmha_fp32_acc": Rule(
        "FP32 accumulation in context attention; no LLM() argument", "none",
        _changed("enable_context_fmha_fp32_acc"), absent=("enable_context_fmha_fp32_acc",)),
    "normalize_log_probs": Rule(
        "unnormalised log probabilities in the output; no LLM() argument", "none",
        lambda v, _: v is False, absent=("normalize_log_probs",)),
    "gpu_weights_percent": Rule(
        "weight streaming (only this share of the weights on the GPU); the PyTorch backend has no argument for it",
        "parallelism.tp (more GPUs) or a smaller quantization.method", _changed("gpu_weights_percent"),
        absent=("gpu_weights_percent",)),
    "speculative_decoding_fast_logits": Rule(
        "the draft engine handing its logits to the target directly (orchestrator mode); LLM() runs the draft "
        "itself", "speculative.mode draft_target (speculative_config DraftTarget)",
        _changed("speculative_decoding_fast_logits"), absent=("speculative_decoding_fast_logits",)),
    # Defaults of the PyTorch backend cover these: CUDA graphs are captured (cuda_graph_config's default factory)
    # and scheduling overlaps the step (disable_overlap_scheduler false).
    "cuda_graph_mode": Rule("CUDA graphs, on by default (cuda_graph_config)", "none needed",
                            present=("cuda_graph_config",)),
    "cuda_graph_cache_size": Rule("CUDA graphs, on by default (cuda_graph_config)", "none needed",
                                  present=("cuda_graph_config.max_batch_size",)),
    "enable_trt_overlap": Rule("overlap scheduling, on by default", "none needed",
                               present=("disable_overlap_scheduler",)),
}


# ---- the mapping ------------------------------------------------------------------------------------------------
def counterparts() -> dict[str, str]:
    """Spec path -> the LLM() argument written from it (llmapi/args.py DERIVED_FROM, reversed), plus model.yaml's
    triton_config.decoupled from serving.streaming (args.py triton_config)."""
    out = {src: arg for arg, src in DERIVED_FROM.items() if " " not in src and src != "target"}
    out["serving.streaming"] = "triton_config.decoupled"
    return out


def _get(data: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        data = getattr(data, key)
    return data


def _pop(data: dict, dotted: str) -> None:
    """Remove `dotted` from the raw mapping, and its section when that is left empty."""
    *parents, last = dotted.split(".")
    node = data
    chain = []
    for key in parents:
        if not isinstance(node.get(key), dict):
            return
        chain.append((node, key))
        node = node[key]
    node.pop(last, None)
    for parent, key in reversed(chain):
        if parent[key]:
            break
        del parent[key]


def _put(data: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def to_llmapi(spec_dict: dict, parameters: Mapping[str, str] | None = None,
              base: Path | str = ".") -> tuple[dict, list[Loss]]:
    """The deployment of `spec_dict` (a spec of an engine target, as loaded from build/*.yaml) as a spec dict for
    target llmapi, and the settings with no LLM-API counterpart. `parameters`: the original tensorrt_llm model's
    config.pbtxt parameters (name -> string value) where the importer has them, for those the spec has no field
    for. `base`: the directory the spec's relative paths are relative to (only validation reads it)."""
    spec = spec_from_dict(copy.deepcopy(spec_dict), Path(base).resolve(), "the imported spec")
    require_target(spec, f"target {spec.target} is already on the LLM-API path",
                   f"pass a spec of target {named(ENGINE, GPU)}", path=ENGINE)
    out = copy.deepcopy(spec_dict)
    out["target"] = named(LLMAPI, GPU)
    losses = _family_losses(spec, out)
    for path, rule in ENGINE_ONLY.items():
        value = _get(spec, path)
        if rule.lost(value, spec):
            losses.append(Loss(path, value, rule.what, rule.nearest))
        _pop(out, path)
    losses += _quantization(spec, out)
    losses += _speculative(spec, out)
    losses += _lora(spec)
    workload = spec.validation.workload
    if workload.endpoint in ENGINE_ENDPOINTS and workload.protocol.startswith("triton"):
        _put(out, "validation.workload.endpoint", LLMAPI_MODEL)
    losses += _parameters(spec, parameters or {}, out)
    return out, losses


def _family_losses(spec: DeploymentSpec, out: dict) -> list[Loss]:
    """The family's own rules for the LLM-API path: a family it has no model for is refused (llmapi.architecture's
    rule, `llmapi_problem` unquantized), and one it runs without KV cache reuse gets reuse off (llmapi.kv-reuse's
    rule; llmapi/args.py writes enable_partial_reuse false for it)."""
    found = _family(spec)
    if found is None:
        return []
    family, params = found
    why = family.llmapi_problem(params, spec.parallelism.tp, spec.parallelism.pp, False)
    if why is not None:
        raise ToolchainError(f"this deployment cannot move to the LLM-API path: {why}")
    if family.llmapi_no_reuse is None or not spec.build.kv_cache_reuse:
        return []
    _put(out, "build.kv_cache_reuse", False)
    return [Loss("build.kv_cache_reuse", True, f"KV cache block reuse across requests sharing a prefix; the PyTorch "
                 f"backend runs {params.architecture} without it ({family.llmapi_no_reuse})",
                 "off (kv_cache_config.enable_block_reuse false)")]


# ---- quantization -----------------------------------------------------------------------------------------------
def _sm(spec: DeploymentSpec) -> int | None:
    device = resolve(spec)
    return device.sm if device is not None else None


def _weight_bytes(row: Format) -> float:
    """Bytes per weight element once loaded (the format's built `weight` tensor; the model's half type is 2)."""
    weight = [t for t in row.built if t.suffix == "weight"]
    return tensor_bytes(tuple(weight), 128, 128, 128, 2) / (128 * 128)


def _kv_bytes(row: KvFormat) -> float:
    return STORAGE_BYTES[row.storage] if row.storage else 2


def _refused(method: str, kv: str) -> str | None:
    """Why the PyTorch backend does not load this pair (checkpoint/hf_quant.py hf_quant_problem), or None."""
    from toolchain.checkpoint.hf_quant import hf_quant_problem  # imports torch

    if not active(method, kv):
        return None
    return hf_quant_problem(QuantizationSection(method=method, kv_cache=kv))


def _quantization(spec: DeploymentSpec, out: dict) -> list[Loss]:
    q, sm = spec.quantization, _sm(spec)
    family_refuses = _family_refusal(spec)
    if _refused(q.method, q.kv_cache) is None and not family_refuses(q.method, q.kv_cache):
        return []

    def runs(row: Format | KvFormat) -> bool:
        return sm is None or row.refused_on(sm) is None

    src_w, src_kv = _weight_bytes(METHODS[q.method]), _kv_bytes(KV_CACHE[q.kv_cache])
    pairs = [(m, k) for m in METHODS.values() for k in KV_CACHE.values()
             if m.ready_on(LLMAPI) and runs(m) and runs(k) and _refused(m.name, k.name) is None
             and not family_refuses(m.name, k.name)]
    # Nearest: the loaded weight bytes closest to the original's, then the KV bytes; table order breaks ties.
    method, kv = min(pairs, key=lambda p: (abs(_weight_bytes(p[0]) - src_w), abs(_kv_bytes(p[1]) - src_kv)))
    losses = []
    for field, old, new in (("method", METHODS[q.method], method), ("kv_cache", KV_CACHE[q.kv_cache], kv)):
        if old.name == new.name:
            continue
        alone = (old.name, "none") if field == "method" else ("none", old.name)
        why = _refused(*alone) or _family_why(spec, *alone) or \
            f"not loaded together with quantization.{_other(field)}={getattr(q, _other(field))}"
        losses.append(Loss(f"quantization.{field}", old.name, why, _describe(new, sm)))
        _put(out, f"quantization.{field}", new.name)
    return losses


def _family(spec: DeploymentSpec) -> tuple[Family, Any] | None:
    """The family and parameters of the spec's model (None when its config.json is not readable here: then no
    family rule rules anything out, and the llmapi.* checks say what they can)."""
    try:
        model = load_model(spec.model.checkpoint)
    except ToolchainError:
        return None
    return get_family(model.params.architecture), model.params


def _family_refusal(spec: DeploymentSpec) -> Callable[[str, str], bool]:
    """Whether the model's family refuses a (method, kv_cache) pair: its quantization_refusal (archs/common.py,
    which the arch.quantization check asks) or, quantized, its llmapi_problem (the llmapi.architecture check's)."""
    found = _family(spec)
    if found is None:
        return lambda _method, _kv: False
    family, params = found
    par = spec.parallelism

    def refuses(method: str, kv: str) -> bool:
        return (family.quantization_refusal(params, method, kv, None) is not None
                or family.llmapi_problem(params, par.tp, par.pp, active(method, kv)) is not None)
    return refuses


def _family_why(spec: DeploymentSpec, method: str, kv: str) -> str | None:
    found = _family(spec)
    if found is None:
        return None
    family, params = found
    refusal = family.quantization_refusal(params, method, kv, None)
    if refusal is not None:
        return refusal.why
    return family.llmapi_problem(params, spec.parallelism.tp, spec.parallelism.pp, active(method, kv))


def _other(field: str) -> str:
    return "kv_cache" if field == "method" else "method"


def _describe(row: Format | KvFormat, sm: int | None) -> str:
    algo = f" ({row.quant_algo})" if row.quant_algo else " (unquantized)"
    gpus = f", which needs SM {row.min_sm} or newer" if row.min_sm else ""
    where = f"; the spec's GPU is SM {sm}" if sm else "; gpu.sm unknown, so no GPU was ruled out"
    return f"{row.name}{algo}{gpus}{where}"


# ---- speculative decoding ---------------------------------------------------------------------------------------
def nearest_modes(row: SpeculativeMode) -> list[SpeculativeMode]:
    """The LLM-API modes nearest to `row`, best first: the same kind of draft; for drafting networks in the
    checkpoint (Medusa heads, EAGLE-1/2), which the PyTorch backend has none of, a trained draft checkpoint
    (speculative.draft_model), loaded beside the target (adds nothing) first; then the modes that need no draft.
    A mode drafting with the model's own layers (mtp) is not offered: the original model has none."""
    llmapi = TARGETS[named(LLMAPI, GPU)]
    fit = [m for m in MODES.values() if m.name != "none" and m.runs_on(llmapi) and not m.drafts_in_target]
    trained = row.draft == "heads"
    return sorted(fit, key=lambda m: (m.draft != row.draft and not (trained and m.draft == "draft_model"),
                                      m.adds != NOTHING))


def _mode_text(m: SpeculativeMode) -> str:
    need = f" with speculative.draft_model ({DRAFT_CHECKPOINT.get(m.name, 'its draft checkpoint')})" \
        if m.draft == "draft_model" else ""
    return f"speculative.mode {m.name}{need} (speculative_config decoding_type {m.decoding_type})"


def _speculative(spec: DeploymentSpec, out: dict) -> list[Loss]:
    sp = spec.speculative
    row = mode_of(sp.mode)
    llmapi = TARGETS[named(LLMAPI, GPU)]
    why = refusal(sp.mode, llmapi)
    if why is not None:
        out.pop("speculative", None)  # mode none: what drafted (heads, tree, lookahead sizes) has no use there
        return [Loss("speculative.mode", sp.mode, row.why_not.get(LLMAPI, why),
                     " or ".join(_mode_text(m) for m in nearest_modes(row)[:2]))]
    if row.adds == DRAFT_ENGINE:
        return [Loss("speculative.mode", sp.mode, "Triton's draft-target BLS (tensorrt_llm_draft beside "
                     "tensorrt_llm, per-request num_draft_tokens and use_draft_logits); LLM() runs the draft "
                     "itself and its draft length is fixed at start", _mode_text(row) +
                     f", max_draft_len {sp.max_draft_len}")]
    return []


# ---- LoRA ---------------------------------------------------------------------------------------------------------
def _lora(spec: DeploymentSpec) -> list[Loss]:
    """Triton's llmapi model of the 1.2 line has no LoRA input (llmapi/repo.py LORA_README), so adapters are chosen
    through the OpenAI server only; the facts' input list says whether that still holds."""
    inputs = upstream.facts("llmapi")["triton_model"]["inputs"]
    if not spec.lora.enabled or any(name.startswith("lora") for name in inputs):
        return []
    names = ", ".join(spec.lora.adapters) or "sent per request"
    return [Loss("lora.adapters", names, "choosing an adapter per Triton request (the tensorrt_llm model's "
                 "lora_task_id, lora_weights, lora_config inputs); Triton's llmapi model has no LoRA input, so its "
                 "requests run the base model", "trtllm-serve's lora_request body field (llmapi.openai_port), "
                 "with lora_config and peft_cache_config from the lora section")]


# ---- tensorrt_llm model parameters ------------------------------------------------------------------------------
def _parameters(spec: DeploymentSpec, given: Mapping[str, str], out: dict) -> list[Loss]:
    parse = {p.name: p.parse for p in parameters()}
    losses = []
    for name, text in given.items():
        if name in SPEC_HELD or name in PLUMBING or is_unset(text, name):
            continue
        rule = PARAMETERS.get(name)
        if rule is None:
            losses.append(Loss(name, text, "not a tensorrt_llm parameter of the pinned release's templates", "none"))
            continue
        try:
            value = PARSERS[parse.get(name, "string")](text)
        except ValueError:
            losses.append(Loss(name, text, "a value the tensorrtllm backend would not read", "none"))
            continue
        if rule.to is not None:
            if value != TRITON_DEFAULTS.get(name):
                _put(out, rule.to, value)
        elif rule.lost(value, spec):
            losses.append(Loss(name, text, rule.what, rule.nearest))
    return losses


# ---- both plans ---------------------------------------------------------------------------------------------------
def compare_plans(trtllm_spec: DeploymentSpec, llmapi_spec: DeploymentSpec, workspace=None) -> dict[str, dict]:
    """`toolchain plan`'s report (memory, verdict, checks, performance prediction) of each spec, keyed by target."""
    plans: dict[str, dict] = {}
    for spec in (trtllm_spec, llmapi_spec):
        ctx = build_context(spec, "plan", workspace)
        plans[spec.target] = report_dict(ctx, run_checks(ctx))
    return plans


# What the side-by-side table shows of each report: (label, key path in report_dict's mapping, dotted).
COMPARED = (("weights", "weight_format"), ("KV cache dtype", "kv_cache_dtype"),
            ("KV tokens", "kv_tokens_capacity"), ("sequences at once", "concurrency"), ("fits", "fits"),
            ("max output tok/s", "performance.max_output_tokens_per_s"), ("TTFT ms", "performance.ttft_ms"),
            ("TPOT ms", "performance.tpot_ms"), ("failed checks", "failed_checks"))


def side_by_side(plans: dict[str, dict]) -> str:
    """The plans as a table, one row per COMPARED entry, then each verdict and what each prediction rests on."""
    names = list(plans)
    rows = [("", *names)] + [(label, *(_cell(_at(plans[n], key)) for n in names)) for label, key in COMPARED]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, width, strict=True)).rstrip() for row in rows]
    lines += [f"{n}: {plans[n]['verdict']}" for n in names]
    lines += [f"{n} predicted from: {basis}" for n in names if (basis := _at(plans[n], "performance.basis"))]
    return "\n".join(lines)


def _at(report: dict, dotted: str) -> Any:
    value: Any = report
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
