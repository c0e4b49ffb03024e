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

Pure data and lookups: imports nothing but the leaves `toolchain.errors` and `toolchain.targets` (the path
names), and no torch, so the planner can read it without loading tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Literal

from toolchain.errors import ToolchainError
from toolchain.targets import ENGINE, LLMAPI

# The spec's `quantization.method` and `quantization.kv_cache` values: a new method is its name here and
# its row below (tests/test_quant_formats.py holds the two together).
Method = Literal["none", "int8_wo", "int4_wo", "awq", "smoothquant", "fp8", "nvfp4", "fp8_block"]
KvCacheKind = Literal["none", "int8", "fp8"]

# SM 100-119 (Blackwell): trtllm-build rejects int8/int4 weight formats and an INT8 KV cache there
# (TensorRT-LLM tensorrt_llm/builder.py, build).
BLACKWELL = range(100, 120)
# Bytes per element of each storage kind; "model" is the checkpoint's float dtype (given per call). fp4 is e2m1, two
# to a byte (trtllm-build's trt.fp4 weight; the checkpoint stores the same bytes as uint8 pairs).
STORAGE_BYTES = {"int8": 1, "uint8": 1, "fp8": 1, "fp4": 0.5, "float32": 4, "float16": 2}
# The open end of an "SM n and newer" range (the spec's gpu.sm stops at 199).
NEWEST_SM = 1000
# The kinds of a device refusal. The two older rules are worded where they are read (the quant.fp8-needs-sm89 and
# quant.blackwell-int-formats checks, quant/recipe.py for convert), as they always were; a rule of kind WORDED
# carries its own reason and fix (`Devices.why`, `Devices.fix`), which the quant.device check and convert print.
TOO_OLD, ON_BLACKWELL, WORDED = "too old", "blackwell", "worded"


@dataclass(frozen=True)
class Devices:
    """The GPUs that build and run a format: the SM ranges (major*10+minor) it is supported on, and what a GPU
    outside them is told."""

    sms: tuple[range, ...]
    refusal: str | None = None
    """TOO_OLD, ON_BLACKWELL or WORDED (above); None where every GPU runs it."""
    why: str = ""
    """For WORDED: why the GPU cannot, after the format's name ("needs ...")."""
    fix: str = ""
    """For WORDED: what to use instead."""

    def refused_on(self, sm: int) -> str | None:
        """The refusal's kind when SM `sm` is outside the supported ranges, else None."""
        return None if any(sm in r for r in self.sms) else self.refusal

    @property
    def oldest(self) -> int:
        """The oldest SM that runs it."""
        return min(r.start for r in self.sms)

    def worded(self, what: str, gpu: str | None, sm: int) -> str | None:
        """The one-line refusal of a WORDED rule on SM `sm` ("<what> needs ...; the <gpu> is SM <sm>: use ..."),
        which plan and convert print alike; None where the rule lets it run or is worded elsewhere."""
        if self.refused_on(sm) != WORDED:
            return None
        return f"{what} {self.why}; the {gpu or 'GPU'} is SM {sm}: {self.fix}"


def _only(*sms: int) -> tuple[range, ...]:
    return tuple(range(sm, sm + 1) for sm in sms)


ANY_GPU = Devices((range(0, NEWEST_SM),))
# FP8 GEMMs need Ada/Hopper or newer (TensorRT-LLM docs/source/reference/precision.md).
FP8_GPUS = Devices((range(89, NEWEST_SM),), TOO_OLD)
# An int8/int4 weight format or INT8 KV cache, which trtllm-build refuses on BLACKWELL.
INTEGER_GPUS = Devices((range(0, BLACKWELL.start), range(BLACKWELL.stop, NEWEST_SM)), ON_BLACKWELL)
# TensorRT-LLM docs/source/features/quantization.md @09d4c79b, "Hardware Support Matrix": NVFP4 on Blackwell SM 120
# and SM 100/103 only (Hopper, Ada and Ampere have no FP4 tensor cores); FP8 block scaling on SM 100/103 (the
# MXFP8 recipe) and Hopper, not on Ada or SM 120 (notes/i35-facts.md section 2.4).
NVFP4_GPUS = Devices(_only(100, 103, 120), WORDED,
                     why="needs FP4 tensor cores, which only Blackwell (SM 100, 103 and 120) has: Hopper and older "
                         "GPUs have none",
                     fix="use quantization.method fp8 (SM 89 and newer) or awq")
