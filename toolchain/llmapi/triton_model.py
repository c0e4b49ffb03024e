"""Triton Python model `tensorrt_llm` of the LLM-API repository, for target `llmapi-cpu`.

The request contract of TensorRT-LLM's `triton_backend/all_models/llmapi/tensorrt_llm`
(1.2.1) with `CpuLLM` standing in for `tensorrt_llm.LLM`:

* `model.yaml` beside this file (or $LLM_CONFIG_PATH) holds the `LLM()` arguments
  and `triton_config` (`max_batch_size` 0, `decoupled`, `cancellation_check_period_ms`),
  which `auto_complete_config` applies to the model config as upstream does;
* one prompt per request in `text_input` [1]; `sampling_param_*` are the LLM API's
  SamplingParams, presence and frequency penalties included (`exclude_input_from_output`
  False unless sent, as upstream's helpers default it); `streaming` needs the decoupled policy;
* every response carries `text_output`, the whole text so far (the LLM API's
  cumulative `output.text`); `finish_reason`, `stop_reason` and `cumulative_logprob`
  when their `return_*` input asks; the perf-metric outputs with
  `sampling_param_return_perf_metrics`;
* `stop=true` with the id of an in-flight request cancels it; client cancellation
  is polled every `cancellation_check_period_ms` and answered with a CANCELLED error.

Copied into <repo>/tensorrt_llm/1/model.py.
"""

import json
import os
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# sampling_param_<name> inputs, read as upstream's helpers read them (scalars).
SAMPLING = ("best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens",
            "seed", "exclude_input_from_output", "return_perf_metrics")
RETURNS = {"return_finish_reason": "finish_reason", "return_stop_reason": "stop_reason",
           "return_cumulative_logprob": "cumulative_logprob"}
# Inputs of the upstream contract whose presence asks for what the CPU engine does not do.
UNSUPPORTED = ("image_url", "lora_id", "lora_name", "lora_path", "lora_ckpt_source")


def _config_path():
    return os.environ.get("LLM_CONFIG_PATH") or os.path.join(pb_utils.get_model_dir(), "model.yaml")


