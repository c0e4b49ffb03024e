"""Per-tensor FP8 (e4m3) weights and activation scales (TensorRT-LLM FP8Linear,
tensorrt_llm/quantization/layers.py).

`scale = amax / 448`; the stored weight is `W / scale` cast to float8_e4m3fn
after clamping to ±448 (e4m3fn has no infinity: an unclamped overflow would
become NaN, not saturate, in some casts).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def fp8_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """(1,) float32 scale amax / 448 (1.0 for an all-zero tensor)."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(-1).max().reshape(1)
    return torch.where(a > 0, a / FP8_MAX, torch.ones_like(a))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-trip through e4m3 (the emulation of an FP8 GEMM input)."""
    return from_fp8(to_fp8(x, scale), scale)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, (1,) float32 scale) for one tensor."""
    scale = fp8_scale(w.abs().max())
    return to_fp8(w, scale), scale


def quantize_fp8_shared(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One scale for tensors the engine fuses (q, k, v; fc and gate): the max of
    their amaxes, every tensor quantized with it (the fused FP8Linear has one weight scale)."""
    scale = fp8_scale(torch.stack([w.abs().max().float() for w in weights]).max())
    return [to_fp8(w, scale) for w in weights], scale
