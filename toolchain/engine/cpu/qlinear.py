"""Quantized linears: each checkpoint format run as stored, on torch's CPU kernels.

Each format's stored tensors are its row's `stored` in toolchain/quant/formats.py; its kernel is
the row's `cpu_kernel`:

| kernel (quant_algo) | stored (TensorRT-LLM tensorrt_llm/quantization/layers.py) | run |
|---|---|---|
| int8_wo / int4_wo (W8A16 / W4A16) | fp weight (the build quantizes it: `preprocess_weights`) | quantized here at load, per channel amax/127 or amax/7, as trtllm-build does; `_weight_int8pack_mm` (from 8 rows oneDNN's bf16 matmul on the same values, see `Int8WeightOnly`) / `_weight_int4pack_mm_for_cpu` |
| int4_group (awq, imported int4: ModelOpt) | int8 (out/2, in) packed int4, scales (out, in/g), prequant (in,), zero (out, in/g) if has_zero_point | x·prequant, then `_weight_int4pack_mm_for_cpu` |
| sq (W8A8_SQ_PER_CHANNEL) | int8 (out, in), per-channel scale, static activation scale, prequant | x·prequant quantized per tensor to int8, `torch._int_mm`, rescaled |
| fp8 (FP8) | e4m3 (out, in), per-tensor weight and activation scales | emulated: activation rounded through e4m3, weight dequantized, fp32 matmul |
| nvfp4 (NVFP4) | uint8 (out, in/2) packed e2m1, e4m3 (out, in/16), global weight and input scales | emulated: activation quantized per 16 as the GPU's FP4 quantize kernel does, weight dequantized at load, fp32 matmul |
| mxfp4 (W4A16_MXFP4; gpt-oss's experts) | uint8 (out, in/2) packed e2m1, uint8 E8M0 (out, in/32) | dequantized per call (value x 2^(scale - 127)), fp32 matmul: nothing cached in float |
| fp8_block (FP8_BLOCK_SCALES) | e4m3 (out, in), float32 per 128x128 tile | emulated: activation rounded per 1x128 as fp8_quantize_1x128 does, weight dequantized at load, fp32 matmul |

The packed integer kernels take bf16 activations (fp32 input is 40-100x
slower). Measured on a 2-core host when they were written, they beat the fp32
matmul from 1 row (decode) to 256 (prefill), where dequantizing the weight per
call was 2-10x slower than fp32; since the float path moved to oneDNN from four
rows (linear.py), the int8 kernel is slower than it from about 12 rows, and an
int8 linear of 1 MiB or more keeps an optional bfloat16 copy of its int8 values
for 8 rows and more (`Int8WeightOnly`). Nothing else is cached in float, so
memory holds the format as stored.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from toolchain.engine.cpu.linear import Linear, blocked, matmul
from toolchain.quant import formats
from toolchain.quant import fp8 as fp8q
from toolchain.quant.fp4 import dequantize_mxfp4, dequantize_nvfp4, fake_quantize_nvfp4_activation
from toolchain.quant.fp8_block import dequantize_fp8_block, fake_quantize_fp8_per_1x128
from toolchain.quant.int_quant import dequantize_per_group, pack_int4, quantize_per_channel, unpack_int4

INT4_KERNEL_GROUP = 32  # per-channel int4 runs the grouped kernel with one scale repeated per 32 columns


def _int4_kernel_pack(q_signed: torch.Tensor, scales: torch.Tensor, zero: torch.Tensor | None,
                      group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) int4 in [-8, 7] + (out, in/g) scales/zero -> the kernel's packed weight and
    [in/g, out, 2] scale-and-zero (bf16). The kernel computes (u - 8)·s + zero with u = q + 8
    (PyTorch aten/src/ATen/native/cpu/int4mm_kernel.cpp); the packed layout depends on the CPU, so it
    is built here, never stored."""
    u = (q_signed.to(torch.int32) + 8).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    z = zero if zero is not None else torch.zeros_like(scales)
    sz = torch.stack([scales.float().t(), z.float().t()], dim=-1).contiguous().to(torch.bfloat16)
    return packed, sz


@functools.cache
def _bf16_matmul() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


INT8_BLOCKED_FROM_ROWS = 8
"""From this many rows an int8 weight-only linear runs oneDNN's bfloat16 matmul on its blocked copy
(`Int8WeightOnly.kernel`); below, torch's int8 kernel."""


