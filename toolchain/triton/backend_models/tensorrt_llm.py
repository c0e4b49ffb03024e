"""Triton Python model `tensorrt_llm` for target `cpu`: the CPU engine behind the
TensorRT-LLM 1.2 tensor contract.

Same name, tensors, reshape/optional flags and decoupled setting as the C++
`tensorrtllm` backend, so preprocessing, the ensemble, the BLS and clients
cannot tell the difference. One `InflightBatcher` over `CpuEngine.load(<gpt_model_path>)`
is started in `initialize()`; `execute()` only submits and returns None, and
responses are sent from the batcher's callbacks through each request's
response sender:

* streaming (decoupled only): every response carries just the new tokens,
  `output_ids` [1,1,n] and `sequence_length` [1,1]; the last one has the FINAL flag;
* non-streaming: one response with prompt + completion (completion only when
  `exclude_input_in_output`), FINAL flag set;
* batch > 1 (decoupled only): one executor request per row, responses tagged
  with `batch_index`, FINAL on the response that completes the last row;
* `stop=true` with the Triton request id of an in-flight request cancels it
  and both requests end with an empty final response; client cancellation is
  polled every 100 ms (`cancellation_check_period_ms`).

Copied into <repo>/tensorrt_llm/1/model.py.
"""

import inspect
import itertools
import json
import os
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# Request input -> SamplingParams field, with the value that means "off" for the
# fields this engine may not implement (a non-neutral value must not be ignored).
SAMPLING = (
    ("temperature", "temperature", float, None),
    ("runtime_top_k", "top_k", int, None),
    ("runtime_top_p", "top_p", float, None),
    ("seed", "seed", int, None),
    ("min_tokens", "min_tokens", int, None),
    ("repetition_penalty", "repetition_penalty", float, 1.0),
    ("presence_penalty", "presence_penalty", float, 0.0),
    ("frequency_penalty", "frequency_penalty", float, 0.0),
    ("runtime_top_p_min", "top_p_min", float, 0.0),
    ("runtime_top_p_decay", "top_p_decay", float, 1.0),
    ("beam_width", "beam_width", int, 1), ("num_return_sequences", "num_return_sequences", int, 1),
    ("len_penalty", "length_penalty", float, 1.0), ("early_stopping", "early_stopping", int, 1),
)
# Inputs whose mere presence asks for something the CPU engine does not do.
UNSUPPORTED_INPUTS = ("encoder_input_features", "prompt_embedding_table", "cross_attention_mask",
                      "context_phase_params", "mrope_rotary_cos_sin")


def _param(config, key):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    if value is None or value == "" or value.startswith("${"):
        return None
    return value


class _Inputs:
    """Reads a request's tensors, tolerating both `[B]` (after `reshape []`)
    and `[B,1]` layouts for per-row scalars."""

    def __init__(self, request):
        self.request = request
        ids = self.get("input_ids")
        if ids is None:
            raise ValueError("input_ids is required")
        self.ids = ids.reshape(1, -1) if ids.ndim == 1 else ids.reshape(ids.shape[0], -1)
        self.batch = self.ids.shape[0]

    def get(self, name):
        tensor = pb_utils.get_input_tensor_by_name(self.request, name)
        return None if tensor is None else tensor.as_numpy()

    def scalar(self, name, row, default=None, cast=int):
        arr = self.get(name)
        if arr is None or arr.size == 0:
            return default
        flat = arr.reshape(-1)
        if flat.size == self.batch:
            return cast(flat[row])
        if flat.size % self.batch == 0:
            return cast(arr.reshape(self.batch, -1)[row, 0])
        return cast(flat[0])

    def row(self, name, row):
        """One row of an optional [B, N] token tensor as a list (empty when absent)."""
        arr = self.get(name)
        if arr is None or arr.size == 0:
            return []
        return [int(t) for t in arr.reshape(self.batch, -1)[row]]

    def word_list(self, name, row):
        """[B,2,N] TensorRT-LLM word list -> list of token-id lists for one row."""
        arr = self.get(name)
        if arr is None or arr.size == 0:
            return []
        arr = arr.reshape(self.batch, 2, -1)[row]
        words, start = [], 0
        for end in arr[1]:
            if end < 0:
                break
            words.append([int(t) for t in arr[0, start:end]])
            start = int(end)
        return words


