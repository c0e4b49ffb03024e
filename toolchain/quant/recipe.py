"""The one function that rejects bad quantization combinations, and the layout rules it applies.

`check_recipe` runs before any weight is read: it needs only the quantization view (quant/view.py), the
model's dimensions (from config.json), the parallelism, the target GPU if one
is named, the source checkpoint's format the view records if it is already quantized,
and the calibration file's existence. Every error names the spec field to
change and how.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.quant.view import BUILTIN, Quantization
from toolchain.targets import ENGINE, TARGETS, TRTLLM_BUILD

METHODS = tuple(formats.METHODS)
KV_KINDS = tuple(formats.KV_CACHE)
ROUNDINGS = ("gptq", "nearest")
GROUP_SIZES = (64, 128)  # the only per-group int4 sizes TensorRT-LLM implements (TensorRT-LLM issue #988)


@dataclass(frozen=True)
class ModelShape:
    """The config.json facts the checks need (kept free of the archs package)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    max_position_embeddings: int
    kv_block_scales_duplicated: bool = False
    """The family's TensorRT-LLM weight mapper repeats FP8 block scales with the K/V heads it duplicates across
    ranks (Family.duplicates_kv_block_scales)."""
    mla: dict | None = None
    """Multi-head latent attention's ranks (DeepSeek-V3, ArchParams.mla): kv_b_proj and o_proj's per-head widths."""

    @classmethod
    def of(cls, params, family) -> "ModelShape":
        """The shape of a model's normalised parameters (archs ArchParams) and its family's mapper trait (archs
        Family), both read by attribute so this floor stays free of the archs package."""
        return cls(params.hidden_size, params.intermediate_size, params.num_attention_heads,
                   params.num_key_value_heads, params.head_size, params.max_position_embeddings,
                   family.duplicates_kv_block_scales, getattr(params, "mla", None))


@dataclass(frozen=True)
class LayoutPlan:
    """What the checks settled for the writer: the intermediate size per-group
    int4 layers are padded to (zero rows/columns; TensorRT-LLM tensorrt_llm/quantization/layers.py)."""

    padded_intermediate: int


def per_group_multiple(group_size: int, tp: int) -> int:
    """The engine pads per-group int4 dims to multiples of max(64, g) * T (TensorRT-LLM
    tensorrt_llm/quantization/layers.py, WeightOnlyGroupwiseQuantLinear; issue #648)."""
    return max(64, group_size) * tp


