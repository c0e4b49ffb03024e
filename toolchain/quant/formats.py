"""The quantization formats: one row per method, every other module reads its facts from here.

A row says what TensorRT-LLM calls the format (QuantAlgo, tensorrt_llm/quantization/mode.py, as
ModelOpt exports it: tensorrt_llm/quantization/quantize_by_modelopt.py), which GPUs build it, whether
it needs calibration, which tensors one linear stores in the engine checkpoint (shapes, dtypes and
how tensor parallelism splits them) and which it holds once trtllm-build has loaded it, the CPU
kernel that runs it and its Hugging Face (ModelOpt) export. Byte sizes are derived from the tensor
lists, never written separately, as llama.cpp's gguf-py derives every size from GGML_QUANT_SIZES
(gguf-py/gguf/constants.py) and vLLM keeps one QuantizationConfig per method
(vllm/model_executor/layers/quantization/). The planner's memory (plan/memory.py), the checkpoint
writer (checkpoint/quantize.py), the HF export and import (checkpoint/hf_quant.py,
checkpoint/convert.py), the GPU refusals (quant/recipe.py, the quant.* plan checks) and the CPU
engine (engine/cpu/config.py, engine/cpu/qlinear.py) all look rows up here, so a new format is a
row plus the module holding its math.

Pure data and lookups: imports nothing but `toolchain.errors` (and no torch), so the planner can
read it without loading tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal

# The spec's `quantization.method` and `quantization.kv_cache` values: a new method is its name here and
# its row below (tests/test_quant_formats.py holds the two together).
Method = Literal["none", "int8_wo", "int4_wo", "awq", "smoothquant", "fp8"]
KvCacheKind = Literal["none", "int8", "fp8"]

# SM 100-119 (Blackwell): trtllm-build rejects int8/int4 weight formats and an INT8 KV cache there
# (TensorRT-LLM tensorrt_llm/builder.py, build).
BLACKWELL = range(100, 120)
# Bytes per element of each storage kind; "model" is the checkpoint's float dtype (given per call).
STORAGE_BYTES = {"int8": 1, "fp8": 1, "float32": 4, "float16": 2}


def sm_refusal(min_sm: int | None, integer: bool, sm: int) -> str | None:
    """The one SM rule of weight and KV formats alike: "too old" below the format's oldest SM, "blackwell" for
    an integer format on SM 100-119, else None."""
    if min_sm is not None and sm < min_sm:
        return "too old"
    if integer and sm in BLACKWELL:
        return "blackwell"
    return None


@dataclass(frozen=True)
class Tensor:
    """One tensor a quantized linear stores. `shape` is written in the linear's (out, in) and the
    group size g: "out", "in", "out/2", "in/g", "1". `layout` is how tensor parallelism splits it
    (the table in checkpoint/quantize.py): weight | out_vec | out_groups | in_vec | scalar."""

    suffix: str
    shape: tuple[str, ...]
    dtype: str
    layout: str

    def dims(self, out: int, inp: int, group: int) -> tuple[int, ...]:
        """The concrete shape for a linear of (out, inp) with groups of `group`."""
        return tuple(num // den for num, den in (_size(tok, out, inp, group) for tok in self.shape))

    def elements(self, out: int, inp: int, group: int) -> float:
        """Element count; (out x in) / divisors, so a packed or grouped count may be fractional
        exactly where the planner's estimate is (no rounding before the bytes are summed)."""
        sizes = [_size(tok, out, inp, group) for tok in self.shape]
        num, den = prod(s[0] for s in sizes), prod(s[1] for s in sizes)
        return num if den == 1 else num / den


def _size(token: str, out: int, inp: int, group: int) -> tuple[int, int]:
    """(numerator, divisor) of one shape token."""
    base, _, div = token.partition("/")
    value = {"out": out, "in": inp, "1": 1}[base]
    return value, {"": 1, "2": 2, "g": group}[div]


FP_WEIGHT = (Tensor("weight", ("out", "in"), "model", "weight"),)


