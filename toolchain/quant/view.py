"""The quantization view: the spec's `quantization` section read together with what the source checkpoint
holds, resolved once by `quantization_of` and read by every stage after.

One frozen value answers what the planner, the checks, convert, the HF export and the LLM-API path
ask: the weights' format row, the KV cache's, the QuantAlgo written, whether calibration runs and whether
anything is quantized at all (`active`). It keeps the request as the spec words it (`method` stays
"none" for an AutoAWQ/GPTQ checkpoint, whose refusals name the spec's fields) and the source beside
it: an AutoAWQ/GPTQ `quantization_config` (`prequantized`), or a ModelOpt Hugging Face-format export
whose stored format replaces the request (`modelopt`). SGLang's `server_args.py` settles its values the
same way, once, after parsing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from toolchain.errors import ToolchainError
from toolchain.quant import formats

BUILTIN = "builtin"
IMPORTABLE = ("awq", "gptq")  # the `quant_method`s of a quantization_config convert imports as stored int4
# ModelOpt's names for formats TensorRT-LLM has no QuantAlgo spelling of in its export: process_layer_quant_config
# (modelopt/torch/export/quant_utils.py, 0.47.0) passes the format string through, and TensorRT-LLM's
# QuantConfig._update_from_legacy_args / _map_new_to_legacy_args (tensorrt_llm/models/modeling_utils.py @0c8de69)
# map it back. The reader takes either spelling.
MODELOPT_NAMES = {"FP8_BLOCK_SCALES": "fp8_pb_wo"}
# TensorRT-LLM's QuantConfig.update_from_model_ckpt (tensorrt_llm/models/modeling_utils.py @0c8de69) reads a
# DeepSeek-V3-style config.json (quant_method "fp8" with weight_block_size) as FP8_BLOCK_SCALES and asserts
# "FP8_BLOCK_SCALES only supports block_size=(128,128)".
FP8_BLOCK_SIZE = (128, 128)
# The kinds of module a format may quantize only some of (Format.modules, Quantization.covers): a decoder layer's
# attention linears, its dense MLP, its routed experts and a shared expert; with the Hugging Face module of each
# (layer `{i}`) that a checkpoint's exclude list is matched against.
MODULE_KINDS = {"attention": "model.layers.{i}.self_attn", "mlp": "model.layers.{i}.mlp",
                "experts": "model.layers.{i}.mlp.experts", "shared_expert": "model.layers.{i}.mlp.shared_expert"}


@dataclass(frozen=True)
class Prequantized:
    """An HF `quantization_config` the converter can import (AutoAWQ GEMM or GPTQ)."""

    kind: str            # "awq" or "gptq"
    group_size: int
    bits: int
    zero_point: bool
    desc_act: bool = False
    version: str = "gemm"
    raw: dict = field(default_factory=dict)


def _number(qc: dict, keys: tuple[str, ...], default: int) -> int:
    """The first of `keys` present in `qc` as an int (a null reads 0, which check_recipe refuses), else `default`."""
    for key in keys:
        if key in qc:
            return int(qc[key] or 0)
    return default


def parse_prequantized(qc: dict | None, origin: str) -> Prequantized | None:
    """The HF `quantization_config`, or None for an unquantized checkpoint; refuses one convert cannot import."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in IMPORTABLE:
        raise ToolchainError(f"{origin}: quantization_config quant_method '{method}' cannot be imported",
                             "only AutoAWQ (GEMM) and GPTQ int4 checkpoints are; convert the unquantized model "
                             "and set quantization.method instead")
    bits = _number(qc, ("bits", "w_bit"), 4)
    group = _number(qc, ("group_size", "q_group_size"), 128)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        return Prequantized("awq", group, bits, bool(qc.get("zero_point", True)), False, version, dict(qc))
    return Prequantized("gptq", group, bits, True, bool(qc.get("desc_act", False)), "gptq", dict(qc))