def check_per_group(shape: ModelShape, group: int, tp: int, field_name: str) -> int:
    """Divisibility for per-group int4; returns the padded intermediate size."""
    m = per_group_multiple(group, tp)
    nkv_r = max(1, shape.num_key_value_heads // tp)
    qkv_out = (shape.num_attention_heads + 2 * nkv_r * tp) * shape.head_size
    attn_in = shape.num_attention_heads * shape.head_size
    fixes = f"use {field_name} 64, or another parallelism.tp"
    for what, dim in (("hidden_size", shape.hidden_size), ("the fused qkv width", qkv_out),
                      ("num_attention_heads x head_size", attn_in)):
        if dim % m:
            # Padding attention dims would change the head layout: reject.
            raise ToolchainError(f"per-group int4 (group {group}) at tp {tp} needs {what} ({dim}) to be a multiple "
                                 f"of max(64, group) x tp = {m}", fixes)
    padded = -(-shape.intermediate_size // m) * m  # zero rows/columns in the MLP are harmless
    if shape.intermediate_size % group:
        # The groups are formed before padding, so the real width must split into whole groups.
        raise ToolchainError(f"per-group int4: intermediate_size {shape.intermediate_size} is not a multiple of "
                             f"the group size {group}", fixes)
    for what, local in (("hidden_size", shape.hidden_size), ("attention input per rank", attn_in // tp),
                        ("intermediate size per rank", padded // tp)):
        if local % group:
            raise ToolchainError(f"per-group int4: {what} ({local}) is not a multiple of the group size {group}",
                                 fixes)
    if (qkv_out // tp) % 2 or (padded // tp) % 2 or shape.hidden_size % 2:
        raise ToolchainError("per-group int4 packs two rows per byte: every per-rank output width must be even",
                             "use another parallelism.tp")
    return padded


def pytorch_per_group_problems(shape: ModelShape, group: int, tp: int) -> list[str]:
    """What the LLM-API path's PyTorch backend refuses for per-group int4 at `tp`: it pads nothing, and
    the int4 AWQ linear method's create_weights raises unless each rank's in_features is a multiple of the
    group size (TensorRT-LLM tensorrt_llm/_torch/modules/linear.py at 00bbf71e; a row-parallel
    linear's in_features are split by tp). Empty when the split loads."""
    dims = (("hidden_size", shape.hidden_size),
            ("attention width per rank", shape.num_attention_heads * shape.head_size // tp),
            ("intermediate_size per rank", shape.intermediate_size // tp))
    return [f"{what} {dim}" for what, dim in dims if dim % group]


def check_pytorch_per_group(shape: ModelShape, group: int, tp: int, splits: Callable[[int], bool]) -> None:
    """Refuse, in one line with a fix that works for the model, a per-group int4 split the PyTorch
    backend cannot load (pytorch_per_group_problems). `splits(t)` says whether tp t splits the model at all
    (archs/layout.py splits_tp, which this floor cannot import), so a suggested tp is one convert accepts."""
    problems = pytorch_per_group_problems(shape, group, tp)
    if not problems:
        return
    tps = [t for t in (2, 4, 8, 16) if t != tp and splits(t) and not pytorch_per_group_problems(shape, group, t)]
    m = group * tp
    padded = -(-shape.intermediate_size // m) * m
    fixes = [f"parallelism.tp {' or '.join(map(str, tps))}"] if tps else []
    fixes.append("target trtllm (trtllm-build pads the MLP to whole groups per rank)")
    if shape.intermediate_size % m and not problems[:-1]:
        fixes.append(f"a checkpoint whose MLP is zero-padded to intermediate_size {padded} (as Qwen's own "
                     "Qwen2.5-72B-Instruct-AWQ pads 29568 to 29696)")
    raise ToolchainError(f"per-group int4 (group {group}) at tp {tp} on the LLM-API path: {', '.join(problems)} "
                         f"not a multiple of the group size, and the PyTorch backend does not pad",
                         "use " + ", or ".join(fixes))


def check_blocks(quant: Quantization, shape: ModelShape, tp: int, splits: Callable[[int], bool] | None = None) -> None:
    """A format that fixes its block (NVFP4: one e4m3 scale per 16 input channels, Format.group_size) needs every
    rank's input width in whole blocks: FP4Linear asserts `in_features % 16 == 0` on the per-rank in_features
    (tensorrt_llm/quantization/layers.py @2a9abd95), and the block scales split with the weight. The widths are the
    ones the PyTorch backend's per-group int4 needs whole (pytorch_per_group_problems). Refused in one line naming
    parallelism.tp; `splits(t)` (archs/layout.py splits_tp) picks the tps the fix names."""
    block = quant.format.group_size
    if block is not None and (quant.covers("attention") or quant.covers("mlp")):  # the experts': moe.block_problem
        _refuse_split(quant, tp, lambda t: pytorch_per_group_problems(shape, block, t), splits,
                      f"its block of {block} input channels", "use another quantization.method (fp8 or awq)")


def _refuse_split(quant: Quantization, tp: int, problems: Callable[[int], list[str]],
                  splits: Callable[[int], bool] | None, unit: str, otherwise: str) -> None:
    """Refuse, in one line, a tp at which `problems(tp)` names widths that are not whole `unit`s, its fix the tps
    that split the model (`splits`) with none, else `otherwise`; nothing where there is none at `tp`."""
    found = problems(tp)
    if not found:
        return
    tps = [t for t in (1, 2, 4, 8, 16) if t != tp and splits is not None and splits(t) and not problems(t)]
    raise ToolchainError(f"quantization.method {quant.method} at parallelism.tp {tp}: {', '.join(found)} not a "
                         f"multiple of {unit}", f"use parallelism.tp {' or '.join(map(str, tps))}" if tps else otherwise)


def tile_problems(shape: ModelShape, tile: int, tp: int) -> list[str]:
    """The per-rank widths at `tp` that are not whole `tile` x `tile` tiles, each as "what width". TensorRT-LLM's
    FP8BlockScalesLinearMethod (tensorrt_llm/_torch/modules/linear.py) shards each part's grid by tp and
    concatenates the parts' grids along dim 0 (load_weights_fused_qkv_linear, load_weights_fused_gate_up_linear)
    into a parameter of ceil(per-rank rows / tile) rows, which lines up only where each part's per-rank rows are
    whole tiles, at tp 1 too; a row-parallel layer's grid columns are split by tp with its input. So: q heads x
    head_size / tp (o_proj's input too), the KV heads a rank holds x head_size (one duplicated head when
    nkv < tp, its grid rows repeated as the weight's; open point: _duplicate_kv_weights does that for the scale only
    where the model's weight mapper lists it, Qwen3's `weight_scale_inv`, and the generic HfWeightMapper lists only
    NVFP4's `weight_scale`), and intermediate_size / tp (gate/up's rows, down_proj's input)."""
    q_rows = shape.num_attention_heads * shape.head_size // tp
    kv_rows = max(1, shape.num_key_value_heads // tp) * shape.head_size  # checkpoint/sharding.py kv_heads_per_rank
    dims = [("q rows per rank (heads x head_size / tp, o_proj's input)", q_rows),
            ("k/v rows per rank (KV heads x head_size)", kv_rows),
            ("gate/up rows per rank (intermediate_size / tp, down_proj's input)", shape.intermediate_size // tp)]
    if shape.mla is not None:  # q_b_proj's rows are the q rows above; kv_b_proj and o_proj have their own
        heads = shape.num_attention_heads // tp
        dims += [("kv_b_proj rows per rank (heads / tp x (qk_nope_head_dim + v_head_dim))",
                  heads * (shape.mla["qk_nope_head_dim"] + shape.mla["v_head_dim"])),
                 ("o_proj's input per rank (heads / tp x v_head_dim)", heads * shape.mla["v_head_dim"])]
    return [f"{what} {dim}" for what, dim in dims if dim % tile]


def check_tiles(quant: Quantization, shape: ModelShape, tp: int, splits: Callable[[int], bool] | None = None) -> None:
    """A format scaling square weight tiles (FP8 block scales, Format.tile) needs the widths tile_problems names in
    whole tiles at the spec's tp: refused in one line naming them and a parallelism.tp that has them (`splits(t)`,
    archs/layout.py splits_tp, says which tps split the model at all), else quantization.method fp8."""
    tile = quant.format.tile
    nkv = shape.num_key_value_heads
    if tile is not None and nkv < tp and not shape.kv_block_scales_duplicated:
        # HfWeightMapper._duplicate_kv_weights repeats weight, bias and NVFP4's weight_scale only; the Qwen3-MoE and
        # Qwen3-Next mappers add weight_scale_inv (tensorrt_llm/_torch/models/checkpoints/hf/).
        fewer = [t for t in (1, 2, 4, 8) if t <= nkv and (splits is None or splits(t))
                 and not tile_problems(shape, tile, t)]
        raise ToolchainError(f"quantization.method {quant.method} at parallelism.tp {tp}: the {nkv} KV heads would be "
                             "repeated across ranks, and TensorRT-LLM's weight mapper for this family repeats their "
                             "weights but not their block scales, so the checkpoint would not load",
                             f"use parallelism.tp {fewer[-1]}" if fewer else "use quantization.method fp8")
    if tile is not None:
        _refuse_split(quant, tp, lambda t: tile_problems(shape, tile, t), splits,
                      f"its {tile}x{tile} tiles, whose scale grids the fused layers concatenate per part",
                      "quantize the unquantized model with quantization.method fp8 instead" if quant.reads_stored
                      else "use quantization.method fp8")


def path_refusal(quant: Quantization, path: str) -> str | None:
    """The row's path rule (Format.paths) on the engine path, in the one line plan's quant.engine-path check and
    convert print; None where the path takes the format. The LLM-API path's own rule is the HF export's
    (checkpoint/hf_quant.py hf_quant_problem, from the row's hf_name / hf_why_not)."""
    row = quant.format
    if path == ENGINE and path not in row.paths:
        return f"quantization.method {quant.weight_method} {row.engine_why_not}"
    return None


def device_refusal(quant: Quantization, gpu_name: str | None, sm: int) -> str | None:
    """The WORDED device rules (Devices.worded) of the weights' and the KV cache's rows, in the one line plan's
    quant.device check and convert print; None where both run on SM `sm` or an older rule words the refusal."""
    for what, row in (("quantization.method " + quant.weight_method, quant.format),
                      ("quantization.kv_cache " + quant.kv_cache, quant.kv_format)):
        line = row.devices.worded(what, gpu_name, sm)
        if line is not None:
            return line
    return None


def _check_gpu(quant: Quantization, gpu_name: str | None, sm: int | None) -> None:
    """The formats' SM rules (Format.refused_on), as convert's refusal."""
    if sm is None:
        return
    worded = device_refusal(quant, gpu_name, sm)
    if worded is not None:  # the line names its fix
        raise ToolchainError(worded)
    name = gpu_name or f"SM{sm}"
    parts = (("an imported int4 checkpoint" if quant.imported else "quantization.method " + quant.method,
              quant.format), ("quantization.kv_cache " + quant.kv_cache, quant.kv_format))
    old = [(what, f.min_sm) for what, f in parts if f.refused_on(sm) == "too old"]
    if old:
        raise ToolchainError(f"{old[0][0]} needs an Ada or Hopper GPU (SM >= {old[0][1]}); {name} is SM{sm}",
                             "use quantization.method awq, int8_wo or smoothquant (and kv_cache int8) on this GPU")
    ints = [what for what, f in parts if f.refused_on(sm) == "blackwell"]
    if ints:
        raise ToolchainError(f"{ints[0]} does not build on Blackwell ({name}, SM{sm}): TensorRT-LLM rejects "
                             "int8/int4 weight-only, SmoothQuant and INT8 KV there (tensorrt_llm/builder.py)",
                             "use quantization.method fp8 and kv_cache fp8")


def check_calibration_file(dataset: str) -> Path:
    """The calibration prompts file must exist, be readable text and hold a non-blank line."""
    path = Path(dataset)
    hint = "set quantization.calibration.dataset to a readable text/JSONL file of prompts, or to 'builtin'"
    if not path.is_file():
        raise ToolchainError(f"quantization.calibration.dataset: no such file {path}", hint)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ToolchainError(f"quantization.calibration.dataset: cannot read {path}: {err}", hint) from None
    if not text.strip():
        raise ToolchainError(f"quantization.calibration.dataset: {path} is empty", hint)
    return path


def check_exclude(patterns: tuple[str, ...]) -> None:
    for p in patterns:
        if not isinstance(p, str) or not p.strip():
            raise ToolchainError(f"quantization.exclude_modules: empty pattern {p!r}",
                                 "give fnmatch globs of TensorRT-LLM module names, e.g. 'transformer.layers.0.*'")


def is_excluded(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """fnmatch against TensorRT-LLM module names, as TensorRT-LLM matches exclude_modules (QuantConfig,
    tensorrt_llm/models/modeling_utils.py)."""
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def check_recipe(quant: Quantization, shape: ModelShape, *, tp: int, target: str = "cpu", gpu_name: str | None = None,
                 gpu_sm: int | None = None, splits: Callable[[int], bool] | None = None,
                 path: str | None = None) -> LayoutPlan:
    """Reject every invalid combination before a weight is read; returns the layout decisions. `splits(t)` says
    whether tp t splits the model (archs/layout.py splits_tp), for the tps a refusal suggests. `path` is the path
    whose runtime loads what convert writes, the target's unless given (the LLM-API stand-in's, below)."""
    if quant.method not in METHODS and not (quant.modelopt and quant.method in formats.STORED_ONLY):
        raise ToolchainError(f"quantization.method '{quant.method}' is unknown", f"use one of {', '.join(METHODS)}")
    if quant.kv_cache not in KV_KINDS:
        raise ToolchainError(f"quantization.kv_cache '{quant.kv_cache}' is unknown",
                             f"use one of {', '.join(KV_KINDS)}")
    if quant.rounding not in ROUNDINGS:
        raise ToolchainError(f"quantization.rounding '{quant.rounding}' is unknown",
                             f"use one of {', '.join(ROUNDINGS)}")
    check_exclude(quant.exclude_modules)
    padded = shape.intermediate_size
    if quant.prequantized is not None:
        pre = quant.prequantized
        if quant.method != "none":
            raise ToolchainError(f"the checkpoint is already quantized ({pre.kind}); quantization.method "
                                 f"'{quant.method}' would quantize it twice",
                                 "set quantization.method none to import it as stored")
        if quant.kv_cache != "none":
            raise ToolchainError("quantization.kv_cache needs calibration, which cannot run a pre-quantized "
                                 f"({pre.kind}) checkpoint", "set quantization.kv_cache none for this checkpoint")
        if pre.kind == "gptq" and pre.desc_act:
            raise ToolchainError("GPTQ checkpoint uses act-order (desc_act: true), which the TensorRT-LLM layout "
                                 "cannot express (TensorRT-LLM tensorrt_llm/models/llama/convert.py)",
                                 "re-quantize it with desc_act false")
        if pre.kind == "awq" and pre.version != "gemm":
            raise ToolchainError(f"AutoAWQ version '{pre.version}' cannot be imported", "only GEMM checkpoints can")
        if pre.bits != 4:
            raise ToolchainError(f"{pre.kind} checkpoint has {pre.bits}-bit weights", "only 4-bit ones can be imported")
        if pre.group_size not in GROUP_SIZES:
            raise ToolchainError(f"{pre.kind} checkpoint has group_size {pre.group_size}",
                                 "TensorRT-LLM's per-group int4 supports 64 and 128 only; re-quantize with one")
        padded = check_per_group(shape, pre.group_size, tp, "a checkpoint quantized with group size")
    if quant.group_size not in GROUP_SIZES:
        if quant.modelopt:  # the checkpoint's own group size, not a spec field
            raise ToolchainError(f"the checkpoint is quantized with group_size {quant.group_size}",
                                 "TensorRT-LLM's per-group int4 supports 64 and 128 only; re-export with one")
        raise ToolchainError(f"quantization.group_size {quant.group_size} is not supported",
                             "TensorRT-LLM's per-group int4 implements 64 and 128 only (issue #988); use one of them")
    if quant.method == "awq":
        padded = check_per_group(shape, quant.group_size, tp, "a checkpoint quantized with group size"
                                  if quant.modelopt else "quantization.group_size")
    if quant.method in ("int8_wo", "int4_wo") and TARGETS[target].engine_builder == TRTLLM_BUILD:
        m = 64 * tp
        for what, dim in (("hidden_size", shape.hidden_size), ("intermediate_size", shape.intermediate_size)):
            if dim % m:
                # The engine's per-channel weight-only layers expect padded dims
                # (tensorrt_llm/quantization/layers.py); whether the build pads unpadded fp
                # weights is unverified: refuse.
                raise ToolchainError(f"weight-only {quant.method} at tp {tp} needs {what} ({dim}) to be a multiple "
                                     f"of 64 x tp = {m}", "use another parallelism.tp or quantization.method")
    refused = path_refusal(quant, path or TARGETS[target].path)
    if refused is not None:  # the line names its fix
        raise ToolchainError(refused)
    _check_gpu(quant, gpu_name, gpu_sm)
    check_blocks(quant, shape, tp, splits)
    check_tiles(quant, shape, tp, splits)
    if quant.needs_calibration:
        if quant.calibration_samples < 1:
            raise ToolchainError("quantization.calibration.samples must be at least 1")
        if quant.calibration_seq_len > shape.max_position_embeddings:
            raise ToolchainError(f"quantization.calibration.seq_len {quant.calibration_seq_len} exceeds the "
                                 f"model's context ({shape.max_position_embeddings} positions)",
                                 f"set quantization.calibration.seq_len <= {shape.max_position_embeddings}")
        if quant.calibration_dataset != BUILTIN:
            check_calibration_file(quant.calibration_dataset)
    return LayoutPlan(padded_intermediate=padded)
