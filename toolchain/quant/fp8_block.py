"""FP8 block scales: e4m3 weights with one float32 scale per 128x128 tile, activations scaled per 1x128.

Weights: the scale grid is (ceil(out/128), ceil(in/128)) of tile amax / 448, the dequant multiplier. It is
what DeepSeek's `weight_scale_inv` and ModelOpt's `fp8_pb_wo` `weight_scale` hold, and what TensorRT-LLM's
FP8BlockScalesLinearMethod reads ("Actually they hold identical values of data_amax / 448",
tensorrt_llm/_torch/modules/linear.py). Edge tiles are partial: their amax covers only the rows and
columns that exist. ModelOpt's FP8QTensor pads with zeros, which gives the same amax.

Activations: TensorRT-LLM quantizes them at run time with `torch.ops.trtllm.fp8_quantize_1x128`, whose
kernel is `scale_1x128_kernel` in cpp/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/
fp8_blockscale_gemm_kernel.cuh @eef8cda79111ab6977c19ba68aa07c6e87bf7844. Per token and per 128 columns it
computes `scale = amax != 0 ? 448.f / amax : 1.f`, stores `1.f / scale` as the dequant scale, and casts
`x * scale` to e4m3. This is the Hopper recipe with FP32 scales. On SM100 the DeepGEMM path rounds the scales
to powers of two (UE8M0), and that is not emulated here.
"""

from __future__ import annotations

import torch

from toolchain.quant.fp8 import FP8_DTYPE, FP8_MAX

BLOCK = 128


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_grid_shape(out_features: int, in_features: int, block: int = BLOCK) -> tuple[int, int]:
    """(ceil(out/block), ceil(in/block)): FP8BlockScalesLinearMethod's `weight_scale` shape."""
    return _ceil_div(out_features, block), _ceil_div(in_features, block)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """The per-tile grid repeated to every element of an (out, in) weight."""
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[:shape[0], :shape[1]]


def block_amax(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 (ceil(out/block), ceil(in/block)) absolute maximum of each tile. The zero padding of the
    edge tiles cannot raise an amax."""
    out_f, in_f = w.shape
    rows, cols = scale_grid_shape(out_f, in_f, block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out_f, :in_f] = w.float().abs()
    return padded.reshape(rows, block, cols, block).amax(dim=(1, 3))


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight (out, in), float32 scale (ceil(out/128), ceil(in/128)) = tile amax / 448).

    An all-zero tile gets scale 1.0 and zero weights. ModelOpt would divide 0 / 0 there and store NaN."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block scales quantize a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    amax = block_amax(w, block)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    out_f, in_f = w.shape
    q = (w.float() / _expand(scale, (out_f, in_f), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = BLOCK) -> torch.Tensor:
    """(out, in) weight: e4m3 value * its tile's scale, in float32, then cast to `dtype`."""
    out_f, in_f = q.shape
    expected = scale_grid_shape(out_f, in_f, block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale grid {tuple(scale.shape)} does not fit a {tuple(q.shape)} weight in "
                         f"{block}x{block} tiles: expected {expected}")
    return (q.float() * _expand(scale.float(), (out_f, in_f), block)).to(dtype)


def quantize_fp8_per_1x128(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [..., k], float32 dequant scales [..., ceil(k/128)]) for activations, as `scale_1x128_kernel`
    computes them: per token and per group of 128 columns, the last group partial."""
    k = x.shape[-1]
    groups = _ceil_div(k, group)
    padded = torch.zeros(*x.shape[:-1], groups * group, dtype=torch.float32)
    padded[..., :k] = x.float()
    tiles = padded.reshape(*x.shape[:-1], groups, group)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax != 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (tiles * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*x.shape[:-1], groups * group)[..., :k], (1.0 / scale).squeeze(-1)


def dequantize_fp8_per_1x128(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """float32 [..., k]: each e4m3 value times its group's dequant scale."""
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]


def fake_quantize_fp8_per_1x128(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """float32 activation the FP8 block-scale GEMM effectively multiplies: the 1x128 round trip."""
    return dequantize_fp8_per_1x128(*quantize_fp8_per_1x128(x, group), group=group)
