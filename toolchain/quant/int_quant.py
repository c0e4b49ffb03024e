"""Symmetric round-to-nearest integer quantization and the ModelOpt int4 packing.

All weights are (out, in) as in PyTorch and the checkpoint. Scales follow
ModelOpt's convention `scale = amax / maxbound` (7 for int4, 127 for int8,
TensorRT-LLM tensorrt_llm/quantization/quantize_by_modelopt.py) and
`q = clamp(round(w / scale), -2^(b-1), 2^(b-1) - 1)`;
`torch.round` rounds half to even, as ModelOpt's fake quantizer does.
"""

from __future__ import annotations

import torch

MAXBOUND = {4: 7, 8: 127}


def _bounds(bits: int) -> tuple[int, int]:
    if bits not in MAXBOUND:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def scale_from_amax(amax: torch.Tensor, bits: int) -> torch.Tensor:
    """amax / maxbound; an all-zero row or group gets scale 1 so q = 0 and
    dequantization stays finite (a zero scale would make w / scale NaN)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / MAXBOUND[bits], torch.ones_like(amax))


def quantize(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 tensor of q = clamp(round(w / scale)); `scale` broadcasts against w."""
    lo, hi = _bounds(bits)
    return torch.clamp(torch.round(w.float() / scale), lo, hi).to(torch.int8)


def quantize_per_channel(w: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: (q int8 (out, in), scale float32 (out,))."""
    scale = scale_from_amax(w.abs().amax(dim=1), bits)
    return quantize(w, scale[:, None], bits), scale


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"in_features {inp} is not a multiple of group_size {group_size}")
    return w.reshape(out, inp // group_size, group_size)


def group_amax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in/g) absolute maximum of each group of `group_size` input channels."""
    return _groups(w.float(), group_size).abs().amax(dim=-1)


def quantize_per_group(w: torch.Tensor, group_size: int, bits: int = 4,
                       amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (output channel, group of input channels): (q int8 (out, in), scales float32 (out, in/g)).

    `amax` overrides the groups' own maxima (AWQ's clipping search shrinks them;
    values beyond the clipped range saturate)."""
    if amax is None:
        amax = group_amax(w, group_size)
    scales = scale_from_amax(amax, bits)
    q = quantize(_groups(w, group_size), scales[..., None], bits)
    return q.reshape(w.shape), scales


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def dequantize_per_group(q: torch.Tensor, scales: torch.Tensor, group_size: int,
                         zero: torch.Tensor | None = None) -> torch.Tensor:
    """w = q * s (+ zero), per group; `zero` (out, in/g) is the additive zero
    in TensorRT-LLM's kernel convention (tensorrt_llm/quantization/functional.py)."""
    w = _groups(q.float(), group_size) * scales.float()[..., None]
    if zero is not None:
        w = w + zero.float()[..., None]
    return w.reshape(q.shape)


def fake_quant_per_group(w: torch.Tensor, group_size: int, bits: int = 4,
                         amax: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize (float32), for searches and references."""
    q, s = quantize_per_group(w, group_size, bits, amax)
    return dequantize_per_group(q, s, group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """ModelOpt `pack_int4_in_uint8` layout, as int8: (out, in) int4 values in
    [-8, 7] -> (out/2, in), byte [j, k] holding row 2j in the low nibble and row
    2j+1 in the high nibble, each as 4-bit two's complement (TensorRT-Model-Optimizer
    modelopt/torch/export/quant_utils.py)."""
    if q.dim() != 2 or q.shape[0] % 2:
        raise ValueError(f"int4 packing needs a 2-D tensor with an even number of rows, got {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    nib = q.to(torch.int16) & 0xF
    byte = nib[0::2] | (nib[1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (out/2, in) int8 -> (out, in) int8 in [-8, 7]."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    out = torch.empty((packed.shape[0] * 2, *packed.shape[1:]), dtype=torch.int16)
    out[0::2], out[1::2] = lo, hi
    return out.to(torch.int8)
