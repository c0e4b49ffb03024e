"""The LLM API's log-probability outputs (tensorrt_llm/executor/result.py: `Logprob(logprob, rank)`,
`TokenLogprobs = list[dict[int, Logprob]]`) from the CPU engine's TokenLogprobs record ("raw" mode, the
log-softmax of the model's own logits, as the PyTorch backend returns them).

Each position's dict holds the top-k tokens (rank 1 the most likely) and the emitted token, whose rank is
its place among the top-k when it is there, else None (UNVERIFIED: the PyTorch backend computes the
emitted token's rank over the whole vocabulary)."""

from __future__ import annotations

from typing import NamedTuple


class Logprob(NamedTuple):
    logprob: float
    rank: int | None = None


def _position(token: int, value: float | None, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    out = {int(t): Logprob(float(v), r) for r, (t, v) in enumerate(top, 1)}
    if value is not None and int(token) not in out:
        out[int(token)] = Logprob(float(value))
    return out


def token_logprobs(tokens: list[int], record) -> list[dict[int, Logprob]]:
    """One dict per emitted token."""
    return [_position(t, record.tokens[i], record.top[i]) for i, t in enumerate(tokens)]


def prompt_logprobs(prompt: list[int], record) -> list[dict[int, Logprob] | None]:
    """One entry per prompt token; the first is None (nothing comes before it)."""
    out: list[dict[int, Logprob] | None] = [None]
    for j in range(1, min(len(prompt), len(record.prompt))):
        top = record.prompt_top[j] if j < len(record.prompt_top) else []
        out.append(_position(prompt[j], record.prompt[j], top))
    return out
