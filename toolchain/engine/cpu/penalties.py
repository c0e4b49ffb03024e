"""The logits processing of TensorRT-LLM's C++ sampler before a token is picked.

`process` applies, in one place and in this order (cpp/tensorrt_llm/kernels/penaltyKernels.cu,
batchApplyPenalty, then banBadWords / banRepeatNgram, then the guided-decoding bitmask; the exact
order across kernels is UNVERIFIED against upstream, so it is kept in this one function):

    embedding bias -> temperature -> repetition / presence / frequency penalties
    -> min_tokens end_id mask -> bad words and no-repeat n-gram masks -> (guide's mask, the caller's)

The penalties count every token of the sequence, prompt and output alike (as the C++ runtime's
penalty kernel reads the whole output-ids buffer, which begins with the prompt). `filtered` then
keeps what top-k, top-p and min_p leave of the processed logits.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

# `p` below is a sampling.SamplingParams (sampling.py imports this module, so it is not imported back).
SamplingParams = Any

NEG_INF = float("-inf")


def reads_history(p: SamplingParams) -> bool:
    """Whether `process` reads the tokens so far (penalties, bad words, the no-repeat n-gram mask): the
    sequence is handed to it only then, not copied for every pick of every request."""
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.bad_words) or p.no_repeat_ngram_size > 0)


def penalised(logits: torch.Tensor, p: SamplingParams, tokens: list[int]) -> torch.Tensor:
    """Repetition, presence and frequency penalties over `tokens` (prompt + output)."""
    if not tokens or (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return logits
    counts = Counter(tokens)
    ids = torch.tensor(list(counts), dtype=torch.long)
    seen = logits[ids]
    if p.repetition_penalty != 1.0:
        # TRT-LLM: logit < 0 ? logit * penalty : logit / penalty (penaltyKernels.cu, applyPenalty)
        seen = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    if p.presence_penalty != 0.0:
        seen = seen - p.presence_penalty
    if p.frequency_penalty != 0.0:
        seen = seen - p.frequency_penalty * torch.tensor(list(counts.values()), dtype=seen.dtype)
    logits = logits.clone()
    logits[ids] = seen
    return logits


def banned(p: SamplingParams, tokens: list[int]) -> set[int]:
    """Token ids masked by bad words and no_repeat_ngram_size given the sequence so far."""
    out: set[int] = set()
    for word in p.bad_words:
        # A bad word's last token is banned when the sequence ends with the rest of it (a one-token word always).
        prefix = list(word[:-1])
        if not prefix or (len(prefix) <= len(tokens) and tokens[-len(prefix):] == prefix):
            out.add(int(word[-1]))
    n = p.no_repeat_ngram_size
    if n == 1:
        out.update(tokens)
    elif n > 1 and len(tokens) >= n:
        tail = tokens[len(tokens) - n + 1:]
        for i in range(len(tokens) - n + 1):
            if tokens[i:i + n - 1] == tail:
                out.add(tokens[i + n - 1])
    return out


def process(logits: torch.Tensor, p: SamplingParams, tokens: list[int], generated: int) -> torch.Tensor:
    """The logits [V] the picker chooses from, float32, before the guide's mask and top-k/top-p/min_p."""
    logits = logits.float()
    if p.embedding_bias is not None:
        logits = logits + p.embedding_bias.to(torch.float32)
    if p.temperature not in (0, 1):  # 0 means greedy: nothing to scale
        logits = logits / p.temperature
    logits = penalised(logits, p, tokens)
    masked = banned(p, tokens)
    if 0 <= p.end_id and generated < p.min_tokens:
        masked.add(int(p.end_id))
    if masked:
        logits = logits.clone()  # .float() of float32 rows is the model's own tensor
        logits[torch.tensor(sorted(masked), dtype=torch.long)] = NEG_INF
    return logits


def filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p (renormalised after top-k), then min_p, as -inf in processed logits [V]."""
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if 0 < p.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        logits = logits.clone()
        logits[order[drop]] = NEG_INF
    if p.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), NEG_INF)
    return logits
