"""Attention with learned sinks (gpt-oss): one extra logit per q head in every softmax denominator, with no
value attached, so a query may give part of its weight to "nothing".

transformers eager_attention_forward (models/gpt_oss/modeling_gpt_oss.py), the parity reference: the sink logit
`sinks[h]` is concatenated to the scaled, masked scores (not itself scaled), the softmax runs over both and the
sink's column is dropped. TensorRT-LLM passes the same per-head values to its attention op as attention_sinks
(float32, this rank's q heads: _torch/models/modeling_gpt_oss.py). SDPA has no such hook, so the scores are
materialised, as for Gemma 2's soft-cap.
"""

from __future__ import annotations

import torch


def attend_with_sinks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """query [B, heads, q, hd], keys/values [B, kv_heads, S, hd], mask [B, 1, q, S] (True: attend), sinks [heads]."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (query @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ values
