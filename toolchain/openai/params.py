"""An OpenAI request's sampling fields as the CPU engine's `SamplingParams`, with trtllm-serve's checks.

trtllm-serve builds the LLM API's SamplingParams from the request (tensorrt_llm/serve/openai_protocol.py,
`CompletionRequest.to_sampling_params` / `ChatCompletionRequest.to_sampling_params`); the fields the CPU
engine implements are passed on here under the engine contract's names (penalties, min_p, logit_bias as an
embedding bias, log-probabilities, the guided-decoding guide). Range checks on penalties and min_p are the
engine's (`SamplingParams.problem`, reached through `request_problem`), so both servers word them alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from toolchain.engine.cpu import SamplingParams
from toolchain.openai.protocol import ApiError

LOGIT_BIAS_LIMIT = 100.0  # trtllm-serve and OpenAI: each bias within [-100, 100]


def embedding_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> torch.Tensor | None:
    """`logit_bias` as a float32 [V] bias added to the logits, with trtllm-serve's checks and words
    (openai_protocol.py, `_logit_bias_to_embedding_bias`)."""
    if not logit_bias:
        return None
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"Invalid logit_bias key '{key}': must be a valid integer token ID") from None
        if not 0 <= token < vocab_size:
            raise ApiError(f"Token ID {token} out of vocabulary range [0, {vocab_size})")
        if not math.isfinite(value) or abs(value) > LOGIT_BIAS_LIMIT:
            raise ApiError(f"logit_bias value for token ID {token} must be in [-100, 100]")
        bias[token] = float(value)
    return bias


def deduced_max_tokens(req, prompt: list[int], max_input_len: int, max_seq_len: int) -> int:
    """The request's max_tokens, or what max_seq_len leaves after the prompt when it sends none."""
    if len(prompt) > max_input_len:
        raise ApiError(f"the prompt has {len(prompt)} tokens, more than the engine's max_input_len "
                       f"{max_input_len}; shorten it")
    room = max_seq_len - len(prompt)
    max_tokens = req.max_tokens
    if max_tokens is None:
        # trtllm-serve passes an absent max_tokens on as None and the executor deduces it as whatever
        # max_seq_len leaves after the prompt (NVIDIA/TensorRT-LLM tensorrt_llm/executor/base_worker.py,
        # _deduce_max_tokens: default_max_tokens = max_seq_len - prompt_len).
        max_tokens = room
    elif max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}")
    elif max_tokens > room:
        raise ApiError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                       f"max_seq_len {max_seq_len}; ask for at most {room} tokens")
    if room < 1:
        raise ApiError(f"the prompt ({len(prompt)} tokens) leaves no room under max_seq_len {max_seq_len}")
    return max_tokens


def logprob_counts(req) -> tuple[int | None, int | None]:
    """(log-probs per generated token, per prompt token) to ask the engine for; None asks for none.
    Completions: `logprobs` alternatives, and with `echo` the prompt's too. Chat: trtllm-serve asks
    for `1 if not top_logprobs else top_logprobs` when `logprobs` is true."""
    if hasattr(req, "echo"):
        k = req.logprobs
        return k, (k if req.echo and k is not None else None)
    if req.logprobs:
        return (req.top_logprobs or 1), None
    return None, None


def engine_params(req, prompt: list[int], *, limits, vocab_size: int, end_id: int, stop_ids: list[int],
                  seed: int, guide: Any = None) -> SamplingParams:
    """The engine's SamplingParams for one prompt of `req`."""
    max_tokens = deduced_max_tokens(req, prompt, limits.max_input_len, limits.max_seq_len)
    if req.temperature is not None and req.temperature < 0:
        raise ApiError(f"temperature must be >= 0, got {req.temperature}")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {req.top_p}")
    for token in req.stop_token_ids or ():
        if not 0 <= token < vocab_size:
            raise ApiError(f"stop_token_ids: token id {token} is outside the vocabulary [0, {vocab_size})")
    logprobs, prompt_logprobs = logprob_counts(req)
    extra: dict[str, Any] = {}
    if logprobs is not None:
        extra["logprobs"] = logprobs
    if prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs
    if guide is not None:
        extra["guide"] = guide
    bias = embedding_bias(req.logit_bias, vocab_size)
    if bias is not None:
        extra["embedding_bias"] = bias
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p,
        seed=seed,
        end_id=-1 if req.ignore_eos else end_id,
        stop_words=([] if req.ignore_eos else [[i] for i in stop_ids]) + [[int(t)] for t in req.stop_token_ids or ()],
        min_tokens=req.min_tokens,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        min_p=req.min_p,
        **extra)
