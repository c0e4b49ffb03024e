"""Log-probabilities and context logits of one request, in a record the caller owns and the engine fills.

Two modes, for the two paths that read them:

- "raw": the log-softmax of the model's own float32 logits at each position, before any sampling control. What
  the OpenAI server and the LLM API return (the issue checks it against HF's log-softmax within 1e-4).
- "sampled": the log-probability of the emitted token in the distribution it was actually drawn from, after
  bias, temperature, penalties, masks and top-k / top-p renormalisation, as TensorRT-LLM's C++ runtime reports
  output_log_probs and cum_log_probs to Triton (greedy gives 0.0 there: tensorrtllm_backend docs/model_config.md,
  issues #276 / #291). "processed" is the same before top-k / top-p renormalisation (normalize_log_probs false).

Prompt log-probabilities and context logits need the logits of every prompt position; a request asking for them
is run with prefix reuse off (reused blocks have no logits; TensorRT-LLM likewise serves context logits without
reuse — UNVERIFIED), chunk by chunk when the context is chunked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODES = ("raw", "sampled", "processed")


@dataclass
class TokenLogprobs:
    mode: str = "raw"
    top_k: int = 0  # alternatives kept per emitted token (SamplingParams.logprobs)
    prompt_top_k: int | None = None  # None: no prompt log-probs (SamplingParams.prompt_logprobs)
    keep_context_logits: bool = False
    tokens: list[float] = field(default_factory=list)  # one per emitted token, in order
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per emitted token, most likely first
    prompt: list[float | None] = field(default_factory=list)  # entry 0 is None: nothing before the first token
    prompt_top: list[list[tuple[int, float]]] = field(default_factory=list)
    context_logits: torch.Tensor | None = None  # [P, V] float32
    _context_rows: list[torch.Tensor] = field(default_factory=list, repr=False)
    _context_seen: int = 0  # prompt positions whose logits were recorded

    @property
    def cum(self) -> float:
        return float(sum(self.tokens))

    def problem(self) -> str | None:
        if self.mode not in MODES:
            return f"log-probability mode {self.mode!r} is not one of {', '.join(MODES)}"
        return None

    def configure(self, logprobs: int | None, prompt_logprobs: int | None, context_logits: bool) -> None:
        """Take what the request's SamplingParams ask for."""
        self.top_k = int(logprobs or 0)
        self.prompt_top_k = prompt_logprobs
        self.keep_context_logits = bool(context_logits)

    @property
    def wants_context(self) -> bool:
        return self.prompt_top_k is not None or self.keep_context_logits

    def add_context(self, rows: torch.Tensor, start: int, prompt: list[int]) -> None:
        """Logits rows [n, V] of positions start .. start + n - 1; those of prompt positions not recorded yet
        (a paused request's re-prefill repeats them) give the prompt log-probs of the positions after them."""
        p_len = len(prompt)
        for k in range(rows.shape[0]):
            pos = start + k
            if pos != self._context_seen or pos >= p_len:
                continue
            row = rows[k].float()
            self._context_seen += 1
            if self.keep_context_logits:
                self._context_rows.append(row.clone())
                if self._context_seen == p_len:
                    self.context_logits = torch.stack(self._context_rows)
                    self._context_rows = []
            if self.prompt_top_k is not None:
                if pos == 0:
                    self.prompt.append(None)
                    self.prompt_top.append([])
                if pos + 1 < p_len:
                    lp = torch.log_softmax(row, -1)
                    self.prompt.append(float(lp[prompt[pos + 1]]))
                    self.prompt_top.append(_top(lp, self.prompt_top_k))

    def add_tokens(self, rows: torch.Tensor, tokens: list[int], sampled: list[float]) -> None:
        """Emitted `tokens` chosen from raw logits `rows` [n, V], with the sampler's own log-probs `sampled`."""
        for i, token in enumerate(tokens):
            lp = torch.log_softmax(rows[i].float(), -1)
            self.tokens.append(float(lp[token]) if self.mode == "raw" else sampled[i])
            self.top.append(_top(lp, self.top_k))


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
