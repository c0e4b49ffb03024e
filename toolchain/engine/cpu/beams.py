"""Several answers per request: n sampled sequences, and beam search, as TensorRT-LLM's executor serves them.

Sampled (`beam_width` 1, `num_return_sequences` n > 1): the executor splits the request into n child requests
(LlmRequest::createChildRequest in cpp/tensorrt_llm/batch_manager/llmRequest.cpp), each with its own batch slot,
KV blocks and seed; their responses carry `sequence_index` 0..n-1. `children(params)` makes them: child i samples
with the request's seed + i (mod 2**64), a request without a seed counting as seed 0, so child 0 is the request
itself. UNVERIFIED: the seed rule is createChildRequest's as remembered (the sequence index added to the base
seed), not re-read from the source. The engine refuses n > 1 with beam width 1 in one request: callers submit
the children.

Beam search (`beam_width` W > 1, at most the engine's build_config.max_beam_width) runs as one request whose
sequences are its best beams (engine/cpu/beam_search.py, which also describes the search). What either returns
per sequence is a `BeamResult`. Refused here in one line: n > 1 with beam width 1 in one request, a beam width
above the build's, beam search with speculative decoding or stop words, and more sequences than beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from toolchain.engine.cpu.sampling import SamplingParams

SEED_MODULUS = 2**64  # seeds are UINT64 on the executor and in Triton's `seed` input


@dataclass
class BeamResult:
    """One returned sequence of a beam search (or, with `score` None, of a sampled child)."""

    tokens: list[int]  # generated tokens; the end_id that ended a beam is not among them (the executor drops it)
    reason: str  # "end_id" or "length"
    cum_log_prob: float | None = None  # sum of the chosen tokens' log-probs, the end token's included
    score: float | None = None  # cum_log_prob / length ** length_penalty, what the beams are ranked by
    log_probs: list[float] = field(default_factory=list)  # per token of `tokens` (output_log_probs)


def children(params: SamplingParams) -> list[SamplingParams]:
    """The child requests of a sampled request with num_return_sequences n: n requests of one sequence each,
    child i seeded with the request's seed + i (see the module docstring)."""
    if params.beam_width > 1 or params.num_return_sequences == 1:
        return [params]
    base = int(params.seed) if params.seed is not None else 0
    return [replace(params, num_return_sequences=1, seed=(base + i) % SEED_MODULUS)
            for i in range(params.num_return_sequences)]


def request_problem(params: SamplingParams, max_beam_width: int, speculative: str | None) -> str | None:
    """Why an n / beam request cannot run on an engine built with `max_beam_width` (and `speculative`
    decoding, named, or None), or None."""
    width, n = params.beam_width, params.num_return_sequences
    if width == 1:
        if n > 1:
            return (f"num_return_sequences {n} with beam_width 1 asks for {n} sampled sequences: submit them as "
                    "child requests (toolchain.engine.cpu.beams.children), one sequence each")
        return None
    if width > max_beam_width:
        return (f"beam_width {width} exceeds the engine's max_beam_width {max_beam_width}; rebuild it with "
                f"build.max_beam_width >= {width}")
    if speculative:
        return f"beam search (beam_width {width}) cannot be combined with speculative decoding ({speculative})"
    if n > width:
        return f"num_return_sequences {n} exceeds beam_width {width} (beam search returns at most its beams)"
    if params.stop_words:
        return "stop words with beam search (beam_width > 1) are not supported by the CPU engine"
    # The beam search (beam_search.py) scores raw log-softmax rows: the sampling controls, guides and the
    # log-prob record of a sampled request (penalties.py, guided.py, logprobs.py) are not applied to beams.
    # Refused rather than silently dropped; the beams' own cum_log_probs come with BeamResult.
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("min_p", 0.0), ("no_repeat_ngram_size", 0)):
        if getattr(params, name) != neutral:
            return f"{name} with beam search (beam_width > 1) is not supported by the CPU engine"
    for name in ("embedding_bias", "guide", "logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            return f"{name} with beam search (beam_width > 1) is not supported by the CPU engine"
    if params.bad_words or params.return_context_logits:
        what = "bad words" if params.bad_words else "return_context_logits"
        return f"{what} with beam search (beam_width > 1) is not supported by the CPU engine"
    return None
