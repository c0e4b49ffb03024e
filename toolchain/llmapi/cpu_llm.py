"""`CpuLLM`: the CPU stand-in for `tensorrt_llm.LLM` (PyTorch backend, TensorRT-LLM 1.2.1).

Constructed from the same keyword arguments (the keys of Triton's `model.yaml`
or of a `trtllm-serve --extra_llm_api_options` file) and refusing what `TorchLlmArgs` refuses:
an unknown key, a missing `model`, a backend other than pytorch. Like the
PyTorch backend it loads the Hugging Face checkpoint named by `model` and shards
it at load time: here by running this toolchain's own convert and CPU build,
so the CPU engine executes every TP/PP rank's shard. That work goes into a
private directory, or into the one $TOOLCHAIN_CPU_LLM_DIR names: `convert` of
a target-llmapi-cpu spec prepares it there, and the servers a deployment starts
(Triton's llmapi model, the OpenAI server) find it current and only load it.
Arguments that only tune GPU execution (CUDA graphs, attention backends, ...)
are accepted and have no effect here; arguments that change what is computed
and that the CPU engine cannot honour are refused, never ignored.

`generate_async` mirrors `LLM.generate_async`: a prompt (text or token ids),
`SamplingParams` under the LLM API's names and defaults (`max_tokens` 32,
`exclude_input_from_output` True, stop strings as stop words), and
`RequestOutput`s whose `outputs[0].text` is cumulative, as the LLM API's is
(`text_diff` gives the new part).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from toolchain.errors import ToolchainError
from toolchain.llmapi.args import llm_args_problem, windows_problem
from toolchain.llmapi.guided import GuidedDecodingParams
from toolchain.llmapi.logprobs import prompt_logprobs, token_logprobs
from toolchain.llmapi.lora import AdapterLoader, LoRARequest, engine_lora_section
from toolchain.llmapi.outputs import (CompletionOutput, KvCacheMetrics, RequestOutput, RequestPerfMetrics,
                                      beam_outputs, generate_all, keep_best)
from toolchain.spec import DeploymentSpec
from toolchain.targets import LLMAPI
from toolchain.engine.build import run_build
from toolchain.engine.cpu.beams import children
from toolchain.workspace import Workspace
from toolchain.remote_code import auto_tokenizer

# Names a directory the convert and CPU build are done in (and reused from, when current), shared by
# every process of one deployment; set by the launchers of toolchain/pipeline.py.
ENGINE_DIR_ENV = "TOOLCHAIN_CPU_LLM_DIR"

# LLM-API scheduler policies the CPU batcher implements (capacity_scheduler_policy).
POLICIES = {"GUARANTEED_NO_EVICT": "guaranteed_no_evict", "MAX_UTILIZATION": "max_utilization"}


# A guided request to an LLM made without guided_decoding_backend (the LLM API keeps guided decoding off unless it is
# set; trtllm-serve answers such a request "Guided decoding is not enabled for this server", as clients quote it).
GUIDED_OFF = ("Guided decoding is not enabled for this LLM; create it with guided_decoding_backend='xgrammar' "
              "(spec: serving.guided_decoding_backend)")


class LlmArgsError(ValueError):
    """An argument `TorchLlmArgs` (or this host) refuses; the message names the key."""


@dataclass
class SamplingParams:
    """The LLM API's `SamplingParams` fields this stand-in reads, with the LLM API's defaults
    (tensorrt_llm/sampling_params.py). Others are refused by `from_kwargs` when not neutral."""

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    end_id: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None  # each generated token's log-prob and its `logprobs` likeliest alternatives
    prompt_logprobs: int | None = None  # each prompt token's log-prob (the first has none)
    guided_decoding: GuidedDecodingParams | None = None
    length_penalty: float | None = None  # beam search (None: 1.0)
    early_stopping: int | None = None  # beam search: 1 ends once beam-width beams finished, 0 HF's heuristic

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise LlmArgsError(f"SamplingParams has no field {unknown[0]!r} on the CPU engine")
        params = cls(**{k: v for k, v in kwargs.items() if v is not None or k in ("stop",)})
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        # The LLM API's rule (SamplingParams._greedy_decoding).
        return not self.use_beam_search and self.top_k in (None, 1) and self.top_p in (None, 0.0)

    def validate(self) -> None:
        best_of = self.best_of or self.n
        if best_of < self.n:
            raise LlmArgsError(f"best_of ({best_of}) cannot be less than n ({self.n})")
        if best_of > 1 and self.greedy:
            raise LlmArgsError("Greedy decoding in the LLM API does not allow multiple returns. Please set to "
                               f"best_of=1, got best_of={best_of}.")
        if self.beam_width > 1 and (self.logprobs or self.prompt_logprobs is not None):
            raise LlmArgsError("use_beam_search with logprobs above 0 or prompt_logprobs is not supported by the CPU "
                               "engine: a beam carries its chosen tokens' log-probs only; set logprobs 0 or leave it unset")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
                raise LlmArgsError(f"{name} must be a non-negative integer, got {k!r}")
        if self.guided_decoding is not None:
            if isinstance(self.guided_decoding, dict):  # from a JSON request body
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            problem = self.guided_decoding.problem()
            if problem:
                raise LlmArgsError(problem)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise LlmArgsError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")

    @property
    def beam_width(self) -> int:
        """The LLM API's rule (SamplingParams doc): with use_beam_search, best_of is the beam width when given,
        else n; n sequences are returned. 1: no beam search."""
        return (self.best_of or self.n) if self.use_beam_search else 1

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [str(s) for s in self.stop]


class RequestHandle:
    """What `generate_async` returns: `abort()` cancels the request (its last output says "cancelled")."""

    def __init__(self, llm: "CpuLLM", request_ids: list[int]):
        self._llm, self.request_id, self._children = llm, request_ids[0], request_ids

    def abort(self) -> None:
        for rid in self._children:  # every sequence of an n > 1 request
            self._llm._batcher.cancel(rid)


def _int(args: dict, key: str, default: int | None) -> int | None:
    value = args.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LlmArgsError(f"{key} must be a positive integer, got {value!r}")
    return value


def _section(args: dict, key: str) -> dict:
    value = args.get(key) or {}
    if not isinstance(value, dict):
        raise LlmArgsError(f"{key} must be a mapping, got {type(value).__name__}")
    return value


def validate_llm_args(args: dict[str, Any]) -> Path:
    """Refuse what TorchLlmArgs refuses; returns the model directory."""

    problem = llm_args_problem(args)
    if problem:
        raise LlmArgsError(problem)
    model_dir = Path(str(args["model"])).expanduser()
    if not (model_dir / "config.json").is_file():
        raise LlmArgsError(f"model {str(args['model'])!r} is not a Hugging Face checkpoint directory (no config.json)")
    return model_dir


def engine_spec(args: dict[str, Any]):
    """The CPU engine these LLM() arguments ask for, as a target-cpu spec of the same limits."""

    model_dir = validate_llm_args(args)
    backend = args.get("backend")
    if backend not in (None, "pytorch"):
        raise LlmArgsError(f"backend {backend!r}: the LLM-API path runs the PyTorch backend; set backend: pytorch")
    kv = _section(args, "kv_cache_config")
    if kv.get("dtype", "auto") == "fp8" and not _has_fp8_kv_scales(model_dir):
        # The scales come from the checkpoint (as on the PyTorch backend); the CPU engine cannot calibrate them.
        raise LlmArgsError(f"kv_cache_config.dtype 'fp8' needs a checkpoint carrying FP8 KV-cache scales (k_scale / "
                           f"v_scale), which {model_dir} lacks; export it with quantization.kv_cache fp8, or use auto")
    if kv.get("dtype", "auto") not in ("auto", None, "fp8"):
        raise LlmArgsError(f"kv_cache_config.dtype {kv['dtype']!r} is not supported on the CPU engine yet; use auto")
    _check_attention_dp(args)
    speculative = _speculative(args)
    sched = _section(args, "scheduler_config")
    policy = sched.get("capacity_scheduler_policy", "GUARANTEED_NO_EVICT")
    if policy not in POLICIES:
        raise LlmArgsError(f"scheduler_config.capacity_scheduler_policy {policy!r} is not supported on the CPU "
                           f"engine; use {' or '.join(POLICIES)}")
    max_seq = _int(args, "max_seq_len", None) or _positions(model_dir)
    if kv.get("max_attention_window") is not None:
        _check_windows(kv["max_attention_window"], model_dir, max_seq)
    max_input = _int(args, "max_input_len", None) or max_seq - 1
    guided = _guided_backend(args)
    try:
        lora = engine_lora_section(args.get("lora_config"), args.get("peft_cache_config"))
    except ValueError as err:
        raise LlmArgsError(str(err)) from None
    try:
        return DeploymentSpec.model_validate({**({"lora": lora} if lora else {}),
            "name": "llm", "target": "cpu",
            "model": {"checkpoint": str(model_dir.resolve()),
                      "tokenizer": str(Path(args.get("tokenizer") or model_dir).expanduser().resolve()),
                      "dtype": args.get("dtype") or "auto",
                      # LLM()'s own argument (BaseLlmArgs.trust_remote_code, default False).
                      "trust_remote_code": args.get("trust_remote_code", False)},
            "parallelism": {"tp": _int(args, "tensor_parallel_size", 1), "pp": _int(args, "pipeline_parallel_size", 1),
                            "moe_tp": _int(args, "moe_tensor_parallel_size", None),
                            "moe_ep": _int(args, "moe_expert_parallel_size", None)},
            "limits": {"max_batch_size": _int(args, "max_batch_size", 2048), "max_input_len": max_input,
                       "max_seq_len": max_seq, "max_num_tokens": _int(args, "max_num_tokens", 8192)},
            "build": {"tokens_per_block": _int(kv, "tokens_per_block", 32),
                      "kv_cache_reuse": bool(kv.get("enable_block_reuse", True)),
                      "chunked_context": bool(args.get("enable_chunked_prefill", False)),
                      # LLM()'s max_beam_width (None: one beam) is the CPU build's widest beam search.
                      "max_beam_width": _int(args, "max_beam_width", None) or 1},
            "speculative": speculative,
            "serving": {"kv_cache_free_gpu_mem_fraction": kv.get("free_gpu_memory_fraction", 0.9),
                        "max_tokens_in_paged_kv_cache": kv.get("max_tokens"),
                        "batch_scheduler_policy": POLICIES[policy], "guided_decoding_backend": guided},
        })
    except Exception as err:  # pydantic's message names the field
        raise LlmArgsError(f"LLM arguments the CPU engine cannot run: {str(err).splitlines()[0]}") from None


def _guided_backend(args: dict[str, Any]) -> str | None:
    """LLM()'s guided_decoding_backend (BaseLlmArgs: Optional[Literal['xgrammar', 'llguidance']], default None:
    guided decoding off, facts/llmapi.json llm_args). The CPU engine guides with XGrammar only."""
    backend = args.get("guided_decoding_backend")
    if backend == "llguidance":
        raise LlmArgsError("guided_decoding_backend 'llguidance' is not run by the CPU engine, which guides with "
                           "XGrammar only; set guided_decoding_backend: xgrammar")
    if backend not in (None, "xgrammar"):
        raise LlmArgsError(f"guided_decoding_backend must be 'xgrammar' or 'llguidance' (unset: off), got {backend!r}")
    return backend


# MTPDecodingConfig's fields that change what is drafted or accepted, at the values the CPU engine runs (facts
# llmapi.json speculative.types.MTP): greedy acceptance only, no thinking-phase relaxation.
_MTP_NEUTRAL = {"use_relaxed_acceptance_for_thinking": False, "relaxed_topk": 1, "relaxed_delta": 0.0}


def _speculative(args: dict[str, Any]) -> dict:
    """The spec's speculative section for LLM()'s speculative_config: MTPDecodingConfig with one MTP layer (the CPU
    engine drafts one token a step with the model's own, engine/cpu/mtp.py: vanilla MTP and MTP-Eagle draft the same
    with one layer), refused otherwise in one line."""
    cfg = _section(args, "speculative_config")
    if not cfg:
        return {"mode": "none"}
    kind = cfg.get("decoding_type")
    if kind != "MTP":
        raise LlmArgsError(f"speculative_config decoding_type {kind!r} is not run by the CPU engine (target "
                           "llmapi-cpu), which runs MTP only; remove it, or deploy with target llmapi on a GPU host")
    layers = cfg.get("num_nextn_predict_layers", 1)
    if layers != 1 or cfg.get("max_draft_len") not in (None, 1):
        raise LlmArgsError(f"speculative_config (MTP) num_nextn_predict_layers {layers!r}: the CPU engine drafts one "
                           "token a step with the model's first MTP layer; set num_nextn_predict_layers: 1")
    for key, neutral in _MTP_NEUTRAL.items():
        if cfg.get(key, neutral) != neutral:
            raise LlmArgsError(f"speculative_config (MTP) {key} {cfg[key]!r} is not supported by the CPU engine, which "
                               f"accepts drafts greedily only; remove it (default {neutral!r})")
    return {"mode": "mtp", "max_draft_len": 1}


def _check_attention_dp(args: dict[str, Any]) -> None:
    """enable_attention_dp is accepted and changes no result here: with it each rank runs the whole attention over
    its own requests and the experts gather every rank's tokens (tensorrt_llm/_torch/modules/attention.py takes
    tp_size 1 under it; fused_moe all-gathers), which computes each request's tokens by the same math as the tp split
    of attention the CPU engine runs, up to the order of float additions. What it changes is where the work and the
    KV sit, and each rank scheduling its own max_batch_size requests: placement, which `plan` accounts for. Refused
    as upstream refuses: a non-bool value (the field is `bool`), and enable_lm_head_tp_in_adp without it
    (tensorrt_llm/mapping.py MappingBase.__init__: "enable_lm_head_tp_in_adp requires enable_attention_dp")."""
    adp, lm_head_tp = args.get("enable_attention_dp", False), args.get("enable_lm_head_tp_in_adp", False)
    for key, value in (("enable_attention_dp", adp), ("enable_lm_head_tp_in_adp", lm_head_tp)):
        if not isinstance(value, bool):
            raise LlmArgsError(f"{key} must be true or false, got {value!r}")
    if lm_head_tp and not adp:
        raise LlmArgsError("enable_lm_head_tp_in_adp requires enable_attention_dp; set enable_attention_dp: true or "
                           "remove enable_lm_head_tp_in_adp")


def _check_windows(windows: Any, model_dir: Path, max_seq: int) -> None:
    """The CPU engine attends by the windows convert writes from config.json (runtime_defaults); LLM() would
    size and cut its KV cache by kv_cache_config.max_attention_window (llmapi/args.py attention_windows), so
    other windows are refused rather than silently not applied."""
    problem = windows_problem(windows, model_dir, max_seq)
    if problem:
        raise LlmArgsError(problem)


def _has_fp8_kv_scales(model_dir: Path) -> bool:
    """Whether `model_dir` is a ModelOpt HF-format export with an FP8 KV cache (per-layer k/v scales)."""
    from toolchain.checkpoint.hf_quant import read_hf_quant_format

    try:
        return read_hf_quant_format(model_dir)["kv_cache_quant_algo"] == "FP8"
    except (ToolchainError, ValueError, OSError):  # not that format: load_engine says why if it matters
        return False


def _positions(model_dir: Path) -> int:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 2048)


@contextlib.contextmanager
def _exclusive(directory: Path):
    """Holds `directory`'s lock: two processes preparing one shared directory take turns, and the
    second finds the first one's output current."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def prepare_engine(args: dict[str, Any], work_dir: Path) -> tuple[DeploymentSpec, Workspace]:
    """Converts and builds the CPU engine for LLM() arguments into `work_dir` (each stage reusing its
    output when current), as the PyTorch backend shards the checkpoint at load."""
    from toolchain.checkpoint.stage import run_convert

    spec = engine_spec(args)
    ws = Workspace(Path(work_dir))
    try:
        with _exclusive(Path(work_dir)):
            # Converted for the LLM-API path it stands in for: what the PyTorch backend loads pre-quantized
            # (FP8 block scales among it, which trtllm-build lacks) is imported for the CPU engine.
            run_convert(spec, ws, loaded_by=LLMAPI)
            run_build(spec, ws, converted=True)
    except ToolchainError as err:
        raise LlmArgsError(f"cannot load {spec.model.checkpoint}: {err}") from None
    return spec, ws