@dataclass(frozen=True)
class Format:
    """One weight format (a spec `quantization.method`, or an imported int4 checkpoint)."""

    name: str
    """The spec's quantization.method ("awq"), or "imported_int4" for AutoAWQ/GPTQ imports."""
    quant_algo: str | None
    """config.json `quantization.quant_algo` (QuantAlgo)."""
    quantizer: str
    """What computes the tensors `stored` holds, the key the dispatchers read (checkpoint/quantize.py
    Quantizer.components, checkpoint/hf_quant.py _quantize_group), each raising on a key it lacks: "awq"
    (quant/awq.py), "smoothquant" (quant/smoothquant.py), "fp8" (quant/fp8.py); "imported" (quant/prequantized.py
    unpacks a stored checkpoint); "trtllm-build" (the fp weights are written as they are and trtllm-build
    quantizes them, the CPU engine at load); "none" (nothing is quantized)."""
    stats: tuple[str, ...]
    """The calibration statistics its quantizer reads (quant/calibration.py LayerStats.inputs): "amax" (per input
    channel max |x|), "absmean" (mean |x|) and "cov" (the input covariance, AWQ's clip search); empty: no
    calibration."""
    stored: tuple[Tensor, ...]
    """Per quantized linear, in the engine checkpoint, in the order convert writes them."""
    built: tuple[Tensor, ...]
    """Per quantized linear once trtllm-build has loaded it (the planner's engine memory)."""
    cpu_kernel: str | None = None
    """The CPU engine's linear for it (engine/cpu/qlinear.py build_linear); None: a plain fp linear."""
    min_sm: int | None = None
    """Oldest SM that builds it (FP8 GEMMs need Ada/Hopper: TensorRT-LLM docs/source/reference/precision.md)."""
    integer: bool = False
    """An int8/int4 weight format, which trtllm-build refuses on BLACKWELL."""
    per_group: bool = False
    """int4 per group: the engine pads dims to per_group_multiple (quant/recipe.py)."""
    weight_only: bool = False
    """The checkpoint keeps fp weights and trtllm-build quantizes them (preprocess_weights in
    tensorrt_llm/models/modeling_utils.py), so `stored` is the fp weight."""
    hf_name: str | None = None
    """Its ModelOpt Hugging Face export the PyTorch backend loads (`format` of export_hf_quantized);
    None when the LLM-API path cannot take it pre-quantized, and then `hf_why_not` says why."""
    hf_why_not: str | None = None
    """Why it has no HF export (checkpoint/hf_quant.py hf_quant_problem), after "quantization.method <name> "."""
    hf_weight: str | None = None
    """The dtype the HF export stores its weight in (int4 packed two per uint8 byte, or e4m3)."""
    math: str = "fp16"
    """The tensor-core precision its GEMMs multiply in, whose peak the performance model (plan/perf/) reads:
    fp16 (the model's half type) for float and weight-only formats, whose kernels dequantize to the
    activations' type; int8 for SmoothQuant's W8A8; fp8 for FP8."""

    @property
    def calibration(self) -> bool:
        """Computing it needs activation statistics (calibration data)."""
        return bool(self.stats)

    def refused_on(self, sm: int) -> str | None:
        """"too old" or "blackwell" when a GPU of SM `sm` cannot build this format, else None."""
        return sm_refusal(self.min_sm, self.integer, sm)


def tensor_bytes(tensors: tuple[Tensor, ...], out: int, inp: int, group: int, model_bytes: int) -> float:
    """Bytes of one linear's tensors (TensorRT-LLM docs/source/legacy/reference/memory.md)."""
    return sum(t.elements(out, inp, group) * (model_bytes if t.dtype == "model" else STORAGE_BYTES[t.dtype])
               for t in tensors)


_INT4_WEIGHT = Tensor("weight", ("out/2", "in"), "int8", "weight")  # two int4 rows per byte
_PREQUANT = Tensor("prequant_scaling_factor", ("in",), "model", "in_vec")
# Float32 scales as NVIDIA's exporter writes them; trtllm-build holds per-group scales in the model's
# half type (WeightOnlyGroupwiseQuantLinear, tensorrt_llm/quantization/layers.py) and per-channel ones
# as half too (WeightOnlyQuantLinear).
_INT4_GROUP_SCALES = Tensor("weights_scaling_factor", ("out", "in/g"), "float32", "out_groups")
_INT4_GROUP_SCALES_BUILT = Tensor("weights_scaling_factor", ("out", "in/g"), "float16", "out_groups")
# AutoAWQ/GPTQ zero points: split like the scales, stored transposed as the groupwise layer declares
# them, (in/g, out) in the model dtype (checkpoint/quantize.py's docstring).
_ZERO = Tensor("zero", ("in/g", "out"), "model", "out_groups")
_SCALAR = ("1",)
# Round-to-nearest weight-only has no pre-quantized HF layout in ModelOpt's exporter that the PyTorch backend
# reads as such (W8A16 exports fp weights; W4A16 per channel does not exist).
_WO_NO_HF = "has no pre-quantized Hugging Face format the PyTorch backend loads; use awq (int4 per group) or fp8"

NONE = Format("none", None, "none", (), stored=FP_WEIGHT, built=FP_WEIGHT)
INT8_WO = Format("int8_wo", "W8A16", "trtllm-build", (), stored=FP_WEIGHT, weight_only=True, integer=True,
                 built=(Tensor("weight", ("out", "in"), "int8", "weight"),
                        Tensor("weights_scaling_factor", ("out",), "float16", "out_vec")),
                 cpu_kernel="int8_wo", hf_why_not=_WO_NO_HF)
INT4_WO = Format("int4_wo", "W4A16", "trtllm-build", (), stored=FP_WEIGHT, weight_only=True, integer=True,
                 built=(_INT4_WEIGHT, Tensor("weights_scaling_factor", ("out",), "float16", "out_vec")),
                 cpu_kernel="int4_wo", hf_why_not=_WO_NO_HF)