class _Group:
    """One Triton request: its sender and the engine requests of its rows."""

    def __init__(self, sender, triton_id, batch, streaming):
        self.sender = sender
        self.triton_id = triton_id
        self.batch = batch
        self.streaming = streaming
        self.pending = set()
        self.done = False


class _Row:
    def __init__(self, group, index, prompt, exclude_input, wants, stats, max_new=0, drafted=0, extras=None):
        self.group = group
        self.index = index
        self.prompt = prompt
        self.exclude_input = exclude_input
        self.wants = wants  # optional outputs requested per request flags
        self.stats = stats  # filled by the batcher: first scheduled time, KV blocks
        self.max_new = max_new  # request_output_len
        self.drafted = drafted  # draft_input_ids it brought
        # return_generation_logits: the engine appends each step's rows [n, V] here (batcher thread).
        self.logits = [] if "return_generation_logits" in wants else None
        self.extras = extras  # cpu_requests.LogprobOutputs: return_log_probs / return_context_logits
        self.tokens = []
        self.sequence_index = self.beam_results = None  # one of several sequences; a beam search's results
        self.arrival_ns = time.time_ns()
        self.first_token_ns = 0


class _Metrics:
    """The TensorRT-LLM backend's `nv_trt_llm_*` gauges and `nv_llm_*_token_len` histograms
    (TensorRT-LLM triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/), fed from the
    CPU engine's iteration stats, so dashboards and `toolchain bench`'s server cross-check read the
    same families on CPU as on a GPU, the KV-cache block pool's included. The runtime-memory
    family (cpu/gpu/pinned bytes of the TensorRT runtime) has no CPU counterpart and is not exported."""

    REQUEST = ("active", "max", "scheduled", "context", "waiting")
    BATCHER = ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests")
    GENERAL = ("timestamp", "iteration_counter")
    KV_BLOCKS = ("max", "free", "used", "tokens_per", "reused", "fraction")
    SPEC = ("total_draft_tokens", "total_accepted_draft_tokens", "draft_steps", "acceptance_rate",
            "accepted_per_step")
    BUCKETS = [10, 50, 100, 500, 1000]

    @classmethod
    def create(cls, model, version, max_batch):
        try:
            return cls(model, str(version), max_batch)
        except Exception as err:  # metrics disabled, or a Python backend without custom metrics
            print(f"tensorrt_llm: custom metrics unavailable ({err}); serving without nv_trt_llm_*", file=sys.stderr)
            return None

    def __init__(self, model, version, max_batch):
        fam = pb_utils.MetricFamily
        base = {"model": model, "version": version}

        self.families = []  # a Metric is invalid once its MetricFamily is garbage collected

        def family_of(name, description, kind):
            family = fam(name=name, description=description, kind=kind)
            self.families.append(family)
            return family

        def gauges(name, description, label, keys):
            family = family_of(name, description, fam.GAUGE)
            return {k: family.Metric(labels={**base, label: k}) for k in keys}
        self.request = gauges("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type", self.REQUEST)
        self.batcher = gauges("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
                              "inflight_batcher_specific_metric", self.BATCHER)
        self.general = gauges("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type", self.GENERAL)
        self.kv = gauges("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type",
                         self.KV_BLOCKS)
        # TensorRT-LLM 1.2's backend exports no speculative-decoding family; this one is the toolchain's,
        # named for the executor's per-request perf metrics (totals since start).
        self.spec = gauges("toolchain_spec_decode_metrics", "Speculative decoding since start: draft tokens "
                           "verified and accepted, verification steps, acceptance rate, accepted tokens per step",
                           "spec_decode_metric", self.SPEC)
        self.request["max"].set(max_batch)
        self.tokens = None
        if hasattr(fam, "HISTOGRAM"):
            self.tokens = {}
            for name, key, what in (("nv_llm_input_token_len", "total_input_tokens", "input"),
                                    ("nv_llm_output_token_len", "total_output_tokens", "output")):
                family = family_of(name, f"TRT LLM response metrics: {what} tokens per request", fam.HISTOGRAM)
                self.tokens[what] = family.Metric(labels={**base, "response_metric_type": key}, buckets=self.BUCKETS)

    def iteration(self, st, kv):
        r, b, g = self.request, self.batcher, self.general
        r["active"].set(st.active)
        r["scheduled"].set(st.scheduled)
        r["context"].set(st.context)
        r["waiting"].set(max(0, st.active - st.scheduled))
        b["total_context_tokens"].set(st.context_tokens)
        b["generation_requests"].set(st.generation)
        b["paused_requests"].set(st.paused)
        # What WaitForStats reads from KvCacheStats; fraction = used / max.
        used = kv.used_blocks
        for key, value in (("max", kv.num_blocks), ("free", kv.free_blocks), ("used", used),
                           ("tokens_per", kv.tokens_per_block), ("reused", kv.reused_total),
                           ("fraction", used / kv.num_blocks if kv.num_blocks else 0.0)):
            self.kv[key].set(value)
        g["timestamp"].set(st.timestamp_us)
        g["iteration_counter"].set(st.steps)
        for key, value in (("total_draft_tokens", st.draft_tokens), ("total_accepted_draft_tokens",
                                                                      st.accepted_draft_tokens),
                           ("draft_steps", st.draft_steps),
                           ("acceptance_rate", st.accepted_draft_tokens / st.draft_tokens if st.draft_tokens else 0.0),
                           ("accepted_per_step", st.accepted_draft_tokens / st.draft_steps if st.draft_steps else 0.0)):
            self.spec[key].set(value)

    def request_done(self, prompt_tokens, output_tokens):
        if self.tokens is not None:
            self.tokens["input"].observe(prompt_tokens)
            self.tokens["output"].observe(output_tokens)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        toolchain_path = _param(config, "toolchain_path")
        # The Python stub ignores PYTHONPATH; the rendered path is a fallback for a
        # toolchain that is not installed in the serving environment.
        if toolchain_path and toolchain_path not in sys.path:
            sys.path.append(toolchain_path)
        from toolchain.engine.cpu import (CpuEngine, InflightBatcher, KvCacheConfig, RequestStats,
                                          SamplingParams, SchedulerConfig)
        from toolchain.triton import backend_params, cpu_lora, cpu_requests, sequences

        # Every parameter is read by the C++ backend's rules, so a config that fails to load on a
        # GPU host fails here too, with the backend's own message.
        try:
            values = backend_params.read(config, warn=lambda m: print(f"tensorrt_llm: warning: {m}", file=sys.stderr))
            engine_dir = backend_params.check_load(values)
        except backend_params.ParameterError as err:
            raise ValueError(f"tensorrt_llm: {err}") from None
        self._refuse_unsupported(values)
        if not os.path.isfile(os.path.join(engine_dir, "config.json")):
            raise ValueError(f"tensorrt_llm: no engine at gpt_model_path {engine_dir!r} (run `toolchain build-engine`)")
        self.default_exclude_input = values["exclude_input_in_output"]
        # A period of 0 is the backend's busy loop; the CPU threads wait at least a millisecond.
        self.cancel_period_s = max(values["cancellation_check_period_ms"], 1) / 1000.0
        self.stats_period_s = max(values["stats_check_period_ms"], 1) / 1000.0
        self.SamplingParams = SamplingParams
        self.requests, self.lora = cpu_requests, cpu_lora
        self.normalize_log_probs = values["normalize_log_probs"]
        self.RequestStats = RequestStats
        self.sampling_fields = set(inspect.signature(SamplingParams).parameters)
        threads = _param(config, "engine_threads")
        kv_cache = KvCacheConfig(  # the block size is the engine's
            free_memory_fraction=(KvCacheConfig.free_memory_fraction if values["kv_cache_free_gpu_mem_fraction"] is None
                                  else values["kv_cache_free_gpu_mem_fraction"]),
            max_tokens=values["max_tokens_in_paged_kv_cache"],
            enable_block_reuse=values["enable_kv_cache_reuse"])
        scheduler = SchedulerConfig(
            policy=values["batch_scheduler_policy"] or "guaranteed_no_evict",
            enable_chunked_context=values["enable_chunked_context"],
            # The C++ backend hands dynamic_batching's max_queue_size to the executor (maxQueueSize).
            max_queue_size=int(config.get("dynamic_batching", {}).get("default_queue_policy", {})
                               .get("max_queue_size", 0) or 0))
        for problem in (kv_cache.problem(), scheduler.problem()):
            if problem:
                raise ValueError(f"tensorrt_llm: {problem}")
        medusa = values.get("decoding_mode") == "medusa"
        num_threads = int(threads) if threads and threads.isdigit() else None
        self.worker = None
        comm = self._join_ranks(engine_dir, num_threads)
        if comm is not None and not comm.leader:
            return
        self.engine = CpuEngine.load(engine_dir, num_threads=num_threads, kv_cache=kv_cache,
                                     medusa_choices=values.get("medusa_choices") if medusa else None, comm=comm,
                                     **cpu_lora.load_options(values, warn=lambda m: print(f"tensorrt_llm: {m}")))
        if self.engine.dims.medusa_heads and not medusa:
            raise ValueError(f"tensorrt_llm: the engine at {engine_dir} has Medusa heads but decoding_mode is "
                             f"{values.get('decoding_mode')}; set decoding_mode medusa and medusa_choices")
        self.engine.guided = cpu_requests.guided_decoder(values, self.engine.vocab_size)
        self.sequences, self.max_beam_width = sequences, sequences.model_beam_width(values, self.engine)
        self.batcher = InflightBatcher(self.engine, scheduler)
        self.batcher.start()
        self.metrics = _Metrics.create(args["model_name"], args.get("model_version", "1"),
                                       self.engine.limits.max_batch_size)
        self.lock = threading.Lock()
        self.rows = {}  # engine request id -> _Row
        self.groups = {}  # id(group) -> _Group
        self.ids = itertools.count(1)
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellation, name="tensorrt_llm-cancel", daemon=True)
        self.watcher.start()
        if self.metrics is not None:
            threading.Thread(target=self._report_stats, name="tensorrt_llm-stats", daemon=True).start()

    def _join_ranks(self, engine_dir, num_threads):
        """Under mpirun (serving.launch mpirun): join the other ranks' processes. Rank 0 goes on to
        lead them as TensorRT-LLM's leader does; any other rank loads its own shard and follows the
        leader's steps on a thread, taking no requests. None when this server runs every rank."""
        from toolchain.engine.cpu import ranks
        from toolchain.errors import ToolchainError

        world = ranks.launched_world()
        if world is None:
            return None
        rank, size = world
        addr = os.environ.get(ranks.ADDR_ENV)
        if not addr:
            raise ValueError(f"tensorrt_llm: started as rank {rank} of {size} by mpirun but {ranks.ADDR_ENV} is "
                             "unset; start the ranks with `toolchain serve` (serving.launch mpirun)")
        import torch

        from toolchain.engine.cpu.config import read_engine_config

        if num_threads:
            torch.set_num_threads(num_threads)
        try:
            _, dims, _ = read_engine_config(engine_dir)
            comm = ranks.Comm(rank, size, dims.tp, dims.pp, addr)
            if comm.leader:
                return comm
            model, kv = ranks.load_worker(engine_dir, comm)
        except ToolchainError as err:
            raise ValueError(f"tensorrt_llm: rank {rank}: {err}") from None
        self.comm = comm
        self.worker = threading.Thread(target=ranks.worker_loop, args=(model, comm, kv), name=f"rank{rank}-steps",
                                       daemon=True)
        self.worker.start()
        return comm

    @staticmethod
    def _refuse_unsupported(values):
        """What the C++ backend would run but the CPU engine cannot: refused, never ignored."""
        if values["gpt_model_type"] in ("V1", "v1"):
            raise ValueError("tensorrt_llm: gpt_model_type V1 (static batching) is not supported by the CPU engine; "
                             "use inflight_fused_batching")
        if values.get("encoder_model_path") not in (None, "", "${encoder_engine_dir}"):
            raise ValueError("tensorrt_llm: encoder_model_path is set; the CPU engine runs decoder-only models")
        mode = values.get("decoding_mode")
        if mode not in (None, "top_k", "top_p", "top_k_top_p", "beam_search", "medusa"):
            raise ValueError(f"tensorrt_llm: decoding_mode {mode} is not supported by the CPU engine "
                             "(top_k, top_p, top_k_top_p, beam_search or medusa)")

    def _report_stats(self):
        while not self.stopping.wait(self.stats_period_s):
            try:
                self.metrics.iteration(self.batcher.stats, self.engine.kv)
            except Exception as err:  # metrics are a side channel: never let them take the model down
                print(f"tensorrt_llm: stats report failed: {err}", file=sys.stderr)
                return

    # ---- requests -------------------------------------------------------------------------------------------
    def execute(self, requests):
        if self.worker is not None:  # rank > 0: the leader (rank 0) takes every request
            for request in requests:
                self._send(request.get_response_sender(), error="tensorrt_llm: this is a rank other than 0; "
                                                                "send requests to rank 0's server")
            return None
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as err:
                self._send(sender, error=f"tensorrt_llm: {err}")
        return None  # every response goes through the senders, in both modes

    def _submit(self, request, sender):
        inputs = _Inputs(request)
        triton_id = request.request_id()
        if inputs.scalar("stop", 0, False, bool):
            self._stop(triton_id)
            self._send(sender)
            return
        streaming = inputs.scalar("streaming", 0, False, bool)
        if streaming and not self.decoupled:
            raise ValueError("Streaming is only supported if model is deployed using decoupled mode.")
        if inputs.batch > 1 and not self.decoupled:
            raise ValueError("Batch size > 1 requires the tensorrt_llm model to use the decoupled transaction policy")
        self._check_supported(inputs)

        group = _Group(sender, triton_id, inputs.batch, streaming)
        submissions = []
        for row in range(inputs.batch):
            length = inputs.scalar("input_lengths", row, inputs.ids.shape[1])
            if length == 0:
                raise ValueError("empty prompt: input_lengths is 0, at least one input token is required")
            if length < 0 or length > inputs.ids.shape[1]:
                raise ValueError(f"input_lengths {length} does not fit input_ids of width {inputs.ids.shape[1]}")
            prompt = [int(t) for t in inputs.ids[row, :length]]
            lora = self.lora.row_lora(inputs, row)
            params = self._sampling(inputs, row, lora)
            exclude = inputs.scalar("exclude_input_in_output", row, self.default_exclude_input, bool)
            wants = {flag for flag in ("return_num_input_tokens", "return_num_output_tokens", "return_perf_metrics",
                                       "return_generation_logits", "return_log_probs", "return_context_logits")
                     if inputs.scalar(flag, row, False, bool)}
            draft = inputs.row("draft_input_ids", row)
            logits = inputs.get("draft_logits")
            if logits is not None and logits.size:
                if not draft:
                    raise ValueError("draft_logits given without draft_input_ids")
                # [B, k, V] (or one request's [k, V]); the engine checks k and V against the draft and the vocab.
                logits = logits.reshape(inputs.batch, -1, logits.shape[-1])[row] if logits.ndim > 2 else logits
            else:
                logits = None
            threshold = inputs.scalar("draft_acceptance_threshold", row, None, float)
            for index, seq_params in self.sequences.sequences(params, inputs.get("num_return_sequences") is not None):
                beams = seq_params.beam_width > 1  # its beams bring their own cum_log_probs (sequences.py)
                extras = None if beams else self.requests.row_outputs(wants, self.normalize_log_probs)
                entry = _Row(group, row, prompt, exclude, wants, self.RequestStats(), params.max_new_tokens, len(draft),
                             extras)
                entry.sequence_index, entry.beam_results = index, [] if beams else None
                submissions.append((next(self.ids), entry, prompt, seq_params, (draft, logits, threshold, lora)))
        with self.lock:
            self.groups[id(group)] = group
            for rid, row, _, _, _ in submissions:
                self.rows[rid] = row
                group.pending.add(rid)
        for rid, row, prompt, params, (draft, logits, threshold, lora) in submissions:
            try:
                if lora is not None:  # the executor's enqueue: the adapter into the cache, or found there
                    self.lora.prepare(self.engine, rid, lora)
                # The 1.2 backend sets no executor priority: every request runs at the default.
                self.batcher.submit(rid, prompt, params, self._callback(rid), stats=row.stats, draft_tokens=draft,
                                    draft_logits=logits, draft_acceptance_threshold=threshold,
                                    generation_logits=row.logits, beam_results=row.beam_results,
                                    logprobs=row.extras.record if row.extras is not None else None)
            except Exception as err:  # QueueFull among them: the executor's refusal
                self._abort(group, error=str(err) if isinstance(err, self.lora.LoraRequestError) else
                            f"tensorrt_llm: {err}")
                return

    def _check_supported(self, inputs):
        for name in UNSUPPORTED_INPUTS:
            if inputs.get(name) is not None:
                raise ValueError(f"{name} is not supported by the CPU engine")
        build = self.engine.config.get("build_config") or {}
        for what in ("generation", "context"):
            if any(inputs.scalar(f"return_{what}_logits", r, False, bool) for r in range(inputs.batch)):
                self.requests.check_gathered(build, what)
        self.sequences.check_request(inputs, self.decoupled, self.max_beam_width)


    def _sampling(self, inputs, row, lora=None):
        max_new = inputs.scalar("request_output_len", row)
        if max_new is None or max_new <= 0:
            raise ValueError(f"request_output_len (the ensemble's max_tokens) must be > 0, got {max_new}")
        kwargs = {"max_new_tokens": max_new, "end_id": inputs.scalar("end_id", row, -1),
                  "pad_id": inputs.scalar("pad_id", row, None),
                  "stop_words": inputs.word_list("stop_words_list", row)}
        kwargs.update(bad_words=inputs.word_list("bad_words_list", row),
                      embedding_bias=self.requests.embedding_bias(inputs, row),
                      guide=self.requests.guide(inputs, row, self.engine.guided),
                      logprobs=0 if inputs.scalar("return_log_probs", row, False, bool) else None,
                      return_context_logits=inputs.scalar("return_context_logits", row, False, bool))
        if lora is not None:
            kwargs["lora_task_id"] = lora.task_id
        for name, field, cast, neutral in SAMPLING:
            value = inputs.scalar(name, row, None, cast)
            if value is None:
                continue
            if field in self.sampling_fields:
                kwargs[field] = value
            elif neutral is not None and value != neutral:
                raise ValueError(f"{name}={value:g} is not supported by the CPU engine")
        return self.SamplingParams(**kwargs)

    # ---- engine callbacks -------------------------------------------------------------------------------------
    def _callback(self, rid):
        return lambda new_tokens, finished, error=None: self._on_tokens(rid, new_tokens, finished, error)

    def _on_tokens(self, rid, new_tokens, finished, error):
        with self.lock:
            row = self.rows.get(rid)
            if row is None:  # cancelled or stopped meanwhile
                return
            group = row.group
        if error:
            self._abort(group, error=f"tensorrt_llm: {error}")
            return
        with self.lock:
            if group.done:
                return
            new_tokens = [int(t) for t in (new_tokens or ())]
            if new_tokens and not row.first_token_ns:
                row.first_token_ns = time.time_ns()
            row.tokens += new_tokens
            if finished:
                self.rows.pop(rid, None)
                group.pending.discard(rid)
                if self.metrics is not None:
                    self.metrics.request_done(len(row.prompt), len(row.tokens))
            last = finished and not group.pending
            if last:
                group.done = True
                self.groups.pop(id(group), None)
            if group.streaming:
                if new_tokens:
                    self._send(group.sender, self._outputs(row, new_tokens), final=last)
                elif last:
                    self._send(group.sender)
            elif finished:
                full = row.tokens if row.exclude_input else row.prompt + row.tokens
                self._send(group.sender, self._outputs(row, full), final=last)

    def _outputs(self, row, tokens):
        out = [pb_utils.Tensor("output_ids", np.array(tokens, np.int32).reshape(1, 1, -1)),
               pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], np.int32))]
        if row.beam_results:  # a beam search's beams (triton/sequences.py)
            out = [pb_utils.Tensor(n, v) for n, v in self.sequences.beam_arrays(row, "return_log_probs" in row.wants)]
        if row.sequence_index is not None:
            out.append(pb_utils.Tensor("sequence_index", np.array([[row.sequence_index]], np.int32)))
        if row.group.batch > 1:
            out.append(pb_utils.Tensor("batch_index", np.array([[row.index]], np.int32)))
        if "return_num_input_tokens" in row.wants:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([[len(row.prompt)]], np.int32)))
        if "return_num_output_tokens" in row.wants:
            out.append(pb_utils.Tensor("num_output_tokens", np.array([[len(row.tokens)]], np.int32)))
        if "return_perf_metrics" in row.wants:
            now = time.time_ns()
            st = row.stats
            for name, value in (("arrival_time_ns", row.arrival_ns),
                                ("first_scheduled_time_ns", st.first_scheduled_ns or row.arrival_ns),
                                ("first_token_time_ns", row.first_token_ns or now), ("last_token_time_ns", now)):
                out.append(pb_utils.Tensor(name, np.array([[value]], np.int64)))
            for name in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"):
                out.append(pb_utils.Tensor(name, np.array([[getattr(st, name)]], np.int32)))
            for name in ("total_accepted_draft_tokens", "total_draft_tokens"):
                out.append(pb_utils.Tensor(name, np.array([[getattr(st, name)]], np.int32)))
            out.append(pb_utils.Tensor("acceptance_rate", np.array([[st.acceptance_rate]], np.float32)))
        if row.logits is not None:
            out.append(pb_utils.Tensor("generation_logits", self._generation_logits(row)))
        if row.extras is not None:
            out += [pb_utils.Tensor(name, value) for name, value in row.extras.outputs(len(tokens), row.group.streaming)]
        return out

    def _generation_logits(self, row):
        """generation_logits as the C++ backend shapes them (fillTritonResponse prepends 1 to the
        executor's tensor, which LlmRequest::createResult slices from the buffer that
        allocGenerationLogitsHost sizes, cpp/include/tensorrt_llm/batch_manager/llmRequest.h):
        streaming, each response the rows of its new tokens as [1, tokens, beam, vocab];
        otherwise [1, beam, request_output_len, vocab], the buffer whole, its rows past an early
        end left unwritten (zeros here), or with k draft tokens [1, 1, k + 1, vocab]
        (allocTargetModelAcceptedTokenLogitsHost), the rows past the accepted ones unwritten."""
        vocab = self.engine.vocab_size
        rows = np.concatenate([r.numpy() for r in row.logits]) if row.logits else np.zeros((0, vocab), np.float32)
        if row.group.streaming:
            row.logits.clear()  # sent; the next response carries the next tokens' rows
            return rows[None, :, None]
        size = row.drafted + 1 if row.drafted else row.max_new
        if len(rows) < size:
            rows = np.concatenate([rows, np.zeros((size - len(rows), vocab), np.float32)])
        return rows[None, None]

    # ---- stop, cancellation, errors ---------------------------------------------------------------------------
    def _stop(self, triton_id):
        if not triton_id:
            return
        with self.lock:
            targets = [g for g in self.groups.values() if g.triton_id == triton_id]
        for group in targets:
            self._abort(group)

    def _watch_cancellation(self):
        while not self.stopping.wait(self.cancel_period_s):
            with self.lock:
                groups = list(self.groups.values())
            for group in groups:
                # Under the lock, and only while the group is open: every final response is sent under
                # this lock or after `done` was set under it, and asking a sender whose final response
                # has gone out reads a freed response factory (tritonserver 2.51 segfaults on it).
                with self.lock:
                    if group.done:
                        continue
                    try:
                        cancelled = group.sender.is_cancelled()
                    except Exception:
                        cancelled = False
                if cancelled:
                    self._abort(group, cancelled=True)

    def _abort(self, group, error=None, cancelled=False):
        """End a group once: cancel its engine requests (outside the lock, the
        batcher may be calling back) and send the final response."""
        with self.lock:
            if group.done:
                return
            group.done = True
            self.groups.pop(id(group), None)
            rids = [rid for rid in group.pending if rid in self.rows]
            for rid in rids:
                self.rows.pop(rid, None)
        for rid in rids:
            try:
                self.batcher.cancel(rid)
            except Exception:
                pass
        if cancelled:
            code = getattr(pb_utils.TritonError, "CANCELLED", None)
            err = pb_utils.TritonError("request cancelled", code) if code is not None else pb_utils.TritonError(
                "request cancelled")
            self._send(group.sender, error=err)
        else:
            self._send(group.sender, error=error)

    def _send(self, sender, outputs=None, error=None, final=True):
        try:
            if outputs is None and error is None:
                sender.send(flags=FINAL)
                return
            if isinstance(error, str):
                error = pb_utils.TritonError(error)
            response = pb_utils.InferenceResponse(output_tensors=outputs or [], error=error)
            sender.send(response, flags=FINAL if final else 0)
        except Exception as err:  # the client may be gone; nothing else to tell it
            print(f"tensorrt_llm: could not send a response: {err}", file=sys.stderr)

    def finalize(self):
        if self.worker is not None:
            # Rank 0's unload sends the stop; a rank whose leader is already gone leaves without it.
            self.worker.join(timeout=5)
            if not self.worker.is_alive():
                self.comm.close()
            return
        self.stopping.set()
        try:
            self.batcher.stop()
            self.engine.close()
        finally:
            with self.lock:
                groups = list(self.groups.values())
            for group in groups:
                self._abort(group, error="tensorrt_llm: model is unloading")