@dataclass(frozen=True)
class Quantization:
    """The spec's quantization request and the source checkpoint's own format, with every answer the
    stages read (module docstring)."""

    method: str = "none"
    kv_cache: str = "none"
    group_size: int = 128
    alpha: float = 0.5
    exclude_modules: tuple[str, ...] = ()
    calibration_dataset: str = BUILTIN
    calibration_samples: int = 32
    calibration_seq_len: int = 256
    rounding: str = "gptq"
    """How awq picks its int4 integers on the searched grid: gptq (error-compensating) or nearest."""
    search: bool = True
    """AWQ's scale and clip search / SmoothQuant's smoothing. Off gives the
    round-to-nearest and plain-W8A8 baselines in the same layouts (benchmarks)."""
    prequantized: Prequantized | None = None
    """The source is an AutoAWQ/GPTQ int4 checkpoint (its `quantization_config`); under method none convert
    imports it as stored: W4A16 per group with zero points and no prequant scale (checkpoint/quantize.py)."""
    modelopt: bool = False
    """The source is a ModelOpt Hugging Face-format export: method, kv_cache, group_size and exclude_modules
    are the checkpoint's, its tensors are read as stored, so nothing is computed and nothing calibrated."""
    modules: frozenset[str] | None = None
    """The module kinds (MODULE_KINDS) the weights' format holds, where it holds only some: a stored format whose
    row names its kinds (Format.modules: MXFP4's experts), less those the checkpoint's exclude list names. None:
    every linear is in the format. Derived once (`_modelopt`); the planner asks `covers`/`on`."""

    @classmethod
    def of(cls, section) -> Quantization:
        """The spec's `quantization` section (QuantizationSection) as a request, before the checkpoint is read."""
        c = section.calibration
        return cls(method=section.method, kv_cache=section.kv_cache, group_size=section.group_size,
                   alpha=section.alpha, exclude_modules=tuple(section.exclude_modules), calibration_dataset=c.dataset,
                   calibration_samples=c.samples, calibration_seq_len=c.seq_len, rounding=section.rounding)

    @property
    def active(self) -> bool:
        """Whether anything is quantized, the weights or the KV cache: the one answer every stage reads.
        An AutoAWQ/GPTQ checkpoint under method none asks for nothing (`imported` says what it holds)."""
        return formats.active(self.method, self.kv_cache)

    @property
    def imported(self) -> str | None:
        """"awq" or "gptq" when the weights are an AutoAWQ/GPTQ checkpoint's int4, imported as stored
        (method none), else None."""
        return self.prequantized.kind if self.prequantized is not None and self.method == "none" else None

    @property
    def reads_stored(self) -> bool:
        """The quantized tensors are read from the checkpoint (an import), not computed from fp weights."""
        return self.prequantized is not None or self.modelopt

    @property
    def weight_method(self) -> str:
        """The spec method whose format the weights are in: an imported int4 checkpoint's is awq's."""
        return "awq" if self.imported else self.method

    @property
    def weight_group_size(self) -> int:
        """Input channels per int4 scale of the weights: an imported checkpoint's own, else group_size."""
        pre = self.prequantized
        return (pre.group_size or 128) if pre is not None and self.imported else self.group_size

    @property
    def format(self) -> formats.Format:
        """The weights' row (quant/formats.py): an imported checkpoint's own int4 format when imported."""
        return formats.weight_format(self.method, imported=self.imported is not None)

    def covers(self, kind: str) -> bool:
        """Whether the linears of module kind `kind` (MODULE_KINDS) are in the weights' format."""
        return self.modules is None or kind in self.modules

    def on(self, kind: str) -> Quantization:
        """The view for the linears of module kind `kind`: this one where the format covers them, else the
        unquantized one (they stay in the model dtype), with the same KV cache."""
        return self if self.covers(kind) else Quantization(kv_cache=self.kv_cache)

    @property
    def kv_format(self) -> formats.KvFormat:
        return formats.KV_CACHE[self.kv_cache]

    @property
    def quant_algo(self) -> str | None:
        return self.format.quant_algo

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return self.kv_format.quant_algo

    @property
    def per_group(self) -> bool:
        return self.format.per_group

    @property
    def weight_only(self) -> bool:
        return self.format.weight_only

    @property
    def integer(self) -> bool:
        """Formats Blackwell cannot build (TensorRT-LLM tensorrt_llm/builder.py, build)."""
        return self.format.integer

    @property
    def needs_calibration(self) -> bool:
        return not self.modelopt and (self.format.calibration or self.kv_format.calibration)

    def describe(self, sm: int | None = None) -> str:
        """The weights' format in words: its QuantAlgo (on SM `sm` where the runtime picks it by GPU, Format.algo_on)
        and, for a format holding some module kinds only, which."""
        algo = self.format.algo_on(sm) or "no weight quantization"
        if self.modules is not None:
            algo += " on the " + " and ".join(sorted(k.replace("_", " ") for k in self.modules))
        if self.per_group:
            algo += f" g{self.weight_group_size}"
        if self.imported:
            algo += f" (stored {self.imported.upper()} int4 with zero points, imported as is)"
        return algo


