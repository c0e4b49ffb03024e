"""SmoothQuant in the W8A8_SQ_PER_CHANNEL layout (ModelOpt `int8_sq`; TensorRT-LLM
tensorrt_llm/quantization/quantize_by_modelopt.py).

A few input channels of real LLM activations are huge, so one per-tensor
int8 scale for the activation wastes its range on them. SmoothQuant moves
that range into the weight: per input channel `s = amax_x^α / amax_w^(1-α)`,
`x_s = x / s`, `W_s = W · diag(s)`; the product is unchanged. The layout
stores `prequant_scaling_factor = 1/s` (multiplied into the activation at run
time), per-channel int8 weights of `W_s`, and one static activation scale
`amax(x_s) / 127` from calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolchain.quant.int_quant import quantize_per_channel

MIN_SCALE = 1e-5  # TensorRT-LLM's converter clamps s at this (tensorrt_llm/models/llama/convert.py, smooth_gemm)


@dataclass
class SmoothQuantLinear:
    weight: torch.Tensor                     # int8 (out, in)
    weights_scaling_factor: torch.Tensor     # float32 (out,)
    activation_scaling_factor: torch.Tensor  # float32 (1,)
    prequant_scaling_factor: torch.Tensor    # float32 (in,); cast to the model dtype when written


def smoothing_factors(act_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """(in,) s for linears sharing one input (q/k/v, or fc/gate): the weight
    side uses the max over all of them so one vector serves the fused GEMM."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be within [0, 1], got {alpha}")
    w_amax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    a = act_amax.float().clamp(min=MIN_SCALE)
    w_amax = w_amax.clamp(min=MIN_SCALE)
    return (a.pow(alpha) / w_amax.pow(1.0 - alpha)).clamp(min=MIN_SCALE)


def quantize_sq(weights: list[torch.Tensor], act_amax: torch.Tensor, alpha: float | None) -> list[SmoothQuantLinear]:
    """Quantize linears that share one input; `alpha=None` skips smoothing
    (plain static W8A8, the baseline SmoothQuant is measured against).

    All outputs share the prequant vector and the activation scale, as the
    fused qkv and fc/gate GEMMs need (TensorRT-LLM tensorrt_llm/quantization/layers.py)."""
    if alpha is None:
        s = torch.ones_like(act_amax, dtype=torch.float32)
    else:
        s = smoothing_factors(act_amax, weights, alpha)
    act_scale = (act_amax.float() / s).max().reshape(1) / 127.0
    act_scale = torch.where(act_scale > 0, act_scale, torch.ones_like(act_scale))
    out = []
    for w in weights:
        q, ws = quantize_per_channel(w.float() * s[None, :], bits=8)
        out.append(SmoothQuantLinear(q, ws, act_scale.clone(), 1.0 / s))
    return out


def quantize_activation(x: torch.Tensor, prequant: torch.Tensor, act_scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor int8 activation, as the engine computes it: round(x·p / s_a) clamped to ±127."""
    return torch.clamp(torch.round(x.float() * prequant.float() / act_scale.float()), -127, 127).to(torch.int8)
