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
- Embedding bias, penalties, bad words, no_repeat_ngram_size and min_p are applied
  by penalties.py in the C++ runtime's order; a guide (guided.py) masks what its
  grammar forbids, and its matcher ending finishes the request as end_id does.
"""

from __future__ import annotations

import numbers
import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from toolchain.engine.cpu.guided import Guide
from toolchain.engine.cpu.penalties import filtered, process, reads_history

if TYPE_CHECKING:
    from toolchain.engine.cpu.guided import GuideMatcher


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
    repetition_penalty: float = 1.0  # > 0; seen token: logit > 0 ? logit / p : logit * p
    presence_penalty: float = 0.0  # subtracted once from every token id in prompt + output
    frequency_penalty: float = 0.0  # subtracted per occurrence in prompt + output
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p times the likeliest
    embedding_bias: torch.Tensor | None = None  # float32 [V], added to the logits first
    bad_words: list[list[int]] = field(default_factory=list)
    no_repeat_ngram_size: int = 0  # 0: off
    logprobs: int | None = None  # k >= 0: each emitted token's log-prob and its k likeliest alternatives
    prompt_logprobs: int | None = None  # k >= 0: log-probs of prompt positions 1 .. P-1 (+ top k)
    return_context_logits: bool = False
    guide: Guide | None = None
    # Several answers and beam search (engine/cpu/beams.py): n sampled sequences are child requests; with
    # beam_width > 1 the min(num_return_sequences, beam_width) best beams, scored with length_penalty,
    # early_stopping 1 ending the search once beam_width beams have finished, 0 by HF's heuristic.
    num_return_sequences: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: int = 1
    # LoRA (engine/cpu/lora.py): the adapter's task id in the engine's LoRA cache; None runs the base model.
    # Children and beams keep it; KV prefix reuse is keyed by it.
    lora_task_id: int | None = None

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
        if self.lora_task_id is not None and (not is_int(self.lora_task_id) or self.lora_task_id < 0):
            return f"lora_task_id must be a non-negative integer, got {self.lora_task_id!r}"
        if self.early_stopping not in (0, 1):  # TRT-LLM's other values ("never") are not implemented here
            return f"early_stopping must be 0 or 1, got {self.early_stopping!r}"
        return self._controls_problem(vocab_size, is_int)

    def _controls_problem(self, vocab_size: int, is_int) -> str | None:
        def is_num(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            return f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)):
                return f"{name} must be a finite number, got {getattr(self, name)!r}"
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            return f"min_p must be within [0, 1], got {self.min_p!r}"
        bias = self.embedding_bias
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab_size,):
                return f"embedding_bias must be a float tensor of [{vocab_size}] (the vocabulary), got " \
                       f"{list(getattr(bias, 'shape', [])) or type(bias).__name__}"
            if not bias.is_floating_point() or bool(torch.isnan(bias).any()):
                return "embedding_bias must hold floats, none of them NaN"
        for word in self.bad_words:
            if not isinstance(word, (list, tuple)) or not word or \
                    not all(is_int(t) and 0 <= t < vocab_size for t in word):
                return f"each bad word must be a non-empty list of token ids below {vocab_size}, got {word!r}"
        if not is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            return f"no_repeat_ngram_size must be a non-negative integer, got {self.no_repeat_ngram_size!r}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or k < 0):
                return f"{name} must be a non-negative integer or None, got {k!r}"
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                return f"guide must be a Guide, got {type(self.guide).__name__}"
            return self.guide.problem()
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
        self.guide: GuideMatcher | None = None  # the request's grammar state (guided.py), set by the engine
        # The picked token's log-prob in the distribution it was drawn from ("sampled") and before top-k / top-p
        # ("processed"), for TokenLogprobs' modes of those names.
        self.last_sampled = 0.0
        self.last_processed = 0.0
        self.wants_processed = False  # set by the engine for a "processed" record: a log-softmax per pick otherwise saved
        self.reads_history = reads_history(params)  # pick() needs the sequence so far

    def pick(self, logits: torch.Tensor, generated: int, tokens: list[int] | None = None) -> int:
        """The next token from last-position logits [V], `generated` tokens already produced and `tokens`
        the whole sequence so far (prompt + output, for penalties and n-gram masks)."""
        p = self.params
        logits = process(logits, p, tokens if tokens is not None else [], generated)
        if self.guide is not None:
            logits = self.guide.mask(logits)
        processed = torch.log_softmax(logits, -1) if self.wants_processed else None
        if p.greedy:
            token = int(torch.argmax(logits))
            self.last_sampled = 0.0  # the greedy distribution puts all its mass on the pick
        else:
            logits = filtered(logits, p)
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
            self.last_sampled = float(torch.log(probs[token]))
        if processed is not None:
            self.last_processed = float(processed[token])
        if self.guide is not None:
            self.guide.accept(token)
        return token

    def picks_argmax(self, generated: int) -> bool:
        """Whether `pick` would take the argmax of the logits exactly as given (greedy, nothing to process or
        record): the step then takes it from one argmax over every such request's row (Chunk.want_argmax)."""
        p = self.params
        return (p.greedy and p.temperature in (0, 1) and p.embedding_bias is None and not self.reads_history
                and self.guide is None and not self.wants_processed and not (0 <= p.end_id and generated < p.min_tokens))

    def guide_done(self) -> bool:
        """The guide's grammar is complete and its stop token was picked: the request ends as on end_id."""
        return self.guide is not None and self.guide.terminated

    def is_end(self, token: int) -> bool:
        return token == self._end_id

    def hits_stop(self, output: list[int]) -> bool:
        return any(len(w) <= len(output) and output[-len(w):] == w for w in self._stops)
