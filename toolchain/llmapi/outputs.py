"""What `CpuLLM.generate_async` answers, under the LLM API's names (tensorrt_llm/executor/result.py:
`RequestOutput`, `CompletionOutput`; tensorrt_llm/llmapi/llm.py), and how several sequences of one request
become its `outputs`.

Beam search (`use_beam_search`, beam width `best_of` or else `n`: the LLM API's SamplingParams doc) answers
`outputs[j]` per returned beam, best first, each with its `cumulative_logprob` (the beam's, the end token's
log-prob included: engine/cpu/beams.py BeamResult). Sampled `best_of` > n ("sampling best_of responses and
return n generations") keeps the n sequences with the highest cumulative log-prob, best first, re-indexed
0..n-1 (vLLM's rule; UNVERIFIED that the LLM API sorts them the same way), ranked by each child's "raw"
log-prob record (engine/cpu/logprobs.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from toolchain.llmapi.logprobs import Logprob
from toolchain.llmapi.lora import requests_for


@dataclass
class KvCacheMetrics:
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_total_allocated_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class RequestPerfMetrics:
    """The LLM API's per-request perf metrics (RequestOutput.outputs[0].request_perf_metrics)."""

    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # with `logprobs`: the sum of the generated tokens' log-probs
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    request_perf_metrics: RequestPerfMetrics | None = None
    _last_text_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None


def beam_outputs(results: list, decode, prompt: list[int], exclude_input: bool, skip_special_tokens: bool,
                 logprobs: bool) -> list[CompletionOutput]:
    """One CompletionOutput per returned beam (beams.BeamResult, best first). `decode(ids, skip_special_tokens=)`
    is the tokenizer's; `logprobs`: each token's own log-prob (a beam carries no alternatives)."""
    outs = []
    for j, beam in enumerate(results):
        ids = list(beam.tokens) if exclude_input else prompt + list(beam.tokens)
        c = CompletionOutput(index=j, token_ids=ids, finish_reason="stop" if beam.reason == "end_id" else "length",
                             cumulative_logprob=beam.cum_log_prob)
        c.text = decode(ids, skip_special_tokens=skip_special_tokens)
        if logprobs:
            c.logprobs = [{int(t): Logprob(float(v))} for t, v in zip(beam.tokens, beam.log_probs, strict=True)]
        outs.append(c)
    return outs


def keep_best(out: RequestOutput, n: int, records: list) -> None:
    """Sampled best_of > n: `out.outputs` cut to the n whose record (one per output, in order) sums highest,
    best first (ties: the earlier child), re-indexed."""
    ranked = sorted(range(len(out.outputs)), key=lambda j: -records[j].cum)[:n]
    out.outputs = [out.outputs[j] for j in ranked]
    for j, (c, at) in enumerate(zip(out.outputs, ranked, strict=True)):
        c.index = j
        if c.cumulative_logprob is None:  # what it was ranked by, also when no log-probs were asked for
            c.cumulative_logprob = float(records[at].cum)


def generate_all(llm: Any, prompts, sampling_params=None, lora_request=None):
    """`LLM.generate` over `generate_async` (tensorrt_llm/llmapi/llm.py): one prompt (text or token ids) or a list
    of them, one SamplingParams or a list aligned with the prompts, likewise one LoRARequest or a list (the
    multi-LoRA example of docs/source/features/lora.md: "Apply different LoRAs to different prompts"). All are
    queued before any is waited for, so they share the engine's batches; a prompt's output is returned once finished
    (a single prompt's alone, as LLM.generate returns it)."""
    single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
    batch = [prompts] if single else list(prompts)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
    if len(params) != len(batch):
        raise ValueError(f"sampling_params has {len(params)} entries for {len(batch)} prompts; give one per prompt")
    loras = requests_for(lora_request, len(batch))
    done = [threading.Event() for _ in batch]
    outputs: list = [None] * len(batch)
    handles = []

    def finished(i: int):
        def on_output(out) -> None:
            if out.finished:
                outputs[i] = out
                done[i].set()
        return on_output

    try:
        for i, (prompt, sp, lora) in enumerate(zip(batch, params, loras, strict=True)):
            handles.append(llm.generate_async(prompt, sp, on_output=finished(i), lora_request=lora))
    except BaseException:
        for handle in handles:  # all or none, as a refused prompt ends LLM.generate
            handle.abort()
        raise
    for event in done:
        event.wait()
    return outputs[0] if single else outputs