class Int8WeightOnly(Linear):
    """W8A16 per channel: int8 (out, in) and a scale per output channel, on bfloat16 activations.

    torch's `_weight_int8pack_mm` costs about the same per row at any row count (the benchmark model's linears, 2
    threads: 1 row 8.3 ms, 8 rows 13.7, 16 rows 22.1, 64 rows 62). From INT8_BLOCKED_FROM_ROWS rows the same int8
    values, widened to bfloat16 (exactly) and held in oneDNN's blocked layout, go through oneDNN's bfloat16 matmul
    and the scale follows (8 rows 13.7 ms, 16 rows 14.9, 64 rows 29.2). The copy takes 2 bytes a weight and is made
    like the float32 ones (linear.blocked: 1 MiB or more, within the load's `blocked_budget`); without it the int8
    kernel runs at every row count. Both accumulate in float32; the oneDNN path rounds the sums to bfloat16 before
    the scale, the int8 kernel after it, so the two differ by up to an ulp of bfloat16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        q, scale = quantize_per_channel(weight.float(), bits=8)
        super().__init__(q, bias)
        self.scale = scale
        self._scale_bf16 = scale.to(torch.bfloat16)
        # Only where oneDNN runs bfloat16 natively (AVX512-BF16 or AMX); elsewhere it would convert every call.
        self.blocked_bf16 = blocked(q.to(torch.bfloat16)) if _bf16_matmul() else None

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]

    def __call__(self, x, *, add_bias=True):
        return self.with_bias(self.kernel(x.to(torch.bfloat16)).float(), add_bias)

    def kernel_input(self, rows):
        return torch.randn(rows, self.in_features).to(torch.bfloat16)

    def kernel(self, x):
        if self.blocked_bf16 is not None and x.dim() == 2 and x.shape[0] >= INT8_BLOCKED_FROM_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.blocked_bf16, None, "none", [], "")
            return y.mul_(self._scale_bf16)
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self._scale_bf16)


class Int4Grouped(Linear):
    """Signed int4 per group: ModelOpt's AWQ format (with prequant, or with zero for imports).

    `weight` keeps the checkpoint's packed (out/2, in) int8 bytes; the kernel's
    own CPU-specific packing is derived from it at load."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, group: int, *, zero=None, prequant=None,
                 bias=None):
        super().__init__(packed, bias)
        q_signed = unpack_int4(packed)
        self.out_f, self.in_f = q_signed.shape
        self.group, self.scales = group, scales.float()
        self.zero = zero.float() if zero is not None else None
        self.prequant = prequant.float() if prequant is not None else None
        self._kernel, self._sz = _int4_kernel_pack(q_signed, self.scales, self.zero, group)

    @property
    def out_features(self):
        return self.out_f

    @property
    def in_features(self):
        return self.in_f

    def dequantized(self) -> torch.Tensor:
        return dequantize_per_group(unpack_int4(self.weight), self.scales, self.group, zero=self.zero)

    def __call__(self, x, *, add_bias=True):
        if self.prequant is None:
            x = x.to(torch.bfloat16)
        else:  # x * prequant rounded to bf16 as it is stored: (x * prequant).to(bf16) in one pass
            x = torch.mul(x, self.prequant, out=torch.empty(x.shape, dtype=torch.bfloat16))
        return self.with_bias(self.kernel(x).float(), add_bias)

    def kernel_input(self, rows):
        return torch.randn(rows, self._sz.shape[0] * self.group).to(torch.bfloat16)  # the packed width

    def kernel(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._kernel, self.group, self._sz)