def _modelopt(fmt: dict, requested: Quantization) -> Quantization:
    """The view of a ModelOpt HF-format checkpoint (`fmt`: checkpoint/hf_quant.py read_hf_quant_format, its
    group size settled), marked so its tensors are read, not computed. The spec's own request may not ask
    for more: nothing can be calibrated on (or quantized again from) already-quantized weights."""
    algo, kv = fmt["quant_algo"], fmt["kv_cache_quant_algo"]
    what = f"ModelOpt {algo or 'FP8 KV cache'}"
    if requested.method != "none":
        raise ToolchainError(f"the checkpoint is already quantized ({what}); quantization.method "
                             f"'{requested.method}' would quantize it twice",
                             "set quantization.method none to import it as stored")
    if requested.kv_cache == "fp8" and kv != "FP8":
        raise ToolchainError(f"quantization.kv_cache fp8: the pre-quantized ({what}) checkpoint carries no FP8 "
                             "KV-cache scales (k_scale / v_scale) and cannot be calibrated",
                             "set quantization.kv_cache none, or export the checkpoint with kv cache fp8")
    if requested.kv_cache not in ("none", "fp8"):
        raise ToolchainError(f"quantization.kv_cache {requested.kv_cache} needs calibration, which cannot run a "
                             f"pre-quantized ({what}) checkpoint", "set quantization.kv_cache none for this checkpoint")
    row = formats.BY_ALGO[algo]
    # group_size is per-group int4's; a block the format fixes (NVFP4's 16, FP8 block's 128) is its row's.
    return Quantization(method=row.name, group_size=(fmt["group_size"] or 128) if row.per_group else 128,
                        kv_cache=formats.KV_BY_ALGO[kv].name, modelopt=True, modules=fmt.get("modules"))


def converts(module: str, patterns: list[str]) -> bool:
    """Whether transformers quantizes `module` under a `modules_to_not_convert` of `patterns`
    (quantizers/quantizers_utils.py should_convert_module, transformers 5.25: a pattern skips a module it matches
    from the start up to a module boundary, as a regex, or as a suffix)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns)


def _mxfp4(qc: dict, layers: int, where: str) -> dict:
    """A gpt-oss MXFP4 checkpoint's format. transformers converts GptOssExperts only (integrations/mxfp4.py
    replace_with_mxfp4_linear: `should_convert_module(f"{module_name}.experts", modules_to_not_convert)`) and
    TensorRT-LLM quantizes the experts whatever the list says (its own exclude list, notes/i35-facts.md section 5),
    so the list must leave every layer's experts in MXFP4: one it excludes would be read as MXFP4 there."""
    ignore = qc.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ToolchainError(f"{where}: quantization_config.modules_to_not_convert must be a list of module names, "
                             f"got {ignore!r}")
    kept = [i for i in range(layers) if not converts(MODULE_KINDS["experts"].format(i=i), ignore)]
    if kept:
        raise ToolchainError(f"{where}: quantization_config (mxfp4) modules_to_not_convert names the experts of "
                             f"layer {kept[0]}, which TensorRT-LLM would still read as MXFP4",
                             "import a checkpoint whose experts are MXFP4 in every layer (as released)")
    row = formats.STORED_ONLY["mxfp4"]
    return {"quant_algo": row.quant_algo, "kv_cache_quant_algo": None, "group_size": row.group_size,
            "exclude_modules": list(ignore), "modules": frozenset(row.modules or ())}