FP8_BLOCK_GPUS = Devices(_only(90, 100, 103), WORDED,
                         why="runs its block-scaled FP8 GEMMs on Hopper (SM 90) and Blackwell SM 100/103 only, "
                             "not on Ada (SM 89) or SM 120",
                         fix="use quantization.method fp8 (per-tensor scales, SM 89 and newer) or awq")

# Quantizers and CPU kernels that rows name before their modules exist: issue 35 writes the rows first, so the
# planner, the checks and the spec read them now, while convert and the HF export (checkpoint/quantize.py COMPUTED,
# checkpoint/hf_quant.py) and the CPU engine (engine/cpu/config.py) refuse them as not implemented yet and tune
# proposes none of them. Wiring one removes its name here; tests/test_quant_formats.py holds each list to the
# dispatchers, so a name stays here exactly as long as nothing computes or runs it.
PENDING_QUANTIZERS = frozenset({"fp8_block"})
PENDING_CPU_KERNELS: frozenset[str] = frozenset()
# Rows whose Hugging Face export and import (checkpoint/hf_quant.py HF_COMPUTED, stored_linear) are still to come:
# the HF export refuses them as not implemented yet (Format.check_implemented on the LLM-API path), HF_IMPORTS leaves
# them out and tune proposes them on the engine path only. The HF export computes its own tensors, so this list is
# independent of PENDING_QUANTIZERS (fp8_block is exported, and computed on no engine path).
PENDING_HF_EXPORTS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Tensor:
    """One tensor a quantized linear stores. `shape` is written in the linear's (out, in) and the
    group size g: "out", "in", "out/2", "in/g", "in/16" (a fixed block), "1"; "ceil(out/128)" counts partial
    blocks whole (FP8 block scales), "pad128(out)" rounds up to a multiple (NVFP4's interleaved scales,
    fp4_utils.pad_up). `layout` is how tensor parallelism splits it (the table in checkpoint/quantize.py):
    weight | out_vec | out_groups | in_vec | scalar | tiles (a grid with one entry per square tile of the weight,
    Format.tile: FP8 block scales' (ceil(out/128), ceil(in/128)); each rank takes the whole tiles its rows, or a
    row-parallel linear's columns, cover)."""

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


_TOKEN = re.compile(r"(?:(?P<round>ceil|pad(?P<pad>\d+))\()?(?P<base>out|in|1)(?:/(?P<div>g|\d+))?\)?")


