"""`CpuEngine`: load an engine directory and run requests over its rank shards.

`generate` and the inflight batcher share the same two pieces: `start`
(validate a request, give it a KV cache and a sampler) and `step` (one forward
over any mix of prefilling and decoding requests, then one token each), so a
request gets the same tokens alone or batched.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import torch

from toolchain.engine.cpu.config import BuildLimits, ModelDims, read_engine_config
from toolchain.engine.cpu.model import Chunk, KVCache, Model
from toolchain.engine.cpu.sampling import Sampler, SamplingParams
from toolchain.engine.cpu.weights import load_stages
from toolchain.errors import ToolchainError


class Sequence:
    """One request in flight: its prompt, output so far, cache and sampler."""

    def __init__(self, prompt: list[int], params: SamplingParams, cache: KVCache):
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.cache: KVCache | None = cache
        self.sampler = Sampler(params)
        self.output: list[int] = []
        self.finished = False
        self.reason: str | None = None  # "length", "end_id", "stop_word", "cancelled", "error"
        self.error: str | None = None

    @property
    def prefilled(self) -> bool:
        return self.cache is not None and self.cache.length > 0

    def next_tokens(self) -> list[int]:
        return self.output[-1:] if self.prefilled else self.prompt

    def finish(self, reason: str) -> None:
        self.finished, self.reason = True, reason
        self.cache = None  # free the KV memory as soon as the request ends

    def accept(self, logits: torch.Tensor) -> list[int]:
        """Sample the next token from `logits` [V]; returns the tokens to emit (empty on end_id)."""
        token = self.sampler.pick(logits, len(self.output))
        if self.sampler.is_end(token):
            self.finish("end_id")
            return []
        self.output.append(token)
        if self.sampler.hits_stop(self.output):
            self.finish("stop_word")
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish("length")
        return [token]


class CpuEngine:
    def __init__(self, config: dict, dims: ModelDims, limits: BuildLimits, model: Model):
        self.config = config
        self.dims = dims
        self.limits = limits
        self.model = model

    @classmethod
    def load(cls, engine_dir: Path | str, *, num_threads: int | None = None) -> "CpuEngine":
        """Load and validate an engine directory.

        `num_threads` sets torch's intra-op threads for the whole process (None
        leaves them). Small models want 1: their matmuls are too small to split,
        and a contended second OpenMP thread made decoding 50x slower on the
        shared 2-core box.
        """
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        engine_dir = Path(engine_dir)
        config, dims, limits = read_engine_config(engine_dir)
        return cls(config, dims, limits, Model(dims, load_stages(engine_dir, dims)))

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    # -- requests ---------------------------------------------------------------

    def _ids_problem(self, ids) -> str | None:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            return f"prompt must be a list of token ids, got {type(ids).__name__}"
        if len(ids) == 0:
            return "empty prompt: at least one input token is required"
        for t in ids:  # numpy / torch integer scalars are fine; bools and floats are not
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                return f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})"
        return None

    def request_problem(self, prompt_ids, params: SamplingParams) -> str | None:
        """Why a request cannot run on this engine (TRT-LLM's limits), or None."""
        problem = self._ids_problem(prompt_ids)
        if problem is None and not isinstance(params, SamplingParams):
            problem = f"sampling parameters must be SamplingParams, got {type(params).__name__}"
        if problem is None:
            problem = params.problem(self.vocab_size)
        if problem is not None:
            return problem
        n, lim = len(prompt_ids), self.limits
        if n > lim.max_input_len:
            return f"prompt has {n} tokens, more than the engine's max_input_len {lim.max_input_len}"
        if n + params.max_new_tokens > lim.max_seq_len:
            return (f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the engine's "
                    f"max_seq_len {lim.max_seq_len}; ask for at most {lim.max_seq_len - n} new tokens")
        return None

    def start(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        problem = self.request_problem(prompt_ids, params)
        if problem is not None:
            raise ToolchainError(problem)  # the message names the limit and what would fit
        # The last sampled token is never fed back, so prompt + max_new_tokens - 1 positions suffice.
        capacity = len(prompt_ids) + params.max_new_tokens - 1
        return Sequence(prompt_ids, params, KVCache(self.dims, capacity))

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One forward for all `seqs` (prefill or decode each) and one sampled token each.

        Returns the tokens each sequence emits this step. Raises if the forward
        fails; no cache has advanced then, so the caller may retry any subset.
        """
        with torch.no_grad():
            logits = self.model.forward([Chunk(s.cache, s.next_tokens()) for s in seqs])
        emitted = []
        for s, row in zip(seqs, logits):
            try:
                emitted.append(s.accept(row))
            except Exception as err:  # one request's sampling failure must not cost the others their step
                s.finish("error")
                s.error = f"sampling failed: {err}"
                emitted.append([])
        return emitted

    # -- synchronous entry points ---------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """New tokens only, for one request, run to completion."""
        seq = self.start(prompt_ids, params)
        while not seq.finished:
            self.step([seq])
        if seq.error is not None:
            raise RuntimeError(seq.error)
        return seq.output

    def forward_logits(self, input_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab_size] (float32) for every position of `input_ids`."""
        problem = self._ids_problem(input_ids)
        if problem is not None:
            raise ToolchainError(problem)
        if len(input_ids) > self.limits.max_seq_len:
            raise ToolchainError(f"{len(input_ids)} tokens exceed the engine's max_seq_len {self.limits.max_seq_len}")
        cache = KVCache(self.dims, len(input_ids))
        with torch.no_grad():
            return self.model.forward([Chunk(cache, [int(t) for t in input_ids], all_logits=True)])[0]