def shared_engine_dir() -> Path | None:
    """The deployment's shared engine directory ($TOOLCHAIN_CPU_LLM_DIR), if one is named."""
    value = os.environ.get(ENGINE_DIR_ENV)
    return Path(value) if value else None


def load_engine(args: dict[str, Any], work_dir: Path, num_threads: int | None = None):
    """(CpuEngine, SchedulerConfig, spec) for LLM() arguments: the checkpoint converted and
    sharded by this toolchain's own stages into `work_dir` (prepare_engine), then loaded."""
    from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SchedulerConfig

    spec, ws = prepare_engine(args, work_dir)
    s = spec.serving
    # TensorRT-LLM 1.2.1's PyTorch backend quantizes an FP8 KV cache with scale 1.0: TrtllmAttention
    # sets kv_cache_scaling_factor to [1.0] (tensorrt_llm/_torch/attention_backend/trtllm.py), and the
    # checkpoint's calibrated k_scale / v_scale reach qkv_proj.kv_scales only with TRTLLM_LOAD_KV_SCALES=1
    # (tensorrt_llm/_torch/modules/linear.py, FP8QDQLinearMethod: default "0" in the 1.2-era version the
    # code index holds, "1" in later ones), and attention passes those to the kernel for an NVFP4 KV cache
    # only (_torch/modules/attention.py, has_fp4_kv_cache). So the CPU stand-in ignores them too, whatever
    # that variable says: a CPU evaluation then predicts the GPU's output, not the engine path's (which
    # applies them as kv_cache_scaling_factor).
    engine = CpuEngine.load(ws.engine_dir(spec), num_threads=num_threads, kv_cache=KvCacheConfig(
        free_memory_fraction=s.kv_cache_free_gpu_mem_fraction, max_tokens=s.max_tokens_in_paged_kv_cache,
        enable_block_reuse=spec.build.kv_cache_reuse), unit_kv_scales=True,
        lora_host_bytes=spec.lora.cache.host_memory_bytes if spec.lora.enabled else None)
    scheduler = SchedulerConfig(policy=s.batch_scheduler_policy, enable_chunked_context=spec.build.chunked_context)
    return engine, scheduler, spec


