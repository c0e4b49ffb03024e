"""Stored-quantized source checkpoints shown to the planner as the fp models they encode.

An AutoAWQ/GPTQ checkpoint (`virtualize_prequantized`), and a ModelOpt Hugging Face-format export or a
DeepSeek-style FP8 block-scale checkpoint (`virtualize_modelopt`; toolchain/checkpoint/hf_quant.py writes
and reads that format), hold packed or e4m3 weights the name tables cannot match as they are: each
quantized linear is presented as one virtual fp `weight` of the (out, in) shape it encodes, from the
safetensors headers alone, and the stored tensors behind it are handed to the quantizer (checkpoint/quantize.py), which reads them
instead of computing them. `stored_group_size` reads a ModelOpt int4 export's group size off its
shapes when its config does not give it.
"""

from __future__ import annotations

import fnmatch

import torch

from toolchain.archs.common import NameTable, Shard, trt_name
from toolchain.checkpoint import stacked_fp8
from toolchain.checkpoint.hf_quant import COMPANIONS, HF_SCALES, HF_WEIGHT, stored_scale
from toolchain.checkpoint.hf_reader import HFCheckpoint, TensorInfo
from toolchain.checkpoint.quantize import LINEARS, linear_of
from toolchain.errors import ToolchainError
from toolchain.quant import formats


def stored_group_size(ckpt: HFCheckpoint) -> int | None:
    """The group size of a ModelOpt per-group int4 export from its stored shapes, where config.json alone
    does not say: the (out/2, in) uint8 weight and its (out, in/g) scales. None when no such pair is stored."""
    w = next((i for i in ckpt.tensors.values() if i.dtype == torch.uint8), None)
    s = ckpt.tensors.get(w.name.removesuffix("weight") + "weight_scale") if w is not None else None
    if w is not None and s is not None and len(s.shape) == 2 and s.shape[1]:
        return w.shape[1] // s.shape[1]
    return None


def virtualize_prequantized(ckpt: HFCheckpoint, kind: str) -> dict[str, TensorInfo]:
    """Present an AutoAWQ/GPTQ checkpoint to the planner as the fp model it encodes:
    each linear's packed qweight/qzeros/scales/g_idx become one virtual `weight`
    (out, in) the name tables match. Returns the hidden packed tensors."""
    raw = dict(ckpt.tensors)
    packed = {n[: -len(".qweight")] for n in raw if n.endswith(".qweight")}
    virtual: dict[str, TensorInfo] = {}
    for name, info in raw.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in packed and leaf in ("qzeros", "scales", "g_idx"):
            continue
        if prefix in packed and leaf == "qweight":
            rows, cols = info.shape
            shape = (cols * 8, rows) if kind == "awq" else (cols, rows * 8)
            virtual[prefix + ".weight"] = TensorInfo(prefix + ".weight", info.file, shape, torch.float16, -1)
        else:
            virtual[name] = info
    ckpt._tensors = virtual
    return raw


