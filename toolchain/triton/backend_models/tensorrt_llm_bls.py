"""Triton Python model `tensorrt_llm_bls` (TensorRT-LLM 1.2 contract): text in, text out
through Business Logic Scripting instead of an ensemble.

preprocessing -> tensorrt_llm (streamed with `exec(decoupled=True)` when the
model is decoupled) -> postprocessing for every chunk; each chunk goes back as
`text_output` (the delta, or the text so far with `accumulate_tokens`), then a
separate flag-only final response. In decoupled mode each request runs on its
own thread, so one instance serves many requests at once, as the in-flight
batcher below it expects; a client cancellation is forwarded to tensorrt_llm
as a `stop` request for the same request id.

With `num_draft_tokens` > 0 and a draft model (`tensorrt_llm_draft_model_name`) it runs
draft-target speculative decoding as upstream's BLS does (with `draft_ngram_size` instead, the
drafts come from prompt lookup in the sequence itself) (TensorRT-LLM
triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py,
Decoder._spec_generate): the draft model proposes up to k tokens for the sequence so
far, the target verifies them as `draft_input_ids` with request_output_len k + 1, and the
loop goes on until max_tokens, an end or a stop word; one response carries the text. With
`use_draft_logits` the draft also returns its generation logits, which go to the target as
`draft_logits` (triton_decoder.py, _get_llm_tensors_from_request), so the target judges the draft
by probabilities (TensorRT-LLM's acceptDraftTokensByLogitsKernel) instead of its own choice.
Copied into <repo>/tensorrt_llm_bls/1/model.py.
"""

import json
import sys
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# BLS input -> preprocessing input
PREPROCESSING_INPUTS = {
    "text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT", "end_id": "END_ID", "pad_id": "PAD_ID",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}
# preprocessing output -> tensorrt_llm input
PREPROCESSED = {
    "INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths", "REQUEST_OUTPUT_LEN": "request_output_len",
    "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id", "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list", "EMBEDDING_BIAS": "embedding_bias",
    "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids",
}
# BLS input -> tensorrt_llm input, passed through unchanged (as [B,1])
PASSTHROUGH = {
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
    "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
    "beam_width": "beam_width", "stream": "streaming", "exclude_input_in_output": "exclude_input_in_output",
    "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens", "return_num_output_tokens": "return_num_output_tokens",
    "num_return_sequences": "num_return_sequences", "prompt_embedding_table": "prompt_embedding_table",
    "prompt_vocab_size": "prompt_vocab_size", "lora_task_id": "lora_task_id", "lora_weights": "lora_weights",
    "lora_config": "lora_config", "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
}
# tensorrt_llm outputs forwarded to the client as they are
FORWARDED = ("cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
             "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
             "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
             "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens",
             "num_output_tokens")
UNSUPPORTED = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")
# Request inputs that do not go to the models of a speculative step as they are.
SPEC_OWN = ("input_ids", "input_lengths", "request_output_len", "streaming", "exclude_input_in_output",
            "min_tokens", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
            "return_context_logits", "return_generation_logits")


def _param(config, key):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    if value is None or value == "" or value.startswith("${"):
        return None
    return value


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _output(response, name):
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()


class _Cancelled(Exception):
    pass