class CpuLLM:
    """tensorrt_llm.LLM's constructor and generate_async on the CPU engine."""

    def __init__(self, model: str | Path | None = None, *, work_dir: Path | None = None,
                 num_threads: int | None = None, **kwargs: Any):
        from toolchain.engine.cpu import InflightBatcher
        from toolchain.engine.cpu.sampling import UnseededStream

        self.args = dict(kwargs, model=model)
        self._tmp = None
        work_dir = work_dir or shared_engine_dir()
        if work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="cpu-llm-")
            work_dir = Path(self._tmp.name)
        try:
            self.engine, scheduler, self.spec = load_engine(self.args, Path(work_dir), num_threads)
            # Before the batcher starts: a tokenizer refused here (remote code) leaves no thread behind.
            self.tokenizer = auto_tokenizer(self.spec.model.tokenizer_dir,
                                            trust_remote_code=self.spec.model.trust_remote_code)
        except BaseException:
            self._drop_tmp()
            raise
        self._batcher = InflightBatcher(self.engine, scheduler).start()
        self.lora = AdapterLoader(self.engine)  # LoRARequests' adapters, read on first use (llmapi/lora.py)
        self._ids = itertools.count(1)
        self._seeds = UnseededStream()  # the PyTorch backend's shared generator: unseeded requests differ

    # ---- requests -------------------------------------------------------------------------------------------
    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def _stops(self, sp: SamplingParams) -> list[tuple[int | str, list[int]]]:
        """(stop_reason, its token ids) per stop token id, then per stop string, tokenized once per
        request (as the LLM API's SamplingParams._get_stop_reasons_and_words pairs them)."""
        stops: list[tuple[int | str, list[int]]] = [(int(t), [int(t)]) for t in sp.stop_token_ids or ()]
        stops += [(text, self.encode(text, add_special_tokens=False)) for text in sp.stop_strings()]
        if any(not word for _, word in stops):
            raise LlmArgsError("a stop string encodes to no tokens; remove the empty stop string")
        return stops

    def _engine_params(self, sp: SamplingParams, stops: list[tuple[int | str, list[int]]]):
        from toolchain.engine.cpu import SamplingParams as EngineParams

        end_id = sp.end_id if sp.end_id is not None else self.tokenizer.eos_token_id
        guide = sp.guided_decoding.guide() if sp.guided_decoding is not None else None
        if guide is not None and self.spec.serving.guided_decoding_backend is None:
            raise LlmArgsError(GUIDED_OFF)
        if guide is not None and self.engine.guided is None:
            # The PyTorch backend builds its XGrammar matcher from the model's tokenizer; so does the engine's.
            from toolchain.engine.cpu.guided import GuidedDecoder

            self.engine.guided = GuidedDecoder.from_tokenizer_dir(
                self.spec.model.tokenizer_dir, self.engine.vocab_size, trust_remote_code=self.spec.model.trust_remote_code)
        return EngineParams(max_new_tokens=sp.max_tokens, temperature=1.0 if sp.temperature is None else sp.temperature,
                            top_k=sp.top_k or 0, top_p=sp.top_p or 0.0, seed=self._seeds.seed(sp.seed), min_tokens=sp.min_tokens or 0,
                            end_id=-1 if sp.ignore_eos or end_id is None else int(end_id),
                            stop_words=[word for _, word in stops],
                            repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
                            presence_penalty=sp.presence_penalty or 0.0, frequency_penalty=sp.frequency_penalty or 0.0,
                            min_p=sp.min_p or 0.0, logprobs=sp.logprobs, prompt_logprobs=sp.prompt_logprobs,
                            guide=guide)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None):
        """LLM.generate: every prompt's finished RequestOutput (one prompt: one output, not a list)."""
        return generate_all(self, prompts, sampling_params, lora_request)

    def generate_async(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       streaming: bool = False, on_output: Callable[[RequestOutput], None] | None = None,
                       lora_request: LoRARequest | None = None) -> RequestHandle:
        """Queue one request. `on_output` gets the request's RequestOutput (the same object, updated)
        after each step that produced text when streaming, and once finished in any case; raises
        LlmArgsError for a request this engine refuses (the LLM API raises for the same). `lora_request`
        runs it with that adapter, loaded on its first use."""
        sp = sampling_params or SamplingParams()
        sp.validate()
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt, sp.add_special_tokens) if isinstance(prompt, str) else [int(t) for t in prompt]
        stops = self._stops(sp)
        params = self._engine_params(sp, stops)
        try:
            task = self.lora.task_id(lora_request)
        except (ValueError, ToolchainError) as err:
            raise LlmArgsError(str(err)) from None
        if task is not None:
            params = dataclasses.replace(params, lora_task_id=task)
        count = max(sp.best_of or sp.n, sp.n) if sp.beam_width == 1 else 1  # sequences sampled
        if streaming and (sp.beam_width > 1 or count > sp.n):
            # UNVERIFIED whether the LLM API streams these; the CPU engine's beams end together.
            raise LlmArgsError("streaming with use_beam_search or best_of above n is not supported by the CPU "
                               "engine; generate without streaming")
        if sp.beam_width > 1:
            params = dataclasses.replace(
                params, beam_width=sp.beam_width, num_return_sequences=sp.n, logprobs=None,
                length_penalty=1.0 if sp.length_penalty is None else sp.length_penalty,
                early_stopping=1 if sp.early_stopping is None else sp.early_stopping,
                stop_words=[w for w in params.stop_words if w != [params.end_id]])  # a beam ends on end_id itself
        elif count > sp.n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # a record to rank the best_of sequences by
        problem = self.engine.request_problem(ids, params)
        if problem:
            raise LlmArgsError(problem)
        if sp.beam_width > 1:
            return self._submit_beams(text, ids, params, sp, on_output)
        # n sampled sequences run as the executor's child requests, child j seeded with the seed + j
        # (engine/cpu/beams.py's rule, UNVERIFIED there); RequestOutput.outputs[j] is child j's.
        rids = [next(self._ids) for _ in range(count)]
        out = RequestOutput(rids[0], text, ids, [])
        done = [False] * count
        records: list = []
        if count > sp.n:  # outputs cut to the n best once all have finished (outputs.keep_best)
            on_output = self._best_of(sp.n, records, on_output)
        for j, (rid, child) in enumerate(zip(rids, children(dataclasses.replace(params, num_return_sequences=count)),
                                             strict=True)):
            perf = RequestPerfMetrics(arrival_time_ns=time.time_ns()) if sp.return_perf_metrics else None
            out.outputs.append(CompletionOutput(index=j, request_perf_metrics=perf))
            callback, record, stats = self._child_callback(out, j, done, sp, ids, stops, streaming, on_output,
                                                           child.logprobs is not None)
            records.append(record)
            self._batcher.submit(rid, ids, child, callback, stats=stats, logprobs=record)
        return RequestHandle(self, rids)

    @staticmethod
    def _best_of(n: int, records: list, on_output: Callable[[RequestOutput], None] | None):
        def finished(out: RequestOutput) -> None:
            keep_best(out, n, records)
            if on_output is not None:
                on_output(out)

        return finished

    def _submit_beams(self, text: str | None, ids: list[int], params, sp: SamplingParams,
                      on_output: Callable[[RequestOutput], None] | None) -> RequestHandle:
        """One beam-search request; on its end `outputs` become its returned beams, best first."""
        from toolchain.engine.cpu import RequestStats

        rid, stats = next(self._ids), RequestStats()
        results: list = []  # the engine's BeamResults, filled before the final callback
        out = RequestOutput(rid, text, ids, [CompletionOutput()])

        def callback(new_tokens, finished, error=None):
            if not finished:
                return
            out.outputs = beam_outputs(results, self.tokenizer.decode, ids, sp.exclude_input_from_output,
                                       sp.skip_special_tokens, sp.logprobs is not None) or out.outputs
            if not results:  # cancelled or failed before the search ended
                out.outputs[0].finish_reason = "cancelled"
            out.error, out.finished = error, True
            if on_output is not None:
                on_output(out)

        self._batcher.submit(rid, ids, params, callback, stats=stats, beam_results=results)
        return RequestHandle(self, [rid])

    def _child_callback(self, out: RequestOutput, j: int, done: list[bool], sp: SamplingParams, ids: list[int],
                        stops, streaming: bool, on_output: Callable[[RequestOutput], None] | None, keep: bool):
        """(batcher callback, log-prob record, stats) of sequence j of `out` (all on the batcher thread)."""
        from toolchain.engine.cpu import RequestStats
        from toolchain.engine.cpu.logprobs import TokenLogprobs

        stats = RequestStats()
        record = TokenLogprobs() if keep or sp.logprobs is not None or sp.prompt_logprobs is not None else None
        c = out.outputs[j]
        generated: list[int] = []

        def callback(new_tokens, finished, error=None):
            new_tokens = [int(t) for t in new_tokens or ()]
            perf = c.request_perf_metrics
            if perf is not None and new_tokens and not perf.first_token_time_ns:
                perf.first_token_time_ns = time.time_ns()
            generated.extend(new_tokens)
            if not finished and not (streaming and new_tokens):
                return
            done[j] = done[j] or finished
            self._update(out, c, sp, ids, generated, stats, finished, error, stops)
            out.finished = all(done)
            if record is not None:
                self._logprobs(c, sp, ids, record)
            if on_output is not None and (streaming or out.finished):
                on_output(out)

        return callback, record, stats

    @staticmethod
    def _logprobs(c: CompletionOutput, sp: SamplingParams, prompt: list[int], record) -> None:
        """The output's log-probs from the engine's record (filled before the callback heard of the tokens)."""
        generated = c.token_ids[len(prompt):] if not sp.exclude_input_from_output else c.token_ids
        if sp.logprobs is not None:
            c.logprobs = token_logprobs(generated, record)
            c.cumulative_logprob = float(sum(record.tokens[:len(generated)]))
        if sp.prompt_logprobs is not None:
            c.prompt_logprobs = prompt_logprobs(prompt, record)

    def _update(self, out: RequestOutput, c: CompletionOutput, sp: SamplingParams, prompt: list[int],
                generated: list[int], stats, finished: bool, error: str | None,
                stops: list[tuple[int | str, list[int]]]) -> None:
        tokens = list(generated)
        if finished:
            c.finish_reason, c.stop_reason, word = self._reason(stats.finish_reason, tokens, stops)
            if isinstance(c.stop_reason, str) and not sp.include_stop_str_in_output:
                # The LLM API drops the stop string's tokens from the output.
                tokens = tokens[:len(tokens) - len(word)]
        c.token_ids = tokens if sp.exclude_input_from_output else prompt + tokens
        c._last_text_len = len(c.text)
        c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=sp.skip_special_tokens)
        out.error = out.error or error
        perf = c.request_perf_metrics
        if perf is not None:
            perf.first_scheduled_time_ns = stats.first_scheduled_ns or perf.arrival_time_ns
            perf.last_token_time_ns = time.time_ns()
            reused, total = stats.kv_cache_reused_blocks, stats.kv_cache_alloc_total_blocks
            missed = max(total - reused, 0)
            perf.kv_cache_metrics = KvCacheMetrics(reused, missed, stats.kv_cache_alloc_new_blocks, total,
                                                   reused / (reused + missed) if reused + missed else 0.0)
            perf.total_draft_tokens = stats.total_draft_tokens
            perf.total_accepted_draft_tokens = stats.total_accepted_draft_tokens
            perf.acceptance_rate = stats.acceptance_rate

    @staticmethod
    def _reason(engine_reason: str | None, tokens: list[int], stops: list[tuple[int | str, list[int]]]):
        """(finish_reason, stop_reason, the stop's token ids) under the LLM API's names."""
        if engine_reason == "stop_word":
            for reason, word in stops:  # stop token ids first, then stop strings
                if tokens[-len(word):] == word:
                    return "stop", reason, word
            return "stop", None, []
        if engine_reason == "end_id":
            return "stop", None, []
        if engine_reason in ("cancelled", "error"):
            return "cancelled", None, []
        return "length", None, []

    # ---- lifecycle ------------------------------------------------------------------------------------------
    @property
    def stats(self):
        return self._batcher.stats

    def shutdown(self) -> None:
        # None once shut down (the attribute is absent when start-up failed before the batcher).
        batcher, self._batcher = getattr(self, "_batcher", None), None  # type: ignore[assignment]
        if batcher is not None:
            batcher.stop()
        self._drop_tmp()

    def _drop_tmp(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "CpuLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