class Int4WeightOnly(Int4Grouped):
    """W4A16 per channel (option a: the checkpoint holds fp weights and the build quantizes):
    quantized here to amax/7 per output channel, run by the grouped kernel with the channel's
    scale repeated per INT4_KERNEL_GROUP columns. The kernel takes groups of 32 to 256 columns only, so
    a width that is no multiple of 32 (a Qwen2-MoE shared expert of 96 split over tp 2) gets zero columns
    up to the next one, and its input the same zeros; the products are unchanged."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        q, scale = quantize_per_channel(weight.float(), bits=4)
        k = weight.shape[1]
        self._pad = -k % INT4_KERNEL_GROUP
        q = F.pad(q, (0, self._pad))
        super().__init__(pack_int4(q), scale[:, None].repeat(1, q.shape[1] // INT4_KERNEL_GROUP), INT4_KERNEL_GROUP,
                         bias=bias)
        self.in_f = k

    def dequantized(self) -> torch.Tensor:
        return super().dequantized()[:, :self.in_f]

    def __call__(self, x, *, add_bias=True):
        return super().__call__(F.pad(x, (0, self._pad)) if self._pad else x, add_bias=add_bias)


class SmoothQuantW8A8(Linear):
    def __init__(self, weight, weight_scale, act_scale, prequant, bias=None):
        super().__init__(weight, bias)
        self.weight_scale, self.act_scale, self.prequant = weight_scale.float(), act_scale.float(), prequant.float()
        self._out_scale = self.weight_scale * self.act_scale

    def quantize_input(self, x):
        return torch.clamp(torch.round(x * self.prequant / self.act_scale), -127, 127).to(torch.int8)

    def __call__(self, x, *, add_bias=True):
        y = torch._int_mm(self.quantize_input(x), self.weight.t()).float() * self._out_scale
        return self.with_bias(y, add_bias)


class Fp8PerTensor(Linear):
    """FP8 by emulation: torch has no CPU FP8 GEMM, so the e4m3 weight is widened
    once at load (exactly its stored values times the scale) and each call rounds
    the activation through e4m3 with the static scale, as the FP8 GEMM input would be."""

    def __init__(self, weight, weight_scale, act_scale, bias=None):
        super().__init__(weight, bias)
        self.weight_scale, self.act_scale = weight_scale.float(), act_scale.float()
        self._wide = fp8q.from_fp8(weight, self.weight_scale)

    def __call__(self, x, *, add_bias=True):
        y = matmul(fp8q.fake_fp8(x, self.act_scale), self._wide)
        return self.with_bias(y, add_bias)


class _Widened(Linear):
    """A format emulated over its weight widened to float32 once at load: `weight` keeps the stored tensor, whose
    shape need not be (out, in) (NVFP4 packs two values a byte), so the features are the wide weight's."""

    _wide: torch.Tensor

    @property
    def out_features(self):
        return self._wide.shape[0]

    @property
    def in_features(self):
        return self._wide.shape[1]

    def dequantized(self) -> torch.Tensor:
        return self._wide


class Nvfp4(_Widened):
    """NVFP4 by emulation: the e2m1 weight is dequantized once at load (E2M1 value x block scale x global scale,
    exactly what the GEMM multiplies), and every call quantizes the activation per 16 against the static input scale
    as the GPU does before its FP4 GEMM: FP4Linear's quantize_to_fp4_tensor (engine) and NVFP4LinearMethod's
    fp4_quantize (PyTorch backend) both run `cvt_warp_fp16_to_fp4` (cpp/tensorrt_llm/kernels/quantization.cuh
    @2a0ce833), then fp4_gemm scales the products by alpha = input scale x global weight scale (quant/fp4.py
    fake_quantize_nvfp4_activation says how). The GPU reads the activation in the model's half type; here, as
    everywhere in this engine, it is float32, so a value within a rounding of a midpoint may land on the other
    e2m1 code."""

    def __init__(self, packed, block_scale, global_scale, act_scale, bias=None):
        super().__init__(packed, bias)
        self.block_scale, self.global_scale, self.act_scale = block_scale, global_scale.float(), act_scale.float()
        self._wide = dequantize_nvfp4(packed, block_scale, self.global_scale)

    def __call__(self, x, *, add_bias=True):
        y = matmul(fake_quantize_nvfp4_activation(x, self.act_scale), self._wide)
        return self.with_bias(y, add_bias)


class Fp8BlockScales(_Widened):
    """FP8 block scales by emulation: the e4m3 weight is widened once at load, each value times its 128x128 tile's
    float32 scale, and every call rounds the activation through e4m3 per token and 128 columns with its own scale,
    as TensorRT-LLM's fp8_quantize_1x128 does (`scale_1x128_kernel`, quant/fp8_block.py), the Hopper recipe's FP32
    scales. On the GPU the block-scale GEMM takes bf16 activations only (FP8BlockScalesLinearMethod); the CPU
    engine computes in float32 whatever the checkpoint's dtype."""

    def __init__(self, weight, scale, bias=None):
        super().__init__(weight, bias)
        self.scale = scale.float()
        self._wide = dequantize_fp8_block(weight, self.scale)

    def __call__(self, x, *, add_bias=True):
        y = matmul(fake_quantize_fp8_per_1x128(x), self._wide)
        return self.with_bias(y, add_bias)


class Mxfp4(Linear):
    """MXFP4 (gpt-oss's experts) from its stored bytes: `weight` keeps the uint8 (out, in/2) packed e2m1 values, low
    nibble first, and `scales` the uint8 (out, in/32) E8M0 exponents; every call dequantizes them, value x
    2^(scale - 127) (quant/fp4.py dequantize_mxfp4, transformers' convert_moe_packed_tensors), and multiplies in
    float32, so memory holds the format as stored. On Hopper the PyTorch backend runs it as W4A16_MXFP4, the
    activations unquantized (bf16 there, float32 here, as everywhere in this engine); Blackwell's W4A8_MXFP4_MXFP8
    also quantizes the activations to MXFP8, which is not emulated."""

    def __init__(self, packed, scales, bias=None):
        super().__init__(packed, bias)
        self.scales = scales

    @property
    def out_features(self):
        return self.weight.shape[0]

    @property
    def in_features(self):
        return self.weight.shape[1] * 2

    def dequantized(self) -> torch.Tensor:
        return dequantize_mxfp4(self.weight.reshape(*self.scales.shape, -1), self.scales, torch.float32)

    def __call__(self, x, *, add_bias=True):
        return self.with_bias(matmul(x, self.dequantized()), add_bias)