def _lookup(tokens, ngram_size, k):
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, trying n = ngram_size down to 1; [] when none recurs."""
    for n in range(min(ngram_size, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def _stop_end(tokens, start, prompt_len, stop_words):
    """Length of `tokens` up to the end of the first stop word that ends at or after `start` and lies
    within the output (as the engine matches them), or None."""
    for end in range(max(start, prompt_len) + 1, len(tokens) + 1):
        if any(end - len(w) >= prompt_len and tokens[end - len(w):end] == w for w in stop_words):
            return end
    return None


def _word_lists(arr):
    """A [1, 2, N] TensorRT-LLM word list (tokens, end offsets padded with -1) as token lists."""
    if arr is None or arr.size == 0:
        return []
    arr = arr.reshape(-1, 2, arr.shape[-1])[0]
    words, start = [], 0
    for end in arr[1]:
        if end < 0:
            break
        words.append([int(t) for t in arr[0, start:end]])
        start = int(end)
    return words


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        accumulate = _param(config, "accumulate_tokens")
        self.accumulate = accumulate is not None and accumulate.strip().lower() in ("1", "true", "t", "yes", "y")
        self.llm_model = _param(config, "tensorrt_llm_model_name") or "tensorrt_llm"
        self.draft_model = _param(config, "tensorrt_llm_draft_model_name")
        # speculative.mode ngram: drafts by prompt lookup instead of a draft model.
        ngram = _param(config, "draft_ngram_size")
        self.ngram_size = int(ngram) if ngram and ngram.isdigit() else 0
        # What tensorrt_llm returns when a request does not say (its exclude_input_in_output), for
        # speculative responses, which the BLS assembles itself.
        exclude = _param(config, "exclude_input_in_output")
        self.exclude_input = exclude is not None and exclude.strip().lower() in ("1", "true", "t", "yes", "y")
        if _param(config, "multimodal_encoders_name"):
            raise ValueError("tensorrt_llm_bls: multimodal_encoders_name is set, but this BLS serves text only; "
                             "leave it empty")
        self.threads = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        if not self.decoupled:
            return [self._run_unary(request) for request in requests]
        for request in requests:
            sender = request.get_response_sender()
            thread = threading.Thread(target=self._run_streaming, args=(request, sender), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None

    # ---- one request ------------------------------------------------------------------------------------------
    def _run_unary(self, request):
        try:
            if self._stream_requested(request):
                raise ValueError("Streaming is only supported if model is deployed using decoupled mode.")
            outputs = None
            for outputs in self._generate(request, None):  # noqa: B007 - the last response is the answer
                pass
            return pb_utils.InferenceResponse(output_tensors=outputs or [])
        except Exception as err:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"tensorrt_llm_bls: {err}"))

    def _run_streaming(self, request, sender):
        try:
            for outputs in self._generate(request, sender):
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
            sender.send(flags=FINAL)
        except _Cancelled:
            self._safe_send(sender, pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError("request cancelled")))
        except Exception as err:
            self._safe_send(sender, pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(f"tensorrt_llm_bls: {err}")))
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    @staticmethod
    def _safe_send(sender, response):
        try:
            sender.send(response, flags=FINAL)
        except Exception as err:
            print(f"tensorrt_llm_bls: could not send a response: {err}", file=sys.stderr)

    @staticmethod
    def _flag(request, name):
        value = _input(request, name)
        return value is not None and value.size > 0 and bool(value.reshape(-1)[0])

    @staticmethod
    def _stream_requested(request):
        stream = _input(request, "stream")
        return stream is not None and bool(stream.reshape(-1)[0])

    def _generate(self, request, sender):
        """Yield the output tensors of each response to send."""
        for name in UNSUPPORTED:
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise ValueError(f"{name} is not supported by this deployment")
        llm_inputs = self._preprocess(request)
        batch = llm_inputs["input_ids"].shape[0]
        for name, target in PASSTHROUGH.items():
            value = _input(request, name)
            if value is not None:
                # Inputs declared with reshape [] arrive as [B]; the LLM model wants [B,1].
                llm_inputs[target] = value.reshape(batch, 1) if value.ndim == 1 else value
        num_draft = _input(request, "num_draft_tokens")
        num_draft = int(num_draft.reshape(-1)[0]) if num_draft is not None and num_draft.size else 0
        if num_draft > 0:
            yield self._speculate(request, llm_inputs, num_draft, sender)
            return
        llm_id = f"bls-{uuid.uuid4().hex}"
        llm_request = pb_utils.InferenceRequest(
            model_name=self.llm_model, request_id=llm_id,
            inputs=[pb_utils.Tensor(k, v) for k, v in llm_inputs.items()],
            requested_output_names=["output_ids", "sequence_length", *FORWARDED])
        responses = llm_request.exec(decoupled=True) if self.decoupled else [llm_request.exec()]
        so_far = {}
        for response in responses:
            if sender is not None and sender.is_cancelled():
                self._stop_llm(llm_id)
                raise _Cancelled()
            if response.has_error():
                raise RuntimeError(response.error().message())
            tokens = _output(response, "output_ids")
            if tokens is None:  # the flag-only final response of the LLM model
                continue
            lengths = _output(response, "sequence_length")
            if self.accumulate:
                index = _output(response, "batch_index")
                key = 0 if index is None else int(index.reshape(-1)[0])
                seq = so_far.setdefault(key, [])
                seq += [int(t) for t in tokens.reshape(-1)[:int(lengths.reshape(-1)[0])]]
                tokens = np.array(seq, np.int32).reshape(1, 1, -1)
                lengths = np.array([[len(seq)]], np.int32)
            text = self._postprocess(tokens, lengths)
            outputs = [pb_utils.Tensor("text_output", text)]
            for name in FORWARDED:
                value = _output(response, name)
                if value is not None:
                    outputs.append(pb_utils.Tensor(name, value))
            yield outputs

    # ---- draft-target speculative decoding ----------------------------------------------------------------------
    def _speculate(self, request, llm_inputs, num_draft, sender):
        """Output tensors of the one response of a speculative request."""
        if not self.draft_model and not self.ngram_size:
            raise ValueError("num_draft_tokens needs a draft model or n-gram drafting, and this deployment has "
                             "neither (speculative.mode draft_target or ngram)")
        use_logits = self._flag(request, "use_draft_logits")
        if use_logits and not self.draft_model:
            raise ValueError("use_draft_logits needs a draft model (speculative.mode draft_target): n-gram drafts "
                             "come without logits; leave it false")
        # The checks of upstream's Request.validate and Decoder.decode.
        if self._stream_requested(request):
            raise ValueError("streaming is not supported with speculative decoding")
        if self._flag(request, "return_context_logits"):
            raise ValueError("context logits are not supported with speculative decoding")
        # Upstream asks neither model for them and answers without (docs/model_config.md: "not supported
        # when using speculative decoding"); refused here rather than dropped.
        if self._flag(request, "return_generation_logits"):
            raise ValueError("generation logits are not supported with speculative decoding")
        if llm_inputs["input_ids"].shape[0] > 1:
            raise ValueError("speculative decoding is not supported with batch size > 1")
        length = int(llm_inputs["input_lengths"].reshape(-1)[0])
        prompt = [int(t) for t in llm_inputs["input_ids"].reshape(-1)[:length]]
        output_len = int(llm_inputs["request_output_len"].reshape(-1)[0])
        common = {k: v for k, v in llm_inputs.items() if k not in SPEC_OWN}
        stop_words = [w for w in _word_lists(llm_inputs.get("stop_words_list")) if w]
        min_tokens = llm_inputs.get("min_tokens")
        min_tokens = int(min_tokens.reshape(-1)[0]) if min_tokens is not None and min_tokens.size else 0
        tokens, drafted, accepted = list(prompt), 0, 0
        while True:
            if sender is not None and sender.is_cancelled():
                raise _Cancelled()
            k = min(num_draft, len(prompt) + output_len - len(tokens) - 1)
            draft, step, draft_logits = [], 1, None
            if k > 0 and self.draft_model:
                draft, _, draft_logits = self._call(self.draft_model, common, tokens, k, min_tokens=k,
                                                    want_logits=use_logits)
            elif k > 0:
                draft = _lookup(tokens, self.ngram_size, k)
                if not draft:  # nothing to look up: decode k + 1 plain tokens instead of one
                    step = k + 1
            want = max(step, len(draft) + 1)
            # The request's min_tokens, counted over the whole output: what is still owed in this step.
            owed = min(want, max(0, min_tokens - (len(tokens) - len(prompt))))
            new, stats, _ = self._call(self.llm_model, common, tokens, want, draft=draft, draft_logits=draft_logits,
                                       min_tokens=owed)
            drafted += int(stats.get("total_draft_tokens", len(draft)))
            accepted += int(stats.get("total_accepted_draft_tokens", 0))
            start = len(tokens)
            tokens += new
            # A stop word may straddle two steps, which the target cannot see: end where plain decoding would.
            end = _stop_end(tokens, start, len(prompt), stop_words)
            if end is not None:
                del tokens[end:]
                break
            if len(tokens) >= len(prompt) + output_len:
                break
            if len(new) < want:  # the target ended (end_id) before all its tokens
                break
        exclude = _input(request, "exclude_input_in_output")
        exclude = self.exclude_input if exclude is None else bool(exclude.reshape(-1)[0])
        out_tokens = tokens[len(prompt):] if exclude else tokens
        text = self._postprocess(np.array(out_tokens, np.int32).reshape(1, 1, -1),
                                 np.array([[len(out_tokens)]], np.int32))
        outputs = [pb_utils.Tensor("text_output", text)]
        for flag, name, count in (("return_num_input_tokens", "num_input_tokens", len(prompt)),
                                  ("return_num_output_tokens", "num_output_tokens", len(tokens) - len(prompt))):
            value = _input(request, flag)
            if value is not None and bool(value.reshape(-1)[0]):
                outputs.append(pb_utils.Tensor(name, np.array([[count]], np.int32)))
        perf = _input(request, "return_perf_metrics")
        if perf is not None and bool(perf.reshape(-1)[0]):
            outputs += [pb_utils.Tensor("total_draft_tokens", np.array([[drafted]], np.int32)),
                        pb_utils.Tensor("total_accepted_draft_tokens", np.array([[accepted]], np.int32)),
                        pb_utils.Tensor("acceptance_rate",
                                        np.array([[accepted / drafted if drafted else 0.0]], np.float32))]
        return outputs

    def _call(self, model, common, tokens, output_len, *, draft=(), draft_logits=None, min_tokens=None,
              want_logits=False):
        """One non-streaming request to `model` for the sequence `tokens`: its new tokens, the
        draft statistics it reports, and with `want_logits` the generation logits of the new
        tokens [n, vocab] (else None). As upstream's _get_llm_tensors_from_request, only a draft
        request asks for generation logits (use_draft_logits) and none asks for context logits."""
        inputs = dict(common)
        inputs.update(input_ids=np.array([tokens], np.int32), input_lengths=np.array([[len(tokens)]], np.int32),
                      request_output_len=np.array([[output_len]], np.int32),
                      exclude_input_in_output=np.array([[True]], bool), streaming=np.array([[False]], bool),
                      return_perf_metrics=np.array([[True]], bool), return_context_logits=np.array([[False]], bool),
                      return_generation_logits=np.array([[want_logits]], bool))
        if min_tokens:
            inputs["min_tokens"] = np.array([[min_tokens]], np.int32)
        if draft:
            inputs["draft_input_ids"] = np.array([list(draft)], np.int32)
            if draft_logits is not None:
                inputs["draft_logits"] = np.ascontiguousarray(draft_logits[None], np.float32)  # [1, k, vocab]
        outputs = ["output_ids", "sequence_length", "total_draft_tokens", "total_accepted_draft_tokens"]
        request = pb_utils.InferenceRequest(
            model_name=model, request_id=f"bls-{uuid.uuid4().hex}",
            inputs=[pb_utils.Tensor(k, np.asarray(v)) for k, v in inputs.items()],
            requested_output_names=outputs + (["generation_logits"] if want_logits else []))
        responses = request.exec(decoupled=True) if self.decoupled else [request.exec()]
        new, stats, logits = [], {}, []
        for response in responses:
            if response.has_error():
                raise RuntimeError(f"{model}: {response.error().message()}")
            ids = _output(response, "output_ids")
            if ids is None:
                continue
            count = int(_output(response, "sequence_length").reshape(-1)[0])
            new += [int(t) for t in ids.reshape(-1)[:count]]
            for name in ("total_draft_tokens", "total_accepted_draft_tokens"):
                value = _output(response, name)
                if value is not None:
                    stats[name] = int(value.reshape(-1)[0])
            value = _output(response, "generation_logits") if want_logits else None
            if value is not None:
                # [1, beam, request_output_len, vocab]; rows past an early end are unwritten on a GPU, so
                # the first `count` are this response's tokens' (upstream takes the last len(draft), the same
                # rows when the draft made all k, which min_tokens k asks of it).
                logits.append(value.reshape(-1, value.shape[-1])[:count])
        if not want_logits:
            return new, stats, None
        rows = np.concatenate(logits) if logits else np.zeros((0, 0), np.float32)
        if len(rows) < len(new):
            raise RuntimeError(f"{model} returned generation_logits for {len(rows)} of its {len(new)} tokens")
        return new, stats, rows

    def _preprocess(self, request):
        inputs = []
        for name, target in PREPROCESSING_INPUTS.items():
            value = _input(request, name)
            if value is not None:
                inputs.append(pb_utils.Tensor(target, value))
        response = pb_utils.InferenceRequest(
            model_name="preprocessing", inputs=inputs, requested_output_names=list(PREPROCESSED)).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        llm_inputs = {}
        for name, target in PREPROCESSED.items():
            value = _output(response, name)
            if value is None:
                continue
            if name == "EMBEDDING_BIAS" and value.size == 0:
                continue  # nothing to bias; leave the input out as the ensemble's LLM sees it empty
            llm_inputs[target] = value
        return llm_inputs

    def _postprocess(self, tokens, lengths):
        response = pb_utils.InferenceRequest(
            model_name="postprocessing", requested_output_names=["OUTPUT"],
            inputs=[pb_utils.Tensor("TOKENS_BATCH", tokens.astype(np.int32)),
                    pb_utils.Tensor("SEQUENCE_LENGTH", lengths.astype(np.int32))]).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        return _output(response, "OUTPUT")

    def _stop_llm(self, llm_id):
        """The 1.2 way to cancel an in-flight LLM request: `stop=true` with its id
        (plus the required inputs as dummies)."""
        try:
            stop = pb_utils.InferenceRequest(
                model_name=self.llm_model, request_id=llm_id, requested_output_names=["output_ids"],
                inputs=[pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int32)),
                        pb_utils.Tensor("input_lengths", np.zeros((1, 1), np.int32)),
                        pb_utils.Tensor("request_output_len", np.zeros((1, 1), np.int32)),
                        pb_utils.Tensor("stop", np.ones((1, 1), bool))])
            for _ in stop.exec(decoupled=True):  # drain up to the empty final response
                pass
        except Exception as err:
            print(f"tensorrt_llm_bls: stop request failed: {err}", file=sys.stderr)

    def finalize(self):
        deadline = time.monotonic() + 5.0
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
