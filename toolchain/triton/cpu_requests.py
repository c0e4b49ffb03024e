"""What the CPU `tensorrt_llm` model (backend_models/tensorrt_llm.py) reads and returns beyond tokens: the guide
of guided decoding, the embedding bias, the gather checks for logits, and the log-prob and context-logit outputs,
shaped as the C++ tensorrtllm backend shapes them (fillTritonResponse in TensorRT-LLM's
triton_backend/inflight_batcher_llm/src/model_instance_state.cc: a leading 1 before the executor's tensors).

Nothing here imports Triton: outputs are (name, numpy array) pairs the model wraps in pb_utils.Tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolchain.triton.backend_params import is_unset

Outputs = list[tuple[str, np.ndarray]]


def guided_decoder(values: dict[str, Any], vocab_size: int) -> Any:
    """The GuidedDecoder of a model whose guided_decoding_backend is xgrammar, built from the tokenizer-info file at
    xgrammar_tokenizer_info_path; None when guided decoding is off (backend_params.check_load has checked the
    backend's name and that the file exists)."""
    if is_unset(values.get("guided_decoding_backend", ""), "guided_decoding_backend"):
        return None
    path = values.get("xgrammar_tokenizer_info_path", "")
    if is_unset(path, "xgrammar_tokenizer_info_path"):
        # What the C++ backend does then is UNVERIFIED; refusing is the conservative reading.
        raise ValueError("tensorrt_llm: guided_decoding_backend xgrammar needs xgrammar_tokenizer_info_path (the "
                         "tokenizer-info file model-repo writes with serving.guided_decoding_backend set)")
    from toolchain.engine.cpu.guided import GuidedDecoder

    return GuidedDecoder.from_info_file(path, vocab_size)


def _text(arr: np.ndarray | None, row: int, batch: int) -> str | None:
    if arr is None or arr.size == 0:
        return None
    flat = arr.reshape(-1)
    value = flat[row] if flat.size == batch else flat[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def guide(inputs: Any, row: int, decoder: Any) -> Any:
    """The Guide of one row from guided_decoding_guide_type / guided_decoding_guide, or None."""
    kind = _text(inputs.get("guided_decoding_guide_type"), row, inputs.batch)
    text = _text(inputs.get("guided_decoding_guide"), row, inputs.batch)
    if kind is None and text is None:
        return None
    if kind is None:
        raise ValueError("guided_decoding_guide given without guided_decoding_guide_type")
    if decoder is None:
        raise ValueError("guided decoding is not enabled for this model (its guided_decoding_backend is empty); "
                         "set serving.guided_decoding_backend: xgrammar in the spec and run model-repo again")
    from toolchain.engine.cpu.guided import Guide

    return Guide(kind, text or "")


def embedding_bias(inputs: Any, row: int) -> Any:
    """One row's embedding_bias [V] as a float32 tensor, None when absent or all zeros (no bias)."""
    arr = inputs.get("embedding_bias")
    if arr is None or arr.size == 0:
        return None
    arr = arr.reshape(inputs.batch, -1)[row] if arr.size % inputs.batch == 0 else arr.reshape(-1)
    if not np.any(arr):
        return None
    import torch

    return torch.from_numpy(np.array(arr, dtype=np.float32))


def check_gathered(build_config: dict, what: str) -> None:
    """The executor returns generation (context) logits only from an engine built with --gather_generation_logits
    (--gather_context_logits): build_config.gather_*_logits, read by cpp/tensorrt_llm/runtime/gptJsonConfig.cpp,
    default false, or an ExecutorConfig that sets them, which the Triton backend never does
    (getExecutorConfigFromParams in triton_backend/inflight_batcher_llm/src/model_instance_state.cc); otherwise
    enqueueing fails with executorImpl.cpp's words (generation's quoted; context's wording is UNVERIFIED)."""
    if build_config.get(f"gather_{what}_logits", False):
        return
    if what == "generation":
        raise ValueError("To return generation logits, gather_generation_logits must be enabled in "
                         "ExecutorConfig: this engine was built without --gather_generation_logits "
                         "(its build_config); rebuild it with the flag (for a draft_target draft: "
                         "set speculative.use_draft_logits true)")
    raise ValueError(f"To return {what} logits, gather_{what}_logits must be enabled: this engine was built without "
                     f"--gather_{what}_logits (its build_config); set build.gather_{what}_logits true in the spec "
                     "and rebuild")


def logprob_record(return_log_probs: bool, return_context_logits: bool, normalize: bool) -> Any:
    """The engine's record for a row that asks for log-probs or context logits, else None. Triton's log-probs are
    the C++ runtime's: in the distribution sampled from ("sampled"), or before top-k / top-p renormalisation when
    normalize_log_probs is false ("processed")."""
    if not (return_log_probs or return_context_logits):
        return None
    from toolchain.engine.cpu.logprobs import TokenLogprobs

    return TokenLogprobs(mode="sampled" if normalize else "processed")


class LogprobOutputs:
    """output_log_probs [1, 1, n] and cum_log_probs [1, 1] (return_log_probs), context_logits [1, P, V]
    (return_context_logits) of one row: in streaming, each response the log-probs of its new tokens and the
    context logits with the first; otherwise everything in the one response. Log-probs cover generated tokens
    only, whether or not the prompt is in output_ids."""

    def __init__(self, record: Any, log_probs: bool, context_logits: bool):
        self.record = record
        self.log_probs = log_probs
        self.context_logits = context_logits
        self._sent = 0
        self._context_sent = False

    def outputs(self, new_tokens: int, streaming: bool) -> Outputs:
        rec, out = self.record, []
        if self.log_probs:
            start = self._sent if streaming else 0
            end = self._sent + new_tokens if streaming else len(rec.tokens)
            self._sent = end
            out.append(("output_log_probs", np.array(rec.tokens[start:end], np.float32).reshape(1, 1, -1)))
            out.append(("cum_log_probs", np.array([[sum(rec.tokens[:end])]], np.float32)))
        if self.context_logits and not self._context_sent and rec.context_logits is not None:
            self._context_sent = True
            out.append(("context_logits", rec.context_logits.numpy()[None]))
        return out
