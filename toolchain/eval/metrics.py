"""Perplexity and agreement from two models' logits over the same windows.

Both models see exactly the same token windows; for each window position
t < n-1 the next token t+1 is the target. Definitions (so reports compare):
- perplexity = exp(mean negative log-likelihood of the targets), each model's own;
- greedy_token_agreement = share of positions where the two models' argmax
  (their greedy next token, teacher-forced on the same prefix) is the same;
- top1_accuracy = share of positions where a model's argmax is the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

Logits = Callable[[list[int]], torch.Tensor]  # token ids [n] -> float logits [n, vocab]


@dataclass
class Comparison:
    tokens: int = 0
    nll: float = 0.0
    reference_nll: float = 0.0
    agree: int = 0
    hits: int = 0
    reference_hits: int = 0
    max_abs_logit_diff: float = 0.0
    windows: int = 0
    _abs_diff_sum: float = field(default=0.0, repr=False)

    def add(self, ids: list[int], logits: torch.Tensor, reference: torch.Tensor) -> None:
        if logits.shape != reference.shape or logits.shape[0] != len(ids):
            raise ValueError(f"logits {tuple(logits.shape)} and reference {tuple(reference.shape)} "
                             f"do not both cover {len(ids)} tokens")
        if len(ids) < 2:
            return
        target = torch.tensor(ids[1:], dtype=torch.int64)
        got, ref = logits[:-1].float(), reference[:-1].float()
        self.nll += _nll(got, target)
        self.reference_nll += _nll(ref, target)
        pick, ref_pick = got.argmax(-1), ref.argmax(-1)
        self.agree += int((pick == ref_pick).sum())
        self.hits += int((pick == target).sum())
        self.reference_hits += int((ref_pick == target).sum())
        diff = (got - ref).abs()
        self.max_abs_logit_diff = max(self.max_abs_logit_diff, float(diff.max()))
        self._abs_diff_sum += float(diff.mean()) * len(target)
        self.tokens += len(target)
        self.windows += 1

    def result(self) -> dict:
        n = max(self.tokens, 1)
        ppl, ref_ppl = math.exp(self.nll / n), math.exp(self.reference_nll / n)
        return {
            "perplexity": round(ppl, 4),
            "reference_perplexity": round(ref_ppl, 4),
            "perplexity_ratio": round(ppl / ref_ppl, 5),
            "greedy_token_agreement": round(self.agree / n, 5),
            "top1_accuracy": round(self.hits / n, 5),
            "reference_top1_accuracy": round(self.reference_hits / n, 5),
            "max_abs_logit_diff": _sig(self.max_abs_logit_diff),
            "mean_abs_logit_diff": _sig(self._abs_diff_sum / n),
            "tokens_evaluated": self.tokens,
            "windows": self.windows,
        }


def _sig(x: float) -> float:
    return float(f"{x:.4g}")  # 4 significant digits: fp32 noise is ~1e-6, quantization error ~1e-1


def _nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))


def evaluate(converted: Logits, reference: Logits, windows: Iterable[list[int]]) -> dict:
    """Compare two logits functions over `windows` of token ids."""
    comparison = Comparison()
    with torch.no_grad():
        for ids in windows:
            comparison.add(ids, converted(ids), reference(ids))
    if comparison.tokens == 0:
        raise ValueError("no window had two or more tokens to evaluate")
    return comparison.result()
