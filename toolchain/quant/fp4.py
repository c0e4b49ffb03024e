"""4-bit E2M1 values: NVFP4 (E4M3 scale per 16, FP32 global scale) and MXFP4 (E8M0 scale per 32).

E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4 and 6. A nibble is sign * 8 + magnitude index. Two nibbles share a
byte, with the even element in the low nibble (ModelOpt 0.47 nvfp4_tensor.py
`(q_weight[..., 1::2] << 4) | q_weight[..., 0::2]`, and transformers integrations/mxfp4.py
`sub[:, 0::2] = lut[idx_lo]`).

NVFP4 weights follow ModelOpt 0.47's NVFP4QTensor (modelopt/torch/quantization/qtensor/nvfp4_tensor.py,
`get_weights_scaling_factor_2`, `get_weights_scaling_factor`, `quantize`, `dequantize`) operation for
operation, so the packed bytes and block scales are the ones its export writes. NVFP4 activations follow
the GPU kernel, TensorRT-LLM cpp/tensorrt_llm/kernels/quantization.cuh `cvt_warp_fp16_to_fp4`
@2a0ce833a998456f870104c1923815b03c5f87c9. MXFP4 dequantization follows transformers
src/transformers/integrations/mxfp4.py `convert_moe_packed_tensors` @0189b1d09a03a87ec4f59831acb93cc1832d14e7
(value = lut[nibble] * 2^(scale - 127)), and MXFP4 quantization ModelOpt 0.47's MXFP4QTensor
(qtensor/mxfp4_tensor.py), which we only use to make test checkpoints.
"""

from __future__ import annotations

import torch

from toolchain.quant.fp8 import FP8_DTYPE, FP8_MAX

E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127
# ModelOpt's `_cast_per_block_scale_to_fp8` clamps block scales to [2**-9, 448] before the e4m3 cast:
# 2**-9 is e4m3fn's smallest subnormal, so no nonzero block scale underflows to 0.
NVFP4_MIN_BLOCK_SCALE = 2.0 ** -9