def stored_format(hf_config: dict | None, hf_quant_config: dict | None = None,
                  where: str = "the checkpoint") -> dict | None:
    """The format of a checkpoint stored in one convert imports as it is, as {quant_algo, kv_cache_quant_algo,
    group_size, exclude_modules}, or None for any other: a ModelOpt Hugging Face-format export
    (hf_quant_config.json's `quantization`, which TensorRT-LLM reads first, else config.json's
    `quantization_config` with quant_method "modelopt"), or a DeepSeek-V3-style FP8 block-scale checkpoint
    (config.json quant_method "fp8" with weight_block_size; `weight_scale_inv` per linear), or a gpt-oss MXFP4
    checkpoint (quant_method "mxfp4": its experts' `*_blocks`/`*_scales`; `modules`, the kinds it covers). The one
    place that recognises them: the planner and convert both ask here (`quantization_of`). Refuses, naming `where`,
    what cannot be imported. `exclude_modules` are Hugging Face module names (globs)."""
    qc = (hf_config or {}).get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    method = str(qc.get("quant_method", "")).lower()
    if hf_quant_config is not None:
        q = hf_quant_config.get("quantization") or {}
        kv, ignore = q.get("kv_cache_quant_algo"), q.get("exclude_modules") or []
    elif method == "modelopt":
        q = qc
        scheme = q.get("kv_cache_scheme")
        kv = "FP8" if isinstance(scheme, dict) and scheme.get("type") == "float" else scheme
        ignore = q.get("ignore") or []
    elif method == "mxfp4":
        return _mxfp4(qc, int((hf_config or {}).get("num_hidden_layers") or 0), where)
    elif method == "fp8" and qc.get("weight_block_size"):
        block = tuple(qc["weight_block_size"])
        if block != FP8_BLOCK_SIZE:
            raise ToolchainError(f"{where}: weight_block_size {list(block)}: TensorRT-LLM's QuantConfig asserts "
                                 "\"FP8_BLOCK_SCALES only supports block_size=(128,128)\" (tensorrt_llm/models/"
                                 "modeling_utils.py)", "use a checkpoint quantized in 128x128 blocks")
        # TensorRT-LLM keeps no exclusion list of the checkpoint's here (it sets its own); transformers'
        # FineGrainedFP8Config names the modules it left unquantized in modules_to_not_convert.
        ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
        return {"quant_algo": "FP8_BLOCK_SCALES", "kv_cache_quant_algo": None, "group_size": FP8_BLOCK_SIZE[0],
                "exclude_modules": list(ignore)}
    else:
        return None
    named = q.get("quant_algo")
    algo = next((a for a, m in MODELOPT_NAMES.items() if m == named), named)
    importable = sorted(str(f.quant_algo) for f in formats.HF_IMPORTS.values())
    if (algo is not None and algo not in importable) or q.get("has_zero_point"):
        zero = " with zero points" if q.get("has_zero_point") else ""
        raise ToolchainError(f"{where}: ModelOpt quant_algo {named}{zero} cannot be imported",
                             f"only {' and '.join(importable)} (no zero point) checkpoints can; convert the "
                             "unquantized model and set quantization.method instead")
    if kv not in (None, "FP8"):
        raise ToolchainError(f"{where}: ModelOpt kv_cache_quant_algo {kv} cannot be imported",
                             "only an FP8 KV cache (k_scale / v_scale) can; re-export with kv cache fp8 or none")
    return {"quant_algo": algo, "kv_cache_quant_algo": kv, "group_size": q.get("group_size"),
            "exclude_modules": list(ignore)}


def quantization_of(requested, hf_config: dict | None = None, *, modelopt: dict | None = None,
                    origin: str | None = None, hf_quant_config: dict | None = None) -> Quantization:
    """The view, resolved once: `requested` (the spec's `quantization` section, or a Quantization request)
    with the source checkpoint's config.json (`hf_config`) and hf_quant_config.json (`hf_quant_config`, where it
    has one). A checkpoint stored in a format convert imports as it is (`stored_format`: a ModelOpt export, a
    DeepSeek-style FP8 block-scale checkpoint) replaces the request after refusing what cannot apply to stored
    weights, so the planner plans it at its stored size; `modelopt` passes that format as convert settled it
    (its group size read off the stored shapes). An AutoAWQ/GPTQ `quantization_config` is recorded as
    `prequantized`; a config of another kind reads as unquantized, unless `origin` (the config's path, which
    convert passes) is given, and then it is refused naming it. Without `hf_config` the request is returned
    as it is."""
    request = requested if isinstance(requested, Quantization) else Quantization.of(requested)
    if modelopt is None and hf_config is not None:
        modelopt = stored_format(hf_config, hf_quant_config, origin or "the checkpoint")
    if modelopt is not None:
        return _modelopt(modelopt, request)
    if hf_config is None:  # the checkpoint is not read here (or not readable): the request alone
        return request
    qc = hf_config.get("quantization_config")
    importable = isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() in IMPORTABLE
    pre = parse_prequantized(qc, origin or "config.json") if importable or origin is not None else None
    return replace(request, prequantized=pre)