def _read_yaml():
    import yaml

    path = _config_path()
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as err:
        raise pb_utils.TritonModelException(f"cannot read the LLM arguments in {path}: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("triton_config"), dict):
        raise pb_utils.TritonModelException(f"{path} must be a mapping with a triton_config section")
    return data


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy()
    if value.size != 1:
        raise ValueError(f"Expected a scalar tensor for tensor {name}")
    item = value.item(0)
    return item.decode("utf-8") if isinstance(item, bytes) else item


class _Request:
    def __init__(self, sender, triton_id, streaming, returns, request):
        self.sender, self.triton_id, self.streaming, self.returns = sender, triton_id, streaming, returns
        self.request, self.handle, self.done = request, None, False
        self.client_cancelled = False  # the client went away: upstream answers with a CANCELLED error


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        triton = _read_yaml()["triton_config"]
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(triton["decoupled"])))
        auto_complete_model_config.set_max_batch_size(int(triton["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        data = _read_yaml()
        triton = data.pop("triton_config")
        self.decoupled = bool(triton["decoupled"])
        self.period_s = max(int(triton.get("cancellation_check_period_ms", 100)), 1) / 1000.0
        # The CPU stand-in's own settings are config.pbtxt parameters, never model.yaml keys: every
        # key there goes to LLM(), which refuses one it does not know.
        params = json.loads(args["model_config"]).get("parameters", {})
        toolchain_path = params.get("toolchain_path", {}).get("string_value")
        if toolchain_path and toolchain_path not in sys.path:  # the Python stub ignores PYTHONPATH
            sys.path.append(toolchain_path)
        from toolchain.llmapi.cpu_llm import CpuLLM, LlmArgsError, SamplingParams

        threads = params.get("engine_threads", {}).get("string_value")
        try:
            self.llm = CpuLLM(num_threads=int(threads) if threads else None, **data)
        except LlmArgsError as err:
            raise pb_utils.TritonModelException(f"tensorrt_llm: {err}") from None
        self.SamplingParams, self.LlmArgsError = SamplingParams, LlmArgsError
        self.lock = threading.Lock()
        self.inflight = {}  # id(_Request) -> _Request
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellation, name="llmapi-cancel", daemon=True)
        self.watcher.start()

    # ---- requests -------------------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as err:
                self._send(sender, error=f"Error generating request: {err}")
        return None

    def _submit(self, request, sender):
        triton_id = request.request_id()
        if _scalar(request, "stop"):
            self._stop(triton_id, sender)
            return
        for name in UNSUPPORTED:
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise ValueError(f"{name} is not supported by the CPU engine")
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise ValueError("text_input is missing from the request")
        text = text.as_numpy()
        if text.ndim > 1:
            raise ValueError("The current implementation only supports text_input being a 1D tensor.")
        prompt = text.reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        streaming = bool(_scalar(request, "streaming") or False)
        if streaming and not self.decoupled:
            raise ValueError("Streaming is only supported in decoupled mode.")
        kwargs = {"best_of": 1, "exclude_input_from_output": False, "return_perf_metrics": False}
        for name in SAMPLING:
            value = _scalar(request, f"sampling_param_{name}")
            if value is not None:
                kwargs[name] = value.item() if hasattr(value, "item") else value
        stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
        if stop is not None:
            kwargs["stop"] = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in stop.as_numpy().reshape(-1)]
        returns = {name for name in RETURNS if _scalar(request, name)}
        if "return_cumulative_logprob" in returns:
            # cumulative_logprob is the LLM API's sum of the generated tokens' log-probs, which it computes when
            # log-probs are asked for; upstream's inputs have no sampling_param_logprobs, so the flag asks here
            # (UNVERIFIED how upstream's model fills it without them).
            kwargs.setdefault("logprobs", 0)
        state = _Request(sender, triton_id, streaming, returns, request)
        params = self.SamplingParams.from_kwargs(kwargs)
        with self.lock:
            self.inflight[id(state)] = state
        try:
            state.handle = self.llm.generate_async(prompt, params, streaming,
                                                   on_output=lambda out: self._on_output(state, out))
        except Exception:
            with self.lock:
                self.inflight.pop(id(state), None)
            raise

    def _on_output(self, state, out):
        with self.lock:
            if state.done:
                return
            if out.finished:
                state.done = True
                self.inflight.pop(id(state), None)
            if out.error:
                self._send(state.sender, error=f"Error generating request: {out.error}")
                return
            if out.finished and state.client_cancelled:
                self._send(state.sender, error="Request cancelled by client", cancelled=True)
                return
            # Stopped by a `stop` request (or finished): the last output goes out as a normal final
            # response, as upstream's generator ends after abort().
            self._send(state.sender, self._outputs(state, out), final=out.finished)

    def _outputs(self, state, out):
        c = out.outputs[0]
        tensors = [pb_utils.Tensor("text_output", np.array([c.text.encode("utf-8")], dtype=object))]
        for flag, name in RETURNS.items():
            if flag in state.returns:
                value = getattr(c, name)
                if name == "cumulative_logprob":  # TYPE_FP32 in upstream's config.pbtxt
                    tensors.append(pb_utils.Tensor(name, np.array([value or 0.0], dtype=np.float32)))
                    continue
                tensors.append(pb_utils.Tensor(name, np.array([str(value).encode("utf-8")], dtype=object)))
        perf = c.request_perf_metrics
        if perf is not None:
            kv = perf.kv_cache_metrics
            for name, value, dtype in (
                    ("kv_cache_reused_block", kv.num_reused_blocks, np.int32),
                    ("kv_cache_missed_block", kv.num_missed_blocks, np.int32),
                    ("kv_cache_alloc_new_blocks", kv.num_new_allocated_blocks, np.int32),
                    ("kv_cache_alloc_total_blocks", kv.num_total_allocated_blocks, np.int32),
                    ("kv_cache_hit_rate", kv.kv_cache_hit_rate, np.float32),
                    ("arrival_time_ns", perf.arrival_time_ns, np.int64),
                    ("first_scheduled_time_ns", perf.first_scheduled_time_ns, np.int64),
                    ("first_token_time_ns", perf.first_token_time_ns, np.int64),
                    ("last_token_time_ns", perf.last_token_time_ns, np.int64),
                    ("acceptance_rate", perf.acceptance_rate, np.float32),
                    ("total_accepted_draft_tokens", perf.total_accepted_draft_tokens, np.int32),
                    ("total_draft_tokens", perf.total_draft_tokens, np.int32)):
                tensors.append(pb_utils.Tensor(name, np.array([value], dtype=dtype)))
        return tensors

    # ---- stop, cancellation ---------------------------------------------------------------------------------
    def _stop(self, triton_id, sender):
        if not triton_id:
            self._send(sender, error="A request id must be provided for request cancellation")
            return
        with self.lock:
            targets = [s for s in self.inflight.values() if s.triton_id == triton_id]
        for state in targets:
            if state.handle is not None:
                state.handle.abort()
        self._send(sender, error="Request cancelled by client", cancelled=True)

    def _watch_cancellation(self):
        while not self.stopping.wait(self.period_s):
            with self.lock:
                # Only open requests are asked: a sender whose final response went out must not be touched.
                cancelled = [s for s in self.inflight.values() if not s.done and s.request.is_cancelled()]
                for state in cancelled:
                    state.client_cancelled = True
            for state in cancelled:
                if state.handle is not None:
                    state.handle.abort()

    def _send(self, sender, outputs=None, error=None, final=True, cancelled=False):
        if error is not None:
            code = pb_utils.TritonError.CANCELLED if cancelled else pb_utils.TritonError.INTERNAL
            response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error, code))
        else:
            response = pb_utils.InferenceResponse(output_tensors=outputs or [])
        try:
            sender.send(response, flags=FINAL if final else 0)
        except Exception as err:  # the client went away: nothing left to tell it
            print(f"tensorrt_llm: could not send a response: {err}", file=sys.stderr)

    def finalize(self):
        self.stopping.set()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.shutdown()