# -- what each format stores, and building the right Linear --------------------------------

# formats.Tensor dtypes -> the dtype family the loader accepts.
LOADER_KIND = {"int8": "int8", "uint8": "uint8", "fp8": "fp8", "float32": "float", "float16": "float",
               "model": "float"}


def stored_tensors(prefix: str, out_f: int, in_f: int, bias: bool, fmt: str | None, *, group: int = 128,
                   zero: bool = False, prequant: bool = True) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) of one linear as the checkpoint stores it: the `stored` tensors of the
    rows whose kernel is `fmt` (quant/formats.py); kind is "float", "int8", "uint8" or "fp8" (the dtype family
    the loader accepts). Where rows share a kernel (int4_group: awq's prequant vector, an import's
    zero points), a tensor only some store is there when config.json says so (pre_quant_scale,
    has_zero_point)."""
    rows = [f for f in formats.ALL if f.cpu_kernel == fmt] if fmt is not None else [formats.NONE]
    if not rows:
        raise ValueError(f"unknown linear format {fmt}")
    tensors = {t.suffix: t for row in rows for t in row.stored}
    flags = {"prequant_scaling_factor": prequant, "zero": zero}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for t in tensors.values():
        if len(rows) > 1 and not all(t in row.stored for row in rows) and not flags[t.suffix]:
            continue
        out[f"{prefix}.{t.suffix}"] = (t.dims(out_f, in_f, group), LOADER_KIND[t.dtype])
    if bias:
        out[f"{prefix}.bias"] = ((out_f,), "float")
    return out


def build_linear(t: dict[str, torch.Tensor], prefix: str, bias: bool, fmt: str | None, *,
                 group: int = 128) -> Linear:
    b = t[f"{prefix}.bias"] if bias else None
    w = t[f"{prefix}.weight"]
    if fmt is None:
        return Linear(w, b)
    if fmt == "int8_wo":
        return Int8WeightOnly(w, b)
    if fmt == "int4_wo":
        return Int4WeightOnly(w, b)
    if fmt == "int4_group":
        zero = t.get(f"{prefix}.zero")
        return Int4Grouped(w, t[f"{prefix}.weights_scaling_factor"], group, zero=None if zero is None else zero.t(),
                           prequant=t.get(f"{prefix}.prequant_scaling_factor"), bias=b)
    if fmt == "sq":
        return SmoothQuantW8A8(w, t[f"{prefix}.weights_scaling_factor"], t[f"{prefix}.activation_scaling_factor"],
                               t[f"{prefix}.prequant_scaling_factor"], b)
    if fmt == "fp8":
        return Fp8PerTensor(w, t[f"{prefix}.weights_scaling_factor"], t[f"{prefix}.activation_scaling_factor"], b)
    if fmt == "nvfp4":
        return Nvfp4(w, t[f"{prefix}.weights_scaling_factor"], t[f"{prefix}.weights_scaling_factor_2"],
                     t[f"{prefix}.activation_scaling_factor"], b)
    if fmt == "fp8_block":
        return Fp8BlockScales(w, t[f"{prefix}.weights_scaling_factor"], b)
    if fmt == "mxfp4":
        return Mxfp4(w, t[f"{prefix}.weights_scaling_factor"], b)
    # A row's cpu_kernel (quant/formats.py) with no branch here: refuse rather than run it as another format.
    raise ValueError(f"{prefix}: no CPU kernel '{fmt}' (engine/cpu/qlinear.py KERNELS)")


KERNELS = ("int8_wo", "int4_wo", "int4_group", "sq", "fp8", "nvfp4", "fp8_block", "mxfp4")
"""The kernels build_linear builds, which every quantized row's cpu_kernel names (tests/test_quant_formats.py)."""


def make_linear(tensors: dict[str, torch.Tensor], prefix: str, bias: bool, fmt: str | None = None,
                *, group: int = 128) -> Linear:
    """Build the linear for `prefix` from a rank's tensors: fp (`fmt` None) or one of the quantized
    formats above (fmt from `ModelDims.linear_format`)."""
    if fmt is None:
        return Linear(tensors[f"{prefix}.weight"], tensors[f"{prefix}.bias"] if bias else None)
    return build_linear(tensors, prefix, bias, fmt, group=group)
