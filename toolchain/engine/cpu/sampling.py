"""Sampling parameters and the per-request token picker, with TensorRT-LLM semantics.

- Greedy when top_k is 0 or 1 and top_p <= 0; temperature 0 also means greedy
  (clients send it for "deterministic"), so it never divides by zero.
- Otherwise temperature, then top-k, then top-p (renormalised after top-k),
  drawn from a per-request generator seeded from `seed` (None means 0, as
  TRT-LLM's default random seed), so a request's tokens do not depend on what
  else is in the batch. The LLM-API stand-ins (PyTorch backend) give a request
  without a seed one from `UnseededStream` instead, so such requests differ.
- `end_id` stops generation and is not part of the output (the executor drops
  it); -1 never stops. `min_tokens` masks end_id until that many tokens exist.
- A stop word (a token-id sequence) stops generation when the generated tail
  matches it; its tokens stay in the output.
"""

from __future__ import annotations

import numbers
import random
import threading
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    end_id: int = -1
    pad_id: int | None = None  # accepted for interface parity; the engine never pads outputs
    stop_words: list[list[int]] = field(default_factory=list)
    min_tokens: int = 0
    # Several answers and beam search (engine/cpu/beams.py): n sampled sequences are child requests; with
    # beam_width > 1 the min(num_return_sequences, beam_width) best beams, scored with length_penalty,
    # early_stopping 1 ending the search once beam_width beams have finished, 0 by HF's heuristic.
    num_return_sequences: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: int = 1

    @property
    def greedy(self) -> bool:
        return (self.top_k in (0, 1) and self.top_p <= 0) or self.temperature == 0

    def problem(self, vocab_size: int) -> str | None:
        """Why these parameters are unusable, or None."""
        def is_int(v) -> bool:  # numpy integers from a Triton request count too
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            return f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            return f"temperature must be >= 0, got {self.temperature!r}"
        if not is_int(self.top_k) or self.top_k < 0:
            return f"top_k must be a non-negative integer, got {self.top_k!r}"
        if not isinstance(self.top_p, (int, float)) or not 0 <= self.top_p <= 1:
            return f"top_p must be within [0, 1], got {self.top_p!r}"
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            return f"min_tokens must be a non-negative integer, got {self.min_tokens!r}"
        if not is_int(self.end_id) or not -1 <= self.end_id < vocab_size:
            return f"end_id must be -1 or a token id below {vocab_size}, got {self.end_id!r}"
        if self.seed is not None and not is_int(self.seed):
            return f"seed must be an integer, got {self.seed!r}"
        for word in self.stop_words:
            if not isinstance(word, (list, tuple)) or not word or not all(is_int(t) for t in word):
                return f"each stop word must be a non-empty list of token ids, got {word!r}"
        for name in ("num_return_sequences", "beam_width"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                return f"{name} must be a positive integer, got {getattr(self, name)!r}"
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            return f"length_penalty must be a number, got {self.length_penalty!r}"
        if self.early_stopping not in (0, 1):  # TRT-LLM's other values ("never") are not implemented here
            return f"early_stopping must be 0 or 1, got {self.early_stopping!r}"
        return None


# TensorRT-LLM's PyTorch backend (what trtllm-serve and LLM() run) samples a request that names no seed
# from one engine-wide torch.Generator seeded once with 42 ("for multi-GPU consistency"), so successive
# unseeded requests draw on and differ, and a restarted server repeats the same sequence
# (NVIDIA/TensorRT-LLM tensorrt_llm/_torch/pyexecutor/sampler.py, TorchSampler.__init__ `_global_seed = 42`
# and get_generator). The C++ runtime behind Triton's tensorrtllm backend instead seeds every request
# with 0 when none is given (tensorrt_llm/sampling_params.py: "seed ... None means using C++ runtime
# default 0"): that path keeps SamplingParams.seed None.
PYTORCH_BACKEND_SEED = 42


class UnseededStream:
    """Seeds for the requests that name none, drawn from one generator seeded PYTORCH_BACKEND_SEED per
    server (or LLM()), as the PyTorch backend's shared generator. Each request still gets a generator of
    its own, so its tokens do not depend on the batch it runs in."""

    def __init__(self, seed: int = PYTORCH_BACKEND_SEED):
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # LLM.generate_async may be called from several threads

    def seed(self, requested: int | None) -> int:
        """`requested` when the request named a seed, else the stream's next one."""
        if requested is not None:
            return requested
        with self._lock:
            return self._rng.getrandbits(63)


class Sampler:
    """Picks one request's tokens and decides when it is finished."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator().manual_seed(int(params.seed) if params.seed is not None else 0)
        self._stops = [[int(t) for t in w] for w in params.stop_words]
        self._end_id = int(params.end_id)

    def pick(self, logits: torch.Tensor, generated: int) -> int:
        """The next token from last-position logits [V], `generated` tokens already produced."""
        p = self.params
        if 0 <= self._end_id and generated < p.min_tokens:
            logits = logits.clone()
            logits[self._end_id] = float("-inf")
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if 0 < p.top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens before it already reach top_p (the first always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            logits = logits.clone()
            logits[order[drop]] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def is_end(self, token: int) -> bool:
        return token == self._end_id

    def hits_stop(self, output: list[int]) -> bool:
        return any(len(w) <= len(output) and output[-len(w):] == w for w in self._stops)
