"""gpt-oss's expert activation: SwiGLU with both halves clamped and a +1 on the linear half.

transformers GptOssExperts._apply_gate (models/gpt_oss/modeling_gpt_oss.py), the parity reference:
`gate = gate.clamp(max=limit)`, `up = up.clamp(-limit, limit)`, `(up + 1) * gate * sigmoid(gate * alpha)`;
TensorRT-LLM's reference formula in _torch/models/modeling_gpt_oss.py is the same with the clamp in its kernels
(swiglu_limit). The gate is clamped from above only.
"""

from __future__ import annotations

from typing import Callable

import torch


def clamped_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """act(up, gate) for an fc whose output is [up; gate] (engine/cpu/moe.py Experts)."""

    def act(up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act