AWQ = Format("awq", "W4A16_AWQ", "awq", ("absmean", "cov"), integer=True, per_group=True,
             stored=(_INT4_WEIGHT, _INT4_GROUP_SCALES, _PREQUANT),
             built=(_INT4_WEIGHT, _INT4_GROUP_SCALES_BUILT, _PREQUANT),
             cpu_kernel="int4_group", hf_name="int4_awq", hf_weight="uint8")
SMOOTHQUANT = Format("smoothquant", "W8A8_SQ_PER_CHANNEL", "smoothquant", ("amax",), integer=True,
                     stored=(Tensor("weight", ("out", "in"), "int8", "weight"),
                             Tensor("weights_scaling_factor", ("out",), "float32", "out_vec"),
                             Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar"), _PREQUANT),
                     built=(Tensor("weight", ("out", "in"), "int8", "weight"),
                            Tensor("weights_scaling_factor", ("out",), "float32", "out_vec"),
                            Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar"), _PREQUANT),
                     cpu_kernel="sq", math="int8",
                     # tensorrt_llm/_torch/modules/linear.py get_quant_method has no W8A8_SQ_PER_CHANNEL branch:
                     # the backend raises "unsupported quant mode" for it.
                     hf_why_not="(W8A8_SQ_PER_CHANNEL) does not load on the PyTorch backend; use fp8 or awq")
FP8 = Format("fp8", "FP8", "fp8", ("amax",), min_sm=89,
             stored=(Tensor("weight", ("out", "in"), "fp8", "weight"),
                     Tensor("weights_scaling_factor", _SCALAR, "float32", "scalar"),
                     Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar")),
             built=(Tensor("weight", ("out", "in"), "fp8", "weight"),
                    Tensor("weights_scaling_factor", _SCALAR, "float32", "scalar"),
                    Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar")),
             cpu_kernel="fp8", hf_name="fp8", hf_weight="fp8", math="fp8")
# An AutoAWQ (GEMM) or GPTQ int4 checkpoint imported losslessly (quant/prequantized.py): the same
# QuantAlgo and kernel as awq, with zero points instead of the prequant vector (has_zero_point).
IMPORTED_INT4 = Format("imported_int4", AWQ.quant_algo, "imported", (), integer=True, per_group=True,
                       stored=(_INT4_WEIGHT, _INT4_GROUP_SCALES, _ZERO),
                       built=(_INT4_WEIGHT, _INT4_GROUP_SCALES_BUILT, _ZERO),
                       cpu_kernel="int4_group",
                       hf_why_not="is an AutoAWQ/GPTQ import, which the LLM-API path loads from its own files")

METHODS: dict[str, Format] = {f.name: f for f in (NONE, INT8_WO, INT4_WO, AWQ, SMOOTHQUANT, FP8)}
"""The spec's quantization.method values, in the spec's order."""
ALL: tuple[Format, ...] = (*METHODS.values(), IMPORTED_INT4)
BY_ALGO: dict[str | None, Format] = {f.quant_algo: f for f in METHODS.values()}
"""config.json quant_algo -> the method that writes it (an import reads as awq's row plus zero points)."""
HF_EXPORTS: dict[str, Format] = {f.name: f for f in METHODS.values() if f.hf_name}
"""Methods with a ModelOpt Hugging Face export (the LLM-API path's pre-quantized checkpoint)."""


@dataclass(frozen=True)
class KvFormat:
    """One KV-cache format: x / scale stored as int8 or e4m3, one scale per layer
    (TensorRT-LLM tensorrt_llm/quantization/quantize_by_modelopt.py)."""

    name: str
    """The spec's quantization.kv_cache."""
    quant_algo: str | None
    """config.json `quantization.kv_cache_quant_algo`."""
    storage: str | None
    """What one cached element is stored as; None: the model's own dtype."""
    min_sm: int | None = None
    integer: bool = False

    @property
    def calibration(self) -> bool:
        return self.quant_algo is not None

    def refused_on(self, sm: int) -> str | None:
        return sm_refusal(self.min_sm, self.integer, sm)


KV_CACHE: dict[str, KvFormat] = {k.name: k for k in (
    KvFormat("none", None, None),
    KvFormat("int8", "INT8", "int8", integer=True),
    KvFormat("fp8", "FP8", "fp8", min_sm=FP8.min_sm),
)}
KV_BY_ALGO: dict[str | None, KvFormat] = {k.quant_algo: k for k in KV_CACHE.values()}


def active(method: str, kv_cache: str) -> bool:
    """Whether anything is quantized, the weights or the KV cache: the row-level rule behind the one
    answer every stage reads, Quantization.active (quant/view.py)."""
    return method != "none" or kv_cache != "none"


def weight_format(method: str, *, imported: bool = False) -> Format:
    """The row of a spec method, or of an imported int4 checkpoint; KeyError for an unknown method
    (the spec and check_recipe refuse those first, naming the field)."""
    return IMPORTED_INT4 if imported else METHODS[method]