# Value of each nibble, sign bit first (ModelOpt's e2m1_values, transformers' FP4_VALUES).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
# Midpoints between neighbouring magnitudes.
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
# The midpoints whose upper neighbour has the even code (1.0, 2.0, 4.0): a tie there rounds up.
_ROUND_UP_TIES = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 nibble codes of `x`: round to nearest, ties to the even code, beyond 6 saturating to 6.

    As ModelOpt's `NVFP4QTensor._cast_fp4` (searchsorted over the midpoints, then +1 on a tie whose upper
    neighbour is even) and the GPU's `cvt.rn.satfinite.e2m1x2.f32`. A negative value rounding to zero keeps
    its sign bit (code 8), as `_cast_fp4` gives it."""
    x = x.float()
    sign = (x < 0).to(torch.uint8)
    mag = x.abs()
    code = torch.searchsorted(_E2M1_BOUNDS, mag, out_int32=True).to(torch.uint8)
    code += torch.isin(mag, _ROUND_UP_TIES).to(torch.uint8)
    return (sign << 3) + code


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each nibble code."""
    return E2M1_VALUES[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] from codes [..., n]: element 2k in the low nibble, 2k+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two nibbles a byte, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] from packed bytes [..., n] (the inverse of `pack_nibbles`)."""
    packed = packed.to(torch.uint8)
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


# --- NVFP4 ---------------------------------------------------------------------------------------


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """float32 0-dim amax / (6 * 448): the weight's weight_scale_2, or a calibrated input_scale (ModelOpt
    `get_weights_scaling_factor_2`, `get_activation_scaling_factor` with maxbound 6).

    An all-zero tensor gets 1.0: ModelOpt would divide its block amaxes 0 / 0 (NaN scales)."""
    a = torch.as_tensor(amax, dtype=torch.float32).abs().max()
    return torch.where(a > 0, a / (E2M1_MAX * FP8_MAX), torch.ones_like(a))


def nvfp4_block_scales(w: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., in/16]: fp8(block amax / (6 * global)), an all-zero block 1.0, clamped to
    [2**-9, 448] before the cast (ModelOpt `get_weights_scaling_factor`, `_cast_per_block_scale_to_fp8`)."""
    block_amax = _blocks(w.float(), NVFP4_BLOCK).abs().amax(dim=-1)
    scale = block_amax / (E2M1_MAX * global_scale.float())
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=NVFP4_MIN_BLOCK_SCALE, max=FP8_MAX).to(FP8_DTYPE)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | float | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., in/2], block scales float8_e4m3fn [..., in/16], global scale float32 0-dim).

    `global_scale` defaults to `nvfp4_global_scale(w.abs().max())`; pass one to share it across tensors
    a kernel fuses (q/k/v, gate/up: TensorRT-LLM's loaders assert they are equal). Each value is divided by
    its block's e4m3-ROUNDED scale times the global scale, then rounded to E2M1 (ModelOpt `quantize`)."""
    gs = nvfp4_global_scale(w.abs().max()) if global_scale is None else \
        torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
    block_scale = nvfp4_block_scales(w, gs)
    scaled = _blocks(w.float(), NVFP4_BLOCK) / (block_scale.float() * gs).unsqueeze(-1)
    return pack_nibbles(e2m1_codes(scaled.reshape(w.shape))), block_scale, gs


def quantize_nvfp4_fused(parts: list[torch.Tensor], input_amax: torch.Tensor | float,
                         ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """The parts of one fused linear (q/k/v, gate/up) as one NVFP4 GEMM reads them: ([(packed, block scales)] per
    part, the shared global weight scale, the input scale), both scales float32 0-dim. One global over the parts'
    largest amax and one input scale, each part's block scales computed against that global: ModelOpt unifies the
    parts' amaxes by max before exporting (quant_utils.py preprocess_linear_fusion), the PyTorch backend asserts
    they are equal (NVFP4LinearMethod.load_weight_scales), and FP4Linear's fused GEMM has one alpha."""
    shared = nvfp4_global_scale(torch.stack([w.abs().max() for w in parts]).max())
    quantized = [quantize_nvfp4(w, shared)[:2] for w in parts]
    return quantized, shared, nvfp4_global_scale(input_amax)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor | float,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., in] values: E2M1 value * (block scale * global scale), in float32, then cast to `dtype`
    (ModelOpt `NVFP4QTensor.dequantize`)."""
    values = _blocks(e2m1_values(unpack_nibbles(packed)), NVFP4_BLOCK)
    scale = block_scale.float() * torch.as_tensor(global_scale, dtype=torch.float32)
    return (values * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantize_nvfp4_activation(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """float32 activation the NVFP4 GEMM effectively multiplies: x quantized per 16 along the last dim.

    `input_scale` is the checkpoint's calibrated amax / (6 * 448). Both backends hand the kernel its
    reciprocal: the PyTorch NVFP4LinearMethod loads `input_scale = 1.0 / input_scale` ("modelopt ckpt stores
    amax/(448*6), convert to (448*6)/amax") and calls `fp4_quantize(input, module.input_scale, 16, False)`;
    the engine's FP4Linear passes `div(1, activation_global_scaling_factor)`. With that SFScaleVal,
    `cvt_warp_fp16_to_fp4` (quantization.cuh @2a0ce833) computes per 16 values:

        SFValue     = SFScaleVal * (vecMax * rcp(6))          -> e4m3 (saturating), SF
        outputScale = vecMax != 0 ? rcp(SF * rcp(SFScaleVal)) : 0
        q           = cvt.rn.satfinite.e2m1(x * outputScale)

    and the GEMM scales q * SF by alpha = input_scale * weight_scale_2 (the loader's alpha is taken before
    the reciprocal), so the activation it sees is q * SF * input_scale. The kernel's `rcp.approx.ftz`
    reciprocals are exact float32 divisions here; they differ in at most the last bit. A block whose SF
    underflows to 0 contributes 0, as it does on the GPU (q * 0). `x` is read at its own dtype: the GPU
    reads bf16/fp16, so round x to the model's dtype first."""
    input_scale = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
    sf_scale_val = 1.0 / input_scale
    blocks = _blocks(x.float(), NVFP4_BLOCK)
    vec_max = blocks.abs().amax(dim=-1, keepdim=True)
    sf_value = sf_scale_val * (vec_max * (1.0 / E2M1_MAX))
    sf = sf_value.clamp(max=FP8_MAX).to(FP8_DTYPE).float()
    usable = (vec_max != 0) & (sf != 0)
    output_scale = torch.where(usable, 1.0 / (sf * (1.0 / sf_scale_val)), torch.zeros_like(sf))
    q = e2m1_values(e2m1_codes(blocks * output_scale))
    return torch.where(usable, q * sf * input_scale, torch.zeros_like(q)).reshape(x.shape)


# --- MXFP4 ---------------------------------------------------------------------------------------


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     ) -> torch.Tensor:
    """[..., G * 32] values from gpt-oss's blocks uint8 [..., G, 16] and E8M0 scales uint8 [..., G].

    value = lut[nibble] * 2^(scale - 127), low nibble first, computed in float32 and cast to `dtype`
    (transformers `convert_moe_packed_tensors` multiplies in float32 via ldexp into a `dtype` buffer;
    ModelOpt's `MXFP4QTensor.dequantize` the same). The rows keep the checkpoint's [out, in] orientation:
    transformers then transposes to GptOssExperts' [E, in, out]."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree: "
                         "scales must be blocks' shape without its last dimension")
    values = e2m1_values(unpack_nibbles(blocks))
    factor = torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return (values * factor).flatten(-2).to(dtype)


def _mxfp4_codes(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt MXFP4QTensor's `cast_fp4`, which rounds unlike `e2m1_codes`: the magnitude index counts
    the midpoints strictly below |x| (a tie rounds down), and the sign bit is `(2 - sign(x)) // 2`, so a
    zero is stored as -0 (code 8)."""
    sign = (~(x > 0)).to(torch.uint8)
    mag = (x.abs().unsqueeze(-1) > _E2M1_BOUNDS).sum(dim=-1).to(torch.uint8)
    return (sign << 3) + mag


def quantize_mxfp4(w: torch.Tensor, block: int = MXFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., in/32, 16], E8M0 scales uint8 [..., in/32]) as ModelOpt's `MXFP4QTensor.quantize`:
    scale = ceil(max(log2(block amax / 6), -127)), values divided by 2^scale and rounded by `_mxfp4_codes`.
    For making MXFP4 test checkpoints in gpt-oss's layout."""
    x = _blocks(w.float(), block)
    descale = x.abs().amax(dim=-1, keepdim=True) / E2M1_MAX
    exponent = torch.ceil(torch.maximum(torch.log2(descale), torch.tensor(-float(E8M0_BIAS))))
    codes = _mxfp4_codes(x / torch.exp2(exponent))
    return pack_nibbles(codes), (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