def virtualize_modelopt(ckpt: HFCheckpoint, table: NameTable, fmt: dict, dtype: torch.dtype, *,
                        config_only: bool = False
                        ) -> tuple[dict[str, TensorInfo], list[str], dict[int, tuple[str, str]]]:
    """Present a ModelOpt HF-format checkpoint (`fmt`: hf_quant.read_hf_quant_format) to the planner
    as the fp model it encodes: each stored-quantized linear's `weight` becomes a virtual (out, in)
    `weight` in `dtype` the name tables match; its scales and the KV-cache scales are hidden.
    Returns (every stored tensor, the TensorRT-LLM linear modules kept unquantized, global layer ->
    (k_scale, v_scale) names). From headers only; `config_only` (no weights yet, dry runs) takes the
    quantized linears from the format's exclude_modules instead."""
    algo, where = fmt["quant_algo"], ckpt.directory
    hf_weight = formats.BY_ALGO[algo].hf_weight
    storage = HF_WEIGHT[hf_weight] if hf_weight else None
    raw = dict(ckpt.tensors)
    virtual: dict[str, TensorInfo] = {}
    # (global layer, input slot) -> {HF linear prefix: stored quantized}; modules sharing an input
    # must agree (one fused GEMM, or one norm the AWQ prequant vector was folded into).
    groups: dict[tuple[int, str], dict[str, bool]] = {}
    modules: dict[tuple[int, str], str] = {}
    hidden = stacked_fp8.hidden_scales(raw)
    for name, info in raw.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in COMPANIONS or name in hidden:
            continue
        m = table.match(name)
        if m is not None and stacked_fp8.is_stacked(m.row):  # Llama 4's experts, one tensor a layer
            lin = linear_of(trt_name(m.row, m.layer))
            assert lin is not None  # the stacked rows are mlp.fc / mlp.proj
            quantized = algo is not None if config_only else info.dtype in HF_WEIGHT.values()
            groups.setdefault((lin[2], LINEARS[lin[1]]), {})[name] = quantized
            modules[(lin[2], lin[1])] = lin[0]
            if quantized and not config_only:
                stacked_fp8.check_stored(raw, name, algo, where)
                info = TensorInfo(name, info.file, info.shape, dtype, -1)
            virtual[name] = info
            continue
        if m is not None and m.row.shard is Shard.DROP:
            # dropped unread, stored quantized or not: DeepSeek-V3's multi-token-prediction layer (Family.ignore)
            virtual[name] = info
            continue
        lin = linear_of(trt_name(m.row, m.layer)) if m is not None and m.row.trt is not None else None
        quantized = info.dtype in HF_WEIGHT.values()
        if quantized and (lin is None or leaf != "weight"):
            raise ToolchainError(f"{where}: {name} is stored quantized ({info.dtype}) but the engine keeps it "
                                 "unquantized", "re-export the checkpoint with that module in exclude_modules")
        if m is not None and lin is not None and leaf == "weight":  # (lin implies m)
            if config_only:
                quantized = algo is not None and not any(fnmatch.fnmatchcase(prefix, p)
                                                         for p in fmt["exclude_modules"])
            elif quantized and info.dtype != storage:
                raise ToolchainError(f"{where}: {name} is stored as {info.dtype}, which is not quant_algo {algo}",
                                     "the weights and hf_quant_config.json come from different exports")
            layer = lin[2]  # the global layer: trt_name was given m.layer
            groups.setdefault((layer, LINEARS[lin[1]]), {})[prefix] = quantized
            modules[(layer, lin[1])] = lin[0]
            if quantized and not config_only:
                if m.row.transform is not None:
                    raise ToolchainError(f"{where}: {name} is stored quantized but its rows need the "
                                         f"{m.row.transform} transform", "convert the unquantized model instead")
                info = _virtual_weight(raw, name, info, algo, fmt, dtype, where)
        virtual[name] = info
    excluded: set[tuple[int, str]] = set()
    for (layer, slot), members in groups.items():
        if len(set(members.values())) > 1:
            raise ToolchainError(f"{where}: only part of {', '.join(sorted(members))} is stored quantized",
                                 "linears sharing one input must all be quantized or none; re-export the checkpoint")
        if not any(members.values()):
            excluded.add((layer, slot))
    names = [modules[key] for key in sorted(modules, key=lambda k: (k[0], list(LINEARS).index(k[1])))
             if (key[0], LINEARS[key[1]]) in excluded]
    kv: dict[int, tuple[str, str]] = {}
    if fmt["kv_cache_quant_algo"] == "FP8":
        # The exporter names them after the k and v projections: <k_proj>.k_scale, <v_proj>.v_scale.
        rows = {r.part: r for r in table.rows if r.shard is Shard.QKV and r.hf.endswith(".weight")}
        for layer in range(table.params.num_hidden_layers):
            k_scale, v_scale = (rows[part].hf.replace("{layer}", str(layer)).removesuffix("weight") + f"{part}_scale"
                                for part in ("k", "v"))
            pair = (k_scale, v_scale)
            for name in pair:
                if name not in raw and not config_only:
                    raise ToolchainError(f"{where}: declares an FP8 KV cache but has no {name}",
                                         "re-export the checkpoint with its KV-cache scales")
            kv[layer] = pair
    ckpt._tensors = virtual
    return raw, names, kv


def _virtual_weight(raw: dict[str, TensorInfo], name: str, info: TensorInfo, algo: str, fmt: dict,
                    dtype: torch.dtype, where) -> TensorInfo:
    """The fp (out, in) weight a stored FP8 / packed int4 / NVFP4 / FP8 block-scale one encodes, after checking
    its scales are there with the shapes the format gives them (so a broken export fails before any read)."""
    prefix = name.removesuffix(".weight")
    row = formats.BY_ALGO[algo]
    # The row's stored weight packs two int4 rows (AWQ: "out/2") or two e2m1 columns (NVFP4: "in/2") a byte.
    packed = row.stored[0].dims(2, 2, 1)
    out, cols = (n * 2 // k for n, k in zip(info.shape, packed, strict=True))
    wanted: dict[str, tuple[int, ...]] = {}  # HF leaf -> shape
    if row.per_group:
        g = fmt["group_size"]
        if not g or cols % g:
            raise ToolchainError(f"{where}: {name} has {cols} input channels, not whole groups of {g}",
                                 "the weights and hf_quant_config.json come from different exports")
        wanted = {"weight_scale": (out, cols // g)}
    else:  # every scale the row stores (FP8's and NVFP4's scalars stored 0-dim)
        for t in row.stored[1:]:
            dims = t.dims(out, cols, row.group_size or 1)
            wanted[HF_SCALES[t.suffix]] = () if t.layout == "scalar" else dims
    if row.quantizer == "fp8_block":  # DeepSeek names its grid weight_scale_inv
        leaf = stored_scale(raw.__contains__, prefix).rpartition(".")[2]
        wanted = {leaf: wanted.pop("weight_scale")}
    for leaf, shape in wanted.items():
        got = raw.get(f"{prefix}.{leaf}")
        if got is None:
            raise ToolchainError(f"{where}: {prefix} is stored quantized but has no {leaf}",
                                 "the checkpoint is incomplete; re-export it")
        have = tuple(got.shape)
        if len(have) == 4 and have[1] == have[3] == 1:  # ModelOpt's fp8_pb_wo grid (rows, 1, cols, 1)
            have = (have[0], have[2])
        if have != shape and not (shape == () and have == (1,)):  # scalars: () or (1,)
            raise ToolchainError(f"{where}: {prefix}.{leaf} has shape {list(got.shape)}, the format gives "
                                 f"{list(shape)}", "the checkpoint is not a ModelOpt export this converter reads")
    return TensorInfo(name, info.file, (out, cols), dtype, -1)
