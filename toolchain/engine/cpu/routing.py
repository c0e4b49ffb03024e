"""Grouped top-k routing with sigmoid scores and a correction bias (DeepSeek-V3's noaux_tc router).

transformers 5.25 models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3TopkRouter: the router logits in float32,
scores = sigmoid(logits); the choice adds e_score_correction_bias to the scores, keeps the topk_group best of
n_group groups (a group scores the sum of its two best), and takes the top k experts among those groups; each
chosen expert's weight is its raw score (the bias only chooses), divided by the sum of the k (norm_topk_prob,
which the converter requires) and times routed_scaling_factor. TensorRT-LLM's DeepSeekV3MoeRoutingMethod computes
the same (_torch/modules/fused_moe/routing.py: `scores / score_sum * self.routed_scaling_factor`, or the fused
noaux_tc_op with the same arguments; notes i36-facts §3.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupedRouting:
    n_group: int
    topk_group: int
    routed_scaling_factor: float

    def route(self, logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) from router logits [N, E] (float32) and the correction bias [E]."""
        scores = logits.float().sigmoid()
        choice = scores + bias
        n, experts = choice.shape
        groups = choice.view(n, self.n_group, experts // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        chosen = groups.topk(self.topk_group, dim=-1)[1]
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.unsqueeze(-1).expand(n, self.n_group, experts // self.n_group).reshape(n, experts)
        ids = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids
