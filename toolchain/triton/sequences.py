"""Beam search and num_return_sequences on the tensorrt_llm CPU stand-in (backend_models/tensorrt_llm.py), as the
C++ backend answers them (triton_backend/inflight_batcher_llm/src/utils.cc getSamplingConfigFromTensors and
model_instance_state.cc fillTritonResponse, TensorRT-LLM 1.2):

* `beam_width` W > 1 (at most the model's max_beam_width parameter, itself at most the engine's build): one
  request, one response holding its best beams, `output_ids` [1, beams, len] padded with -1 and
  `sequence_length` [1, beams], `cum_log_probs` [1, beams] and `output_log_probs` [1, beams, len] with
  return_log_probs. Without a `num_return_sequences` input every beam comes back (the executor's
  getNumReturnBeams), with one the best that many. Streaming is refused: whether a streamed beam search sends
  whole beams or deltas is not documented (UNVERIFIED either way), and the CPU stand-in does not guess.
* `num_return_sequences` n > 1 with beam width 1: n child requests (engine/cpu/beams.py `children`), each
  answering on its own, streamed or not, with `sequence_index` [1, 1] (0..n-1); the request's final flag rides on
  the response that completes the last child. Like batch > 1, it needs the decoupled transaction policy (one
  request, several responses).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from toolchain.engine.cpu.beams import BeamResult, children
from toolchain.engine.cpu.sampling import SamplingParams


def model_beam_width(values: dict, engine) -> int:
    """The model's max_beam_width parameter, refused (ValueError) above the engine's build."""
    width, built = values["max_beam_width"], engine.limits.max_beam_width
    if not 1 <= width <= built:
        raise ValueError(f"tensorrt_llm: max_beam_width {width} is outside the engine's 1..{built} "
                         "(build.max_beam_width); rebuild the engine or lower the parameter")
    return width


def check_request(inputs, decoupled: bool, max_beam_width: int) -> None:
    """Raise ValueError (one line) for a request's beam widths and num_return_sequences (per row of the
    stand-in's `_Inputs`) that this model does not serve."""
    streaming = inputs.scalar("streaming", 0, False, bool)
    for row in range(inputs.batch):
        width, n = inputs.scalar("beam_width", row, 1), inputs.scalar("num_return_sequences", row)
        if width < 1 or (n is not None and n < 1):
            raise ValueError(f"beam_width ({width}) and num_return_sequences ({n}) must be positive")
        if width > max_beam_width:
            raise ValueError(f"beam_width {width} exceeds the model's max_beam_width {max_beam_width} "
                             "(the max_beam_width parameter, at most the engine's build.max_beam_width)")
        if width > 1 and streaming:
            raise ValueError("streaming with beam_width > 1 is not supported by the CPU engine (whether each "
                             "response carries whole beams or deltas is undocumented); send streaming=false")
        for flag in ("return_generation_logits", "return_context_logits"):
            if width > 1 and inputs.scalar(flag, row, False, bool):
                raise ValueError(f"{flag} with beam_width > 1 is not supported by the CPU engine")
        if width == 1 and n is not None and n > 1 and not decoupled:
            raise ValueError("num_return_sequences > 1 requires the tensorrt_llm model to use the decoupled "
                             "transaction policy (one response per sequence)")


def sequences(params: SamplingParams, count_given: bool) -> list[tuple[int | None, SamplingParams]]:
    """The engine requests of one row, each with the sequence_index its responses carry (None: no index).
    A beam search without a num_return_sequences input returns all its beams."""
    if params.beam_width > 1:
        return [(None, params if count_given else replace(params, num_return_sequences=params.beam_width))]
    kids = children(params)
    return [(i if len(kids) > 1 else None, child) for i, child in enumerate(kids)]


def beam_arrays(row, log_probs: bool) -> list[tuple[str, np.ndarray]]:
    """The outputs of a finished beam search's response (the stand-in's `_Row`): each beam with the prompt
    unless excluded, padded with -1; with return_log_probs the beams' cum_log_probs and per-token
    output_log_probs (padded with 0)."""
    beams: list[BeamResult] = row.beam_results
    rows = [(b.tokens if row.exclude_input else row.prompt + b.tokens) for b in beams]
    width = max(len(r) for r in rows)
    ids = np.full((1, len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        ids[0, i, :len(r)] = r
    out: list[tuple[str, np.ndarray]] = [("output_ids", ids),
                                         ("sequence_length", np.array([[len(r) for r in rows]], np.int32))]
    if log_probs:
        longest = max(len(b.log_probs) for b in beams)
        per_token = np.zeros((1, len(beams), longest), np.float32)
        for i, b in enumerate(beams):
            per_token[0, i, :len(b.log_probs)] = b.log_probs
        out += [("cum_log_probs", np.array([[b.cum_log_prob or 0.0 for b in beams]], np.float32)),
                ("output_log_probs", per_token)]
    return out