def _size(token: str, out: int, inp: int, group: int) -> tuple[int, int]:
    """(numerator, divisor) of one shape token; a rounded one (ceil, padN) is whole, divisor 1."""
    m = _TOKEN.fullmatch(token)
    if m is None:
        raise ValueError(f"shape token {token!r}")
    value = {"out": out, "in": inp, "1": 1}[m["base"]]
    div = group if m["div"] == "g" else int(m["div"] or 1)
    if m["round"] is None:
        return value, div
    whole = -(-value // div)  # ceil: a partial block has its own scale
    if m["pad"]:
        step = int(m["pad"])
        whole = -(-whole // step) * step
    return whole, 1


FP_WEIGHT = (Tensor("weight", ("out", "in"), "model", "weight"),)
# The layouts with a row (or a row of tiles) per output channel: a fused q/k/v module stacks its parts' by rows.
ROW_LAYOUTS = ("weight", "out_vec", "out_groups", "tiles")


class _OnDevices:
    """What a weight and a KV-cache format answer alike from their `devices` rule."""

    devices: Devices

    @property
    def integer(self) -> bool:
        """An int8/int4 format, which trtllm-build refuses on BLACKWELL."""
        return self.devices.refusal == ON_BLACKWELL

    @property
    def min_sm(self) -> int | None:
        """The oldest SM that builds it, where that is its rule (FP8: "too old" below it), else None."""
        return self.devices.oldest if self.devices.refusal == TOO_OLD else None

    def refused_on(self, sm: int) -> str | None:
        """The refusal's kind (TOO_OLD, ON_BLACKWELL, WORDED) when a GPU of SM `sm` cannot build this format,
        else None."""
        return self.devices.refused_on(sm)


@dataclass(frozen=True)
class Format(_OnDevices):
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
    quantizes them, the CPU engine at load); "none" (nothing is quantized); "stored_rows" (the family's rows carry
    the stored tensors as they are: gpt-oss's MXFP4 experts, checkpoint/convert.py stored_rows_quantization); "nvfp4" (quant/fp4.py); "fp8_block"
    (quant/fp8_block.py), while in PENDING_QUANTIZERS, is refused as not implemented yet."""
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
    cpu_widened: bool = False
    """The CPU kernel widens the stored weight to float32 once at load and keeps both (qlinear.py Fp8PerTensor,
    Nvfp4, Fp8BlockScales): each linear holds out x in x 4 bytes beyond its stored tensors (plan/memory.py)."""
    devices: Devices = ANY_GPU
    """The GPUs that build and run it (FP8_GPUS, INTEGER_GPUS, ...), read by convert and the quant.* checks."""
    engine_why_not: str | None = None
    """Why the engine path (trtllm-build) cannot build it, after "quantization.method <name> ", naming the target to
    use; None: it builds there. The LLM-API side's counterpart is `hf_why_not`."""
    group_size: int | None = None
    """A block size the format fixes (NVFP4's 16), written as config.json's group_size; None: per_group formats
    take the spec's, others write none."""
    tile: int | None = None
    """The side of the square weight tiles that share one scale (FP8 block scales' 128; its `tiles` grid), so every
    rank's rows of each fused part and every row-parallel rank's input width must be whole tiles (quant/recipe.py
    check_tiles); None: no tiles."""
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
    activations' type; int8 for SmoothQuant's W8A8; fp8 for FP8 and FP8 block scales (e4m3 activations scaled
    per 1x128 at run time); fp4 for NVFP4 (e2m1 activations and weights)."""

    blackwell_algo: str | None = None
    """The QuantAlgo the PyTorch backend picks instead of `quant_algo` on SM 100 and newer, where the format's
    algorithm depends on the GPU (MXFP4, `algo_on`); None: `quant_algo` on every GPU."""
    modules: tuple[str, ...] | None = None
    """The module kinds (quant/view.py MODULE_KINDS) the format can hold, where it quantizes only some (MXFP4: the
    routed experts); the checkpoint's exclude list can take more away (Quantization.modules). None: every linear."""

    measured_gemm: str | None = None
    """The gemm_dtype AIConfigurator's per-kernel database times this format's GEMMs under (plan/perf/kernels.py);
    None: not measured, its GEMMs are predicted from the roofline."""
    gemm_plugin: str | None = None
    """The trtllm-build --gemm_plugin its quantized linears need, which build.gemm_plugin auto resolves to; None:
    the spec's own. NVFP4's FP4Linear runs its FP4 GEMM only under the nvfp4 plugin and otherwise dequantizes to a
    dense matmul (tensorrt_llm/quantization/layers.py FP4Linear.forward), and ModelOpt's build script passes
    `--gemm_plugin nvfp4` for every NVFP4 checkpoint (examples/llm_ptq/modelopt_to_tensorrt_llm.py)."""

    @property
    def calibration(self) -> bool:
        """Computing it needs activation statistics (calibration data)."""
        return bool(self.stats)

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths that take it: the engine path unless `engine_why_not`, the LLM-API path where it has an HF
        export the PyTorch backend loads (`hf_name`; an unquantized model always)."""
        return tuple(path for path, ok in ((ENGINE, self.engine_why_not is None),
                                           (LLMAPI, self.hf_why_not is None)) if ok)

    @property
    def quantizer_ready(self) -> bool:
        """Convert and the HF export can compute it: its quantizer is not PENDING_QUANTIZERS'. Tune proposes only
        these, so it never proposes what convert refuses."""
        return self.quantizer not in PENDING_QUANTIZERS

    def ready_on(self, path: str) -> bool:
        """Convert computes it on `path`: on the engine path its quantizer (not PENDING_QUANTIZERS'), on the LLM-API
        path its HF export (checkpoint/hf_quant.py HF_COMPUTED; not PENDING_HF_EXPORTS'), which computes its own
        tensors, so FP8 block scales, which no engine path takes, are ready there."""
        return self.name not in PENDING_HF_EXPORTS if path == LLMAPI else self.quantizer_ready

    @property
    def cpu_kernel_ready(self) -> bool:
        """The CPU engine runs it (a plain fp linear, or a kernel not in PENDING_CPU_KERNELS)."""
        return self.cpu_kernel not in PENDING_CPU_KERNELS

    def algo_on(self, sm: int | None) -> str | None:
        """The QuantAlgo the runtime uses on SM `sm` (`blackwell_algo` from SM 100 on; None: the SM is unknown and
        `quant_algo` is said)."""
        return self.blackwell_algo if self.blackwell_algo and sm is not None and sm >= BLACKWELL.start else \
            self.quant_algo

    def check_implemented(self, path: str = LLMAPI) -> None:
        """Refuse, in one line, a row whose quantizer is pending on `path` (`ready_on`): before computing anything,
        never writing it as another format. The engine converter passes ENGINE; the HF export calls it as it is."""
        if self.ready_on(path):
            return
        if path != LLMAPI:
            raise ToolchainError(f"quantization.method {self.name} ({self.quant_algo}) is not implemented yet: no "
                                 "quantizer computes its tensors", "use quantization.method fp8 until it lands")
        raise ToolchainError(f"quantization.method {self.name} ({self.quant_algo}) has no Hugging Face-format "
                             "export yet", "use the engine path (target trtllm or cpu), or quantization.method "
                             "fp8 on the LLM-API path")


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

NONE = Format("none", None, "none", (), stored=FP_WEIGHT, built=FP_WEIGHT, measured_gemm="bfloat16")
INT8_WO = Format("int8_wo", "W8A16", "trtllm-build", (), stored=FP_WEIGHT, weight_only=True, devices=INTEGER_GPUS,
                 built=(Tensor("weight", ("out", "in"), "int8", "weight"),
                        Tensor("weights_scaling_factor", ("out",), "float16", "out_vec")),
                 cpu_kernel="int8_wo", hf_why_not=_WO_NO_HF, measured_gemm="int8_wo")
INT4_WO = Format("int4_wo", "W4A16", "trtllm-build", (), stored=FP_WEIGHT, weight_only=True, devices=INTEGER_GPUS,
                 built=(_INT4_WEIGHT, Tensor("weights_scaling_factor", ("out",), "float16", "out_vec")),
                 cpu_kernel="int4_wo", hf_why_not=_WO_NO_HF, measured_gemm="int4_wo")
AWQ = Format("awq", "W4A16_AWQ", "awq", ("absmean", "cov"), devices=INTEGER_GPUS, per_group=True,
             stored=(_INT4_WEIGHT, _INT4_GROUP_SCALES, _PREQUANT),
             built=(_INT4_WEIGHT, _INT4_GROUP_SCALES_BUILT, _PREQUANT),
             cpu_kernel="int4_group", hf_name="int4_awq", hf_weight="uint8", measured_gemm="int4_wo")
SMOOTHQUANT = Format("smoothquant", "W8A8_SQ_PER_CHANNEL", "smoothquant", ("amax",), devices=INTEGER_GPUS,
                     stored=(Tensor("weight", ("out", "in"), "int8", "weight"),
                             Tensor("weights_scaling_factor", ("out",), "float32", "out_vec"),
                             Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar"), _PREQUANT),
                     built=(Tensor("weight", ("out", "in"), "int8", "weight"),
                            Tensor("weights_scaling_factor", ("out",), "float32", "out_vec"),
                            Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar"), _PREQUANT),
                     cpu_kernel="sq", math="int8", measured_gemm="sq",
                     # tensorrt_llm/_torch/modules/linear.py get_quant_method has no W8A8_SQ_PER_CHANNEL branch:
                     # the backend raises "unsupported quant mode" for it.
                     hf_why_not="(W8A8_SQ_PER_CHANNEL) does not load on the PyTorch backend; use fp8 or awq")
FP8 = Format("fp8", "FP8", "fp8", ("amax",), devices=FP8_GPUS,
             stored=(Tensor("weight", ("out", "in"), "fp8", "weight"),
                     Tensor("weights_scaling_factor", _SCALAR, "float32", "scalar"),
                     Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar")),
             built=(Tensor("weight", ("out", "in"), "fp8", "weight"),
                    Tensor("weights_scaling_factor", _SCALAR, "float32", "scalar"),
                    Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar")),
             cpu_kernel="fp8", cpu_widened=True, hf_name="fp8", hf_weight="fp8", math="fp8", measured_gemm="fp8")
# An AutoAWQ (GEMM) or GPTQ int4 checkpoint imported losslessly (quant/prequantized.py): the same
# QuantAlgo and kernel as awq, with zero points instead of the prequant vector (has_zero_point).
IMPORTED_INT4 = Format("imported_int4", AWQ.quant_algo, "imported", (), devices=INTEGER_GPUS, per_group=True,
                       stored=(_INT4_WEIGHT, _INT4_GROUP_SCALES, _ZERO),
                       built=(_INT4_WEIGHT, _INT4_GROUP_SCALES_BUILT, _ZERO),
                       cpu_kernel="int4_group", measured_gemm="int4_wo",
                       hf_why_not="is an AutoAWQ/GPTQ import, which the LLM-API path loads from its own files")

# NVFP4 (TensorRT-LLM FP4Linear / FP4RowLinear, tensorrt_llm/quantization/layers.py @2a9abd95; notes/i35-facts.md
# sections 2-3): e2m1 weights two to a byte, even element in the low nibble, stored as ModelOpt's engine export
# writes them (uint8 (out, in/2)); one e4m3 scale per 16 input channels (FP4Linear's fixed scaling_vector_size,
# written as config.json's group_size 16, QuantConfig's default being 128); a float32 global weight scale
# (weights_scaling_factor_2) and the static input scale from calibrated amax / (6 x 448). trtllm-build renames
# them (preprocess_perlayer_weights, tensorrt_llm/models/modeling_utils.py @0c8de69), keeps the scales and adds
# their 128x4-padded interleaved copy and alpha = input scale x global weight scale.
_NVFP4_SCALES = Tensor("weights_scaling_factor", ("out", "in/16"), "fp8", "out_groups")
NVFP4 = Format("nvfp4", "NVFP4", "nvfp4", ("amax",), devices=NVFP4_GPUS, group_size=16,
               stored=(Tensor("weight", ("out", "in/2"), "uint8", "weight"), _NVFP4_SCALES,
                       Tensor("weights_scaling_factor_2", _SCALAR, "float32", "scalar"),
                       Tensor("activation_scaling_factor", _SCALAR, "float32", "scalar")),
               # What the GEMM reads once loaded, on either path: the PyTorch backend keeps only the interleaved
               # weight_scale (NVFP4LinearMethod.create_weights), and trtllm-build, which turns the nvfp4 GEMM
               # plugin on for NVFP4, feeds that plugin only weights_block_scaling_factor_interleaved
               # (FP4Linear.forward); the plain copy it also declares serves the plugin-less path only.
               built=(Tensor("weight", ("out", "in"), "fp4", "weight"),
                      Tensor("weights_block_scaling_factor_interleaved", ("pad128(out)", "pad4(in/16)"), "fp8",
                             "out_groups"),
                      Tensor("weights_global_scaling_factor", _SCALAR, "float32", "scalar"),
                      Tensor("activation_global_scaling_factor", _SCALAR, "float32", "scalar"),
                      Tensor("alpha", _SCALAR, "float32", "scalar")),
               cpu_kernel="nvfp4", cpu_widened=True, hf_name="nvfp4", hf_weight="uint8", math="fp4", gemm_plugin="nvfp4",
               measured_gemm="nvfp4")
# FP8 block scales (DeepSeek-V3's recipe; TensorRT-LLM FP8BlockScalesLinearMethod, tensorrt_llm/_torch/modules/
# linear.py; notes/i35-facts.md section 4.2): e4m3 weights and one float32 dequantization scale (amax / 448) per
# 128x128 tile, a partial tile at the edge having its own. Weights only: the activations are quantized per 1x128 at
# run time (fp8_quantize_1x128), so nothing is calibrated. Its scale grid splits by whole tiles with the weight's rows
# or columns (layout "tiles"): the fused loaders concatenate each part's per-rank grid (load_weights_fused_qkv_linear,
# load_weights_fused_gate_up_linear), so each part's rows per rank, and each row-parallel rank's input width, must be
# whole tiles. The PyTorch backend only: trtllm-build has no branch.
_FP8_BLOCK = (Tensor("weight", ("out", "in"), "fp8", "weight"),
              Tensor("weights_scaling_factor", ("ceil(out/128)", "ceil(in/128)"), "float32", "tiles"))
FP8_BLOCK = Format("fp8_block", "FP8_BLOCK_SCALES", "fp8_block", (), devices=FP8_BLOCK_GPUS,
                   stored=_FP8_BLOCK, built=_FP8_BLOCK, cpu_kernel="fp8_block", cpu_widened=True, tile=128,
                   # ModelOpt's name for it, mapped to FP8_BLOCK_SCALES by QuantConfig._map_new_to_legacy_args.
                   hf_name="fp8_pb_wo", hf_weight="fp8", math="fp8", measured_gemm="fp8_block",
                   # quantize() (tensorrt_llm/quantization/quantize.py @89fd9b74) has no FP8_BLOCK_SCALES branch.
                   engine_why_not="has no engine path in TensorRT-LLM 1.2 (trtllm-build's quantize() has no "
                                  "FP8_BLOCK_SCALES branch and would build the linears unquantized); use target llmapi")

# MXFP4 (gpt-oss's released experts; notes/i35-facts.md sections 4.3, 5 and 6): e2m1 weights two to a byte, even
# element in the low nibble, and one E8M0 (uint8, 2^(s - 127)) scale per 32 input channels, as transformers'
# integrations/mxfp4.py declares them (`*_blocks` uint8 [E, out, in/32, 16], `*_scales` uint8 [E, out, in/32]). A
# stored format only: config.json `quantization_config: {quant_method: mxfp4}`, which TensorRT-LLM's
# QuantConfig.update_from_model_ckpt reads with group_size 32 and its own exclude list (attention, router,
# embeddings: the experts alone are MXFP4), its algorithm by GPU (get_mxfp4_quant_algo): W4A16_MXFP4 (bf16
# activations) below SM 100, W4A8_MXFP4_MXFP8 (MXFP8 activations; W4A8_MXFP4_FP8 with the TRITON MoE backend) from
# SM 100 on. TensorRT-LLM's gpt-oss README lists its MoE backends for Hopper and Blackwell only, so older GPUs are
# refused. The PyTorch backend only: trtllm-build's quantize() has no MXFP4 branch (section 2.3).
MXFP4_GPUS = Devices((range(90, NEWEST_SM),), WORDED,
                     why="(MXFP4 experts) runs on Hopper (SM 90) and Blackwell only (TensorRT-LLM's gpt-oss README "
                         "lists its MoE backends for those)",
                     fix="serve it on an H100/H200 or a Blackwell GPU")
_MXFP4 = (Tensor("weight", ("out", "in/2"), "uint8", "weight"),
          Tensor("weights_scaling_factor", ("out", "in/32"), "uint8", "out_groups"))
MXFP4 = Format("mxfp4", "W4A16_MXFP4", "stored_rows", (), devices=MXFP4_GPUS, group_size=32, stored=_MXFP4,
               built=_MXFP4, cpu_kernel="mxfp4", hf_name="mxfp4", hf_weight="uint8", blackwell_algo="W4A8_MXFP4_MXFP8",
               modules=("experts",),
               engine_why_not="has no engine path in TensorRT-LLM 1.2 (trtllm-build's quantize() has no MXFP4 "
                              "branch); use target llmapi")

METHODS: dict[str, Format] = {f.name: f for f in (NONE, INT8_WO, INT4_WO, AWQ, SMOOTHQUANT, FP8, NVFP4, FP8_BLOCK)}
"""The spec's quantization.method values, in the spec's order."""
STORED_ONLY: dict[str, Format] = {MXFP4.name: MXFP4}
"""Formats a checkpoint is stored in and convert imports, which no spec method writes."""
ALL: tuple[Format, ...] = (*METHODS.values(), IMPORTED_INT4, *STORED_ONLY.values())
BY_ALGO: dict[str | None, Format] = {
    **{f.quant_algo: f for f in METHODS.values()},
    **{a: f for f in STORED_ONLY.values() for a in (f.quant_algo, f.blackwell_algo) if a}}
"""config.json quant_algo -> the method that writes it (an import reads as awq's row plus zero points)."""
HF_EXPORTS: dict[str, Format] = {f.name: f for f in METHODS.values() if f.hf_name}
"""Methods with a ModelOpt Hugging Face export (the LLM-API path's pre-quantized checkpoint)."""
HF_IMPORTS: dict[str, Format] = {name: f for name, f in HF_EXPORTS.items() if f.ready_on(LLMAPI)}
"""Those whose export convert also imports as stored (quant/view.py stored_format, checkpoint/hf_quant.py
stored_linear): the ones whose HF export lands (not PENDING_HF_EXPORTS'), its reader with it. An import reads the
stored tensors, so it needs no quantizer of the engine path's (PENDING_QUANTIZERS gates computing a format)."""


@dataclass(frozen=True)
class KvFormat(_OnDevices):
    """One KV-cache format: x / scale stored as int8 or e4m3, one scale per layer
    (TensorRT-LLM tensorrt_llm/quantization/quantize_by_modelopt.py)."""

    name: str
    """The spec's quantization.kv_cache."""
    quant_algo: str | None
    """config.json `quantization.kv_cache_quant_algo`."""
    storage: str | None
    """What one cached element is stored as; None: the model's own dtype."""
    devices: Devices = ANY_GPU

    @property
    def calibration(self) -> bool:
        return self.quant_algo is not None


KV_CACHE: dict[str, KvFormat] = {k.name: k for k in (
    KvFormat("none", None, None),
    KvFormat("int8", "INT8", "int8", devices=INTEGER_GPUS),
    KvFormat("fp8", "FP8", "fp8", devices=FP8.devices),
)}
KV_BY_ALGO: dict[str | None, KvFormat] = {k.quant_algo: k for k in KV_CACHE.values()}


def active(method: str, kv_cache: str) -> bool:
    """Whether anything is quantized, the weights or the KV cache: the row-level rule behind the one
    answer every stage reads, Quantization.active (quant/view.py)."""
    return method != "none" or kv_cache != "none"


def weight_format(method: str, *, imported: bool = False) -> Format:
    """The row of a spec method, of a stored-only format (STORED_ONLY), or of an imported int4 checkpoint; KeyError
    for an unknown method (the spec and check_recipe refuse those first, naming the field)."""
    return IMPORTED_INT4 if imported else METHODS[method] if method in METHODS else STORED_ONLY[method]
