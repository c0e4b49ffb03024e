"""Pre-quantized Hugging Face checkpoints for the LLM-API (PyTorch backend) path, and back.

TensorRT-LLM's PyTorch backend loads the unified HF format of NVIDIA ModelOpt's
`export_hf_checkpoint` (facts from nvidia-modelopt 0.47.0, modelopt/torch/export/
unified_export_hf.py, quant_utils.py, convert_hf_config.py; layouts checked against
/work/shared/reference/layouts-hf):

- HF module names kept, nothing fused or sharded; unquantized tensors in the model dtype.
- FP8: `weight` e4m3 (out, in) = W / s, scalar float32 `weight_scale` s = amax(W) / 448 per
  module (the HF export does not unify q/k/v or gate/up scales; TensorRT-LLM's fused loader
  re-quantizes them to the max, tensorrt_llm/_torch/modules/linear.py FP8QDQLinearMethod),
  scalar float32 `input_scale` = amax(x) / 448.
- int4 AWQ: `weight` uint8 (out/2, in), byte [j, k] = row 2j low nibble | row 2j+1 high
  nibble, signed 4-bit two's complement, no zero point (`pack_int4_in_uint8`); float32
  `weight_scale` (out, in/g) = amax / 7; `pre_quant_scale` (in,) in the model dtype. Linears
  sharing a norm's output (q/k/v, gate/up) share one pre_quant_scale, which the exporter folds
  into that norm's weight and drops (`fuse_prequant_layernorm`); o_proj and down_proj keep theirs.
- Mixture of experts (FP8; ModelOpt 0.47 golden layouts in tests/data/layouts-hf-moe): every expert's
  projections under their HF names with their own scalar weight_scale, one input_scale per projection kind
  shared by the experts, the routers in the model dtype and named in exclude_modules (`_moe_fp8`).
- NVFP4: `weight` uint8 (out, in/2), two e2m1 values a byte, the even one in the low nibble;
  `weight_scale` float8_e4m3fn (out, in/16); scalar float32 `weight_scale_2` = amax(W) / (6 x 448)
  and `input_scale` = amax(x) / (6 x 448) (modelopt/torch/export/unified_export_hf.py
  `_export_quantized_weight`; the math is quant/fp4.py's). q/k/v and gate/up carry one
  `weight_scale_2` and one `input_scale`, the max over the parts, the block scales recomputed
  with that global scale (`preprocess_linear_fusion`), since TensorRT-LLM's NVFP4LinearMethod
  asserts they are equal (tensorrt_llm/_torch/modules/linear.py, load_weight_scales).
- FP8 block scales (ModelOpt's `fp8_pb_wo`, weights only): `weight` e4m3 (out, in) and float32
  `weight_scale` (ceil(out/128), ceil(in/128)) = tile amax / 448 (quant/fp8_block.py); nothing
  calibrated, the activations are scaled per 1x128 at run time.
- FP8 KV cache: scalar float32 `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`
  = amax / 448, not clamped (the clamp to >= 1 is the TensorRT-LLM-checkpoint exporter's).
- hf_quant_config.json {producer, quantization{quant_algo, kv_cache_quant_algo, [group_size,
  has_zero_point, pre_quant_scale], exclude_modules}}; config.json gains `quantization_config`
  {config_groups (FP8 and NVFP4), ignore, quant_algo, kv_cache_scheme (FP8 KV), producer,
  quant_method: "modelopt"}. FP8 block scales are written under ModelOpt's name, "fp8_pb_wo"
  (quant/view.py MODELOPT_NAMES), without a group_size, as ModelOpt writes them; TensorRT-LLM
  maps the name to FP8_BLOCK_SCALES and the missing group_size to 128 (QuantConfig
  _update_from_legacy_args, tensorrt_llm/models/modeling_utils.py @0c8de69).

The math is the engine path's (toolchain.quant: the AWQ search, FP8 scales, KV scales from
the same calibration statistics), so only the layout differs; `hf_quantized_to_engine_tensors`
maps such a directory back onto the engine checkpoint the CPU engine runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from toolchain import __version__
from toolchain.archs import load_params
from toolchain.archs.common import EXPERT_SHARDS, Match, NameTable, Shard, trt_name
from toolchain.checkpoint import stacked_fp8
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.errors import ToolchainError
from toolchain.quant import awq as awq_q
from toolchain.quant import formats
from toolchain.quant import fp4 as fp4_q
from toolchain.quant import fp8 as fp8_q
from toolchain.quant import fp8_block as fp8_block_q
from toolchain.quant.int_quant import pack_int4
from toolchain.quant.recipe import is_excluded, per_group_multiple
from toolchain.quant.view import MODELOPT_NAMES, Quantization, quantization_of, stored_format
from toolchain.checkpoint.config import build_config
from toolchain.targets import LLMAPI

PRODUCER = {"name": "trtllm-toolchain", "version": __version__}
ALWAYS_IGNORED = ["lm_head", "model.embed_tokens"]
ENGINE_EXCLUDED = ["lm_head", "transformer.vocab_embedding"]
# (calibration slot, HF linears sharing that input, the norm producing it or None)
GROUPS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
          ("dense", ("self_attn.o_proj",), None),
          ("mlp", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
          ("proj", ("mlp.down_proj",), None))
# The tensors beside a quantized weight: its scales (DeepSeek-style FP8 block checkpoints name theirs
# weight_scale_inv), AWQ's prequant vector and the FP8 KV-cache scales.
COMPANIONS = ("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale", "pre_quant_scale", "k_scale",
              "v_scale")
KV_ONLY_FORMAT = "kv_fp8"  # the export's `format` when only the KV cache is quantized
# formats.Format.hf_weight -> torch: a weight stored in one of these is a quantized one.
HF_WEIGHT = {"uint8": torch.uint8, "fp8": fp8_q.FP8_DTYPE}
# The engine checkpoint's suffix of each HF-format scale (ModelOpt's export names, modelopt/torch/quantization/
# utils/core_utils.py QuantizerAttrNames; model_config.py LinearConfig for the engine's).
HF_SCALES = {"weights_scaling_factor": "weight_scale", "weights_scaling_factor_2": "weight_scale_2",
             "activation_scaling_factor": "input_scale", "prequant_scaling_factor": "pre_quant_scale"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MAX_SHARD_BYTES = 10 * 10 ** 9  # the exporter's default max_shard_size "10GB"
HINT = ("for the LLM-API path use quantization.method awq or fp8 with kv_cache none or fp8; "
        "the engine path takes the others")


def hf_quant_problem(quantization) -> str | None:
    """Why the PyTorch backend cannot load this quantization (a view, or a spec `quantization` section)
    pre-quantized in the HF format, or None. Pure: reads the request only, so the planner can call it."""
    q = quantization_of(quantization)
    method, kv = q.method, q.kv_cache
    row = formats.METHODS.get(method)
    if row is not None and row.hf_why_not:  # the row says why it has no export
        return f"quantization.method {method} {row.hf_why_not}"
    if kv == "int8":
        return "quantization.kv_cache int8 has no Hugging Face export the PyTorch backend loads; use fp8 or none"
    if not q.active:
        return "quantization.method none and kv_cache none: nothing to pre-quantize; the backend loads the model as is"
    if (method != "none" and method not in formats.HF_EXPORTS) or kv not in ("fp8", "none"):
        return (f"quantization.method {method} / kv_cache {kv} is not exported to the Hugging Face format; "
                "use fp8 or awq")
    return None


# -- configs ----------------------------------------------------------------------------

def quant_configs(algo: str | None, kv: str | None, group: int, excluded: list[str]) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json `quantization_config`) as the exporter writes them."""
    row = formats.BY_ALGO[algo]
    q: dict = {"quant_algo": MODELOPT_NAMES.get(str(algo), algo), "kv_cache_quant_algo": kv}
    if row.per_group:
        q.update(group_size=group, has_zero_point=False, pre_quant_scale=True)
    elif algo == "NVFP4":  # process_layer_quant_config: {"quant_algo": "NVFP4", "group_size": block size}
        q["group_size"] = row.group_size
    if algo is not None:
        q["exclude_modules"] = sorted(ALWAYS_IGNORED + excluded)
    else:  # KV cache only: no quantized layer, so the per-layer table stays and no exclude list is summarised
        q["quantized_layers"] = {}
    hf_quant = {"producer": dict(PRODUCER), "quantization": q}
    qc: dict = {}
    if algo in ("FP8", "NVFP4"):  # convert_hf_quant_config_format's two config groups
        bits = {"dynamic": False, "num_bits": 8, "type": "float"} if algo == "FP8" else \
            {"dynamic": False, "num_bits": 4, "type": "float", "group_size": row.group_size}
        qc["config_groups"] = {"group_0": {"input_activations": dict(bits), "weights": dict(bits),
                                           "targets": ["Linear"]}}
    qc["ignore"] = q.get("exclude_modules", [])
    if algo:
        qc["quant_algo"] = q["quant_algo"]
    if kv == "FP8":
        qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    qc["producer"] = dict(PRODUCER)
    qc["quant_method"] = "modelopt"
    return hf_quant, qc


def _export_dtype(requested: str, params) -> torch.dtype:
    """fp16/bf16 only: the backend's quantized kernels take those activations. "auto" keeps a bf16
    model bf16 and turns fp32/fp16 into fp16, as the engine path's trtllm target does."""
    if requested == "auto":
        return torch.bfloat16 if params.dtype == "bfloat16" else torch.float16
    if requested in ("float16", "bfloat16"):
        return getattr(torch, requested)
    raise ToolchainError(f"dtype {requested} cannot be exported pre-quantized",
                         "use model.dtype auto, float16 or bfloat16")


# -- export -----------------------------------------------------------------------------

def _calibration(hf_dir: Path, quant: Quantization, calibration, tokenizer_dir, vocab: int):
    from toolchain.quant.calibration import calibration_tokens, collect_stats, hf_tokenizer

    seqs = calibration
    if seqs is None:
        tokenize = hf_tokenizer(Path(tokenizer_dir or hf_dir))
        seqs = calibration_tokens(tokenize, quant.calibration_dataset, quant.calibration_samples,
                                  quant.calibration_seq_len)
    if any(int(s.max()) >= vocab or int(s.min()) < 0 for s in seqs):
        raise ToolchainError(f"calibration tokens fall outside the model's vocabulary [0, {vocab})",
                             "set model.tokenizer to the model's own tokenizer")
    return collect_stats(hf_dir, seqs, covariance="cov" in quant.format.stats)


def _check_input_widths(params, unit: int, what_unit: str, why: str, fix: str) -> None:
    """Every linear's input width (hidden, attention, MLP) in whole `unit`s: one line naming the first that is not."""
    ins = {"hidden_size": params.hidden_size, "num_attention_heads x head_size":
           params.num_attention_heads * params.head_size, "intermediate_size": params.intermediate_size}
    for what, dim in ins.items():
        if dim % unit:
            raise ToolchainError(f"{why}: {what} ({dim}) is not a multiple of {what_unit}", fix)


def _check_groups(params, group: int) -> None:
    # The exporter rejects it too (_validate_int4_block_size): a partial group has no scale.
    _check_input_widths(params, group, f"quantization.group_size {group}", "awq",
                        "use quantization.group_size 64, or quantization.method fp8")


def _check_blocks(params, method: str, block: int) -> None:
    # NVFP4LinearMethod.create_weights asserts in_features % 16 == 0 (tensorrt_llm/_torch/modules/linear.py).
    _check_input_widths(params, block, f"its block of {block} input channels", method,
                        "use quantization.method fp8 for this model")


def _module_excluded(table: NameTable, prefix: str, patterns) -> bool:
    """Spec exclude_modules are globs of TensorRT-LLM module names (as on the engine path)."""
    m = table.match(prefix + ".weight")
    return m is not None and is_excluded(trt_name(m.row, m.layer).removesuffix(".weight"), patterns)


def _quantize_group(quant: Quantization, ws: list[torch.Tensor], st, dtype) -> list[dict[str, torch.Tensor]]:
    """HF tensors (leaf -> tensor) per linear of one shared-input group (`st`: its calibration statistics, None
    for a format that calibrates nothing); AWQ's shared prequant vector comes back as float32 under "_prequant"
    for the caller to fold or keep."""
    compute = HF_COMPUTED.get(quant.format.quantizer)
    if compute is None:  # hf_quant_problem refuses the rows without an export first
        quant.format.check_implemented(LLMAPI)
        raise ValueError(f"the Hugging Face export has no quantizer for quantization.method {quant.method}")
    return compute(quant, ws, st)


def _fp8(quant: Quantization, ws: list[torch.Tensor], st) -> list[dict[str, torch.Tensor]]:
    a_scale = fp8_q.fp8_scale(st.amax.max()).reshape(())
    out = []
    for w in ws:
        q, s = fp8_q.quantize_fp8_weight(w)
        out.append({"weight": q, "weight_scale": s.reshape(()), "input_scale": a_scale.clone()})
    return out


def _nvfp4(quant: Quantization, ws: list[torch.Tensor], st) -> list[dict[str, torch.Tensor]]:
    parts, weight_scale_2, input_scale = fp4_q.quantize_nvfp4_fused(ws, st.amax)
    return [{"weight": packed, "weight_scale": block, "weight_scale_2": weight_scale_2.clone(),
             "input_scale": input_scale.clone()} for packed, block in parts]


def _fp8_block(quant: Quantization, ws: list[torch.Tensor], st) -> list[dict[str, torch.Tensor]]:
    # Each part keeps its own tiles: the fused loaders concatenate the grids (FP8BlockScalesLinearMethod).
    return [dict(zip(("weight", "weight_scale"), fp8_block_q.quantize_fp8_block(w), strict=True)) for w in ws]


def _awq(quant: Quantization, ws: list[torch.Tensor], st) -> list[dict[str, torch.Tensor]]:
    lins, _ = awq_q.quantize_awq(ws, st.absmean, st.cov, quant.group_size, search=quant.search,
                                 clip=quant.search, rounding=quant.rounding if quant.search else "nearest")
    # The project packs into int8 (the engine checkpoint's dtype); the HF format stores the same bytes as uint8.
    return [{"weight": pack_int4(lin.weight).view(torch.uint8), "weight_scale": lin.weights_scaling_factor.float(),
             "_prequant": lin.prequant_scaling_factor.float()} for lin in lins]


# A row's `quantizer` (quant/formats.py) -> what computes its HF-format tensors. The export needs no quantizer of the
# engine path's (checkpoint/quantize.py COMPUTED): its own pending list is formats.PENDING_HF_EXPORTS, which
# tests/test_quant_formats.py holds to this table.
HF_COMPUTED = {"fp8": _fp8, "awq": _awq, "nvfp4": _nvfp4, "fp8_block": _fp8_block}


def export_hf_quantized(hf_dir: Path | str, out_dir: Path | str, quantization, dtype: str = "auto", *,
                        calibration: list[torch.Tensor] | None = None,
                        tokenizer_dir: Path | str | None = None) -> dict:
    """Write a pre-quantized HF checkpoint of `hf_dir` into `out_dir` (existing; the caller makes
    it temporary): config.json, hf_quant_config.json, model.safetensors (shards past 10 GB),
    generation and tokenizer files. `calibration` gives token sequences instead of the section's
    dataset. Returns {format, quant_algo, kv_cache_quant_algo, tensors, bytes, files}."""
    quant = quantization_of(quantization)
    problem = hf_quant_problem(quant)
    if problem is not None:
        raise ToolchainError(problem, HINT)
    quant.format.check_implemented(LLMAPI)  # before calibrating: _quantize_group would refuse it after
    hf_dir, out = Path(hf_dir), Path(out_dir)
    with HFCheckpoint(hf_dir) as ckpt:
        family, params = load_params(ckpt.config, str(ckpt.config_path))
        refusal = family.quantization_refusal(params, quant.method, quant.kv_cache)
        if refusal is not None:
            raise ToolchainError(refusal.why, refusal.hint)
        if params.is_moe and quant.method not in ("none", "fp8"):
            raise ToolchainError(f"the Hugging Face-format quantized export (quantization {quant.method}) of "
                                 f"{params.architecture} is not supported yet", "use quantization.method fp8")
        if family.llmapi_refusal is not None and (why := family.llmapi_refusal(params, 1, True)) is not None:
            raise ToolchainError(why)
        table = NameTable(family, params)
        unmatched = [n for n in ckpt.names() if table.match(n) is None]
        if unmatched:
            raise table.unmatched_error(unmatched, str(hf_dir))
        if any(i.dtype not in (torch.float32, torch.float16, torch.bfloat16) for i in ckpt.tensors.values()):
            raise ToolchainError(f"{hf_dir} is already quantized", "export from the unquantized model")
        target = _export_dtype(dtype, params)
        if quant.format.per_group:
            _check_groups(params, quant.group_size)
        elif quant.format.group_size is not None:
            _check_blocks(params, quant.method, quant.format.group_size)
        stats = _calibration(hf_dir, quant, calibration, tokenizer_dir, params.vocab_size) \
            if quant.needs_calibration else None
        tensors, excluded = _quantized_tensors(ckpt, table, params, quant, stats, target)
    row = formats.HF_EXPORTS.get(quant.method)
    algo, kv = (row.quant_algo if row else None), formats.KV_CACHE[quant.kv_cache].quant_algo
    hf_quant, qc = quant_configs(algo, kv, quant.group_size, excluded)
    files = _write_safetensors(tensors, out)
    config = dict(ckpt.config)
    for key in ("dtype", "torch_dtype"):
        if key in config or key == "torch_dtype" and "dtype" not in config:
            config[key] = str(target).removeprefix("torch.")
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
    files += ["config.json", "hf_quant_config.json"] + _copy_side_files(hf_dir, out, config)
    return {"format": row.hf_name if row else KV_ONLY_FORMAT, "quant_algo": algo, "kv_cache_quant_algo": kv, "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "files": sorted(files)}


def _quantized_tensors(ckpt: HFCheckpoint, table: NameTable, params, quant: Quantization, stats,
                       dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[str]]:
    """name -> tensor of the whole export, and the HF linears kept unquantized by exclude_modules."""
    out: dict[str, torch.Tensor] = {}
    stacked = [r for r in table.rows if stacked_fp8.is_stacked(r)]  # Llama 4: checkpoint/stacked_fp8.py
    for name in ckpt.names():
        if _match(table, name, str(ckpt.directory)).row.shard is not Shard.DROP or stacked:  # stacked: the vision tower
            out[name] = ckpt.load(name).to(dtype)
    prefix = stacked_fp8.text_prefix(stacked)
    excluded: list[str] = stacked_fp8.kept(prefix)
    for layer in range(params.num_hidden_layers):
        base = f"{prefix}model.layers.{layer}"
        if quant.kv_cache == "fp8":
            # One amax over the q/k/v outputs (the project's calibration) for both k and v: never
            # below the exporter's separate k and v amaxes, so the cache cannot overflow.
            assert stats is not None  # an FP8 KV cache is calibrated (Quantization.needs_calibration)
            scale = torch.tensor(stats[layer].qkv_amax / fp8_q.FP8_MAX, dtype=torch.float32)
            out[f"{base}.self_attn.k_proj.k_scale"], out[f"{base}.self_attn.v_proj.v_scale"] = scale, scale.clone()
        if quant.method == "none":
            continue
        groups = GROUPS[:2] + stacked_fp8.FEED_FORWARD_GROUPS["moe" if layer in params.moe_layers else "dense"] \
            if stacked else GROUPS
        if stacked and layer in params.moe_layers:
            stacked_fp8.export_layer(out, stacked, layer, stats[layer])
            excluded.append(f"{base}.feed_forward.router")
        elif params.is_moe and not stacked:
            excluded += _moe_fp8(out, table, params, layer, stats[layer])
        for slot, members, norm in groups:
            if params.is_moe and not stacked and slot in ("mlp", "proj"):
                continue  # the experts, above
            prefixes = [f"{base}.{m}" for m in members]
            skip = [_module_excluded(table, p, quant.exclude_modules) for p in prefixes]
            if all(skip):
                excluded += prefixes
                continue
            if any(skip):
                # The backend fuses these into one GEMM with one format: a partial exclusion cannot load.
                raise ToolchainError(f"quantization.exclude_modules keeps only part of {', '.join(prefixes)} "
                                     "unquantized", "exclude all linears sharing one input, or none of them")
            ws = [ckpt.load(p + ".weight").float() for p in prefixes]
            st = stats[layer].inputs[slot] if stats is not None else None
            for p, parts in zip(prefixes, _quantize_group(quant, ws, st, dtype), strict=False):
                prequant = parts.pop("_prequant", None)
                if prequant is not None and norm is None:
                    parts["pre_quant_scale"] = prequant.to(dtype)
                out.update({f"{p}.{leaf}": t for leaf, t in parts.items()})
            if quant.format.per_group and norm is not None:
                # norm(x)·g·p = norm(x)·(g·p): folding the shared vector p into the norm's gain g is exact
                # up to the model-dtype rounding of g·p, and the backend's fused qkv / gate_up loaders
                # read no pre_quant_scale (linear.py, the int4 AWQ LinearMethod).
                assert prequant is not None  # _quantize_group gives every AWQ linear the group's vector
                g = ckpt.load(f"{base}.{norm}.weight").float()
                out[f"{base}.{norm}.weight"] = (g * prequant).to(dtype)
    return out, excluded


def _moe_fp8(out: dict[str, torch.Tensor], table: NameTable, params, layer: int, stats) -> list[str]:
    """One MoE layer's experts in FP8 as ModelOpt 0.47 exports them (tests/data/layouts-hf-moe, made by
    tools/modelopt_moe_layouts.py): each expert's projections under their own HF names, each with its own scalar
    weight_scale, and one input_scale per projection kind for every expert, since ModelOpt's fused-experts
    wrapper shares one input quantizer across the experts (modelopt/torch/quantization/plugins/huggingface.py,
    _QuantFusedExperts); its amax here is over every token run through every expert (quant/calibration.py, as
    ModelOpt's moe_calib_experts_ratio 1.0 does; its default, None, calibrates on the routed tokens only).
    Returns the router, kept in the model dtype and named in exclude_modules."""
    rows = [r for r in table.rows if r.shard in EXPERT_SHARDS]
    fc_input = fp8_q.fp8_scale(stats.inputs["mlp"].amax.max()).reshape(())
    proj_input = fp8_q.fp8_scale(max(stats.expert_proj_amax)).reshape(())
    for row in rows:
        for e in range(params.num_experts):
            prefix = row.hf.replace("{layer}", str(layer)).replace("{expert}", str(e)).removesuffix(".weight")
            w, scale = fp8_q.quantize_fp8_weight(out[f"{prefix}.weight"].float())
            out[f"{prefix}.weight"], out[f"{prefix}.weight_scale"] = w, scale.reshape(())
            out[f"{prefix}.input_scale"] = (fc_input if row.shard is Shard.EXPERT_FC else proj_input).clone()
    router = [r for r in table.rows if r.trt is not None and r.trt.endswith("mlp.router.weight")]
    return [r.hf.replace("{layer}", str(layer)).removesuffix(".weight") for r in router]


def _match(table: NameTable, name: str, where: str) -> Match:
    m = table.match(name)
    if m is None:
        raise table.unmatched_error([name], where)
    return m


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path) -> list[str]:
    """model.safetensors, or transformers-style shards and index past MAX_SHARD_BYTES."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name], size = t, size + n
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=False):
        save_file(shard, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]


def _copy_side_files(hf_dir: Path, out: Path, config: dict) -> list[str]:
    """Tokenizer files as they are; generation_config.json copied, or derived from the config as
    transformers' save_pretrained would write it (the exporter's file list always has one)."""
    copied = []
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out / name)
            copied.append(name)
    if "generation_config.json" not in copied:
        gen = {"_from_model_config": True, **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                              if config.get(k) is not None}}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        copied.append("generation_config.json")
    return copied


# -- reading it back --------------------------------------------------------------------

def read_stored_format(directory: Path | str, config: dict | None = None) -> dict | None:
    """quant/view.py `stored_format` of a checkpoint directory (its config.json, or `config` when the caller
    has read it, and its hf_quant_config.json where it has one): None unless convert imports it as stored."""
    directory = Path(directory)
    path = directory / "hf_quant_config.json"
    hf_quant = json.loads(path.read_text()) if path.is_file() else None
    if config is None:
        config = json.loads((directory / "config.json").read_text())
    return stored_format(config, hf_quant, str(directory))


def read_hf_quant_format(directory: Path | str) -> dict:
    """{quant_algo, kv_cache_quant_algo, group_size, exclude_modules} of an exported directory:
    hf_quant_config.json, else config.json's ModelOpt `quantization_config`, or a DeepSeek-style FP8
    block-scale config.json (quant/view.py stored_format, which refuses what cannot be imported)."""
    directory = Path(directory)
    fmt = read_stored_format(directory)
    if fmt is None:
        raise ToolchainError(f"{directory} holds no ModelOpt-format quantization config",
                             "export it with toolchain.checkpoint.hf_quant.export_hf_quantized")
    return fmt


def stored_scale(has, prefix: str) -> str:
    """The name of an FP8 block-scale linear's scale grid: `weight_scale_inv` in a DeepSeek-style checkpoint,
    `weight_scale` in ModelOpt's (FP8BlockScalesLinearMethod._get_scale_name reads them in that order)."""
    return prefix + ".weight_scale_inv" if has(prefix + ".weight_scale_inv") else prefix + ".weight_scale"


def stored_linear(load, has, prefix: str, algo: str) -> dict[str, torch.Tensor]:
    """One quantized HF linear's stored tensors under the engine checkpoint's suffixes, in the forms
    the CPU engine runs (toolchain/engine/cpu/qlinear.py): FP8 `weight` e4m3 (out, in),
    `weights_scaling_factor` / `activation_scaling_factor` (1,); AWQ `weight` int8 (out/2, in)
    (the same bytes), `weights_scaling_factor` float32 (out, in/g) and `prequant_scaling_factor`
    (in,) when the module kept one (else it was folded into the norm); NVFP4 `weight` uint8 (out, in/2),
    `weights_scaling_factor` e4m3 (out, in/16), `weights_scaling_factor_2` / `activation_scaling_factor`
    (1,); FP8 block scales `weight` e4m3 (out, in) and `weights_scaling_factor` float32
    (ceil(out/128), ceil(in/128)). `load(name)` reads a tensor, `has(name)` says whether it is stored."""
    row = formats.BY_ALGO[algo]
    if row.per_group:
        t = {"weight": load(prefix + ".weight").view(torch.int8),
             "weights_scaling_factor": load(prefix + ".weight_scale").float()}
        if has(prefix + ".pre_quant_scale"):
            t["prequant_scaling_factor"] = load(prefix + ".pre_quant_scale")
        return t
    if row.quantizer == "fp8_block":
        grid = load(stored_scale(has, prefix)).float()
        # ModelOpt's fp8_pb_wo may store it (rows, 1, cols, 1) (FP8BlockScalesLinearMethod squeezes those).
        return {"weight": load(prefix + ".weight"),
                "weights_scaling_factor": grid.squeeze(1).squeeze(-1) if grid.dim() == 4 else grid}
    out = {"weight": load(prefix + ".weight")}
    for tensor in row.stored[1:]:  # FP8, NVFP4: the row's scales under their HF names
        scale = load(f"{prefix}.{HF_SCALES[tensor.suffix]}")
        out[tensor.suffix] = scale.float().reshape(1) if tensor.layout == "scalar" else scale  # 0-dim scalars as (1,)
    return out


def read_hf_quantized(directory: Path | str) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Per quantized HF linear (`model.layers.N.self_attn.q_proj`, ...): its stored tensors as
    `stored_linear` gives them."""
    algo = read_hf_quant_format(directory)["quant_algo"]
    with HFCheckpoint(directory) as ckpt:
        for name, info in ckpt.tensors.items():
            prefix, _, leaf = name.rpartition(".")
            if leaf != "weight" or info.dtype not in HF_WEIGHT.values():
                continue
            yield prefix, stored_linear(ckpt.load, ckpt.has, prefix, algo)


def engine_kv_scale(k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The engine checkpoint's one FP8 KV-cache scale per layer from the HF format's k and v scales:
    their max (one cache scale covers both), clamped to >= 1 as the engine path writes it."""
    return torch.maximum(torch.maximum(k_scale, v_scale), torch.tensor(1.0)).float().reshape(1)


def fuse_group(parts: list[dict[str, torch.Tensor]], algo: str, in_f: int, dtype: torch.dtype) -> list[dict]:
    """One shared-input group's linears as the engine stores them: FP8 weights re-quantized to the
    group's largest weight scale (the fused FP8Linear has one; TensorRT-LLM's PyTorch loader does the
    same, and a part already at that scale keeps its bytes) and one activation scale; AWQ gets one
    prequant vector, ones where the exporter folded it into the norm; NVFP4 parts must already share
    their global weight and input scales (NVFP4LinearMethod.load_weight_scales asserts it); FP8 block
    scales keep each part's own tiles."""
    quantizer = formats.BY_ALGO[algo].quantizer
    if quantizer == "fp8_block":
        return parts
    if quantizer == "nvfp4":
        for suffix, leaf in (("weights_scaling_factor_2", "weight_scale_2"), ("activation_scaling_factor", "input_scale")):
            if any(not torch.equal(p[suffix], parts[0][suffix]) for p in parts):
                raise ToolchainError(f"NVFP4 linears sharing one input carry different {leaf} values",
                                     "TensorRT-LLM's NVFP4 loader asserts they are equal; re-export the checkpoint")
        return parts
    if not formats.BY_ALGO[algo].per_group:  # FP8: per-tensor scales
        s = torch.stack([p["weights_scaling_factor"] for p in parts]).max().reshape(1)
        a = torch.stack([p["activation_scaling_factor"] for p in parts]).max().reshape(1)
        return [{"weight": p["weight"] if torch.equal(p["weights_scaling_factor"], s)
                 else fp8_q.to_fp8(fp8_q.from_fp8(p["weight"], p["weights_scaling_factor"]), s),
                 "weights_scaling_factor": s.clone(), "activation_scaling_factor": a.clone()} for p in parts]
    pre = [p.get("prequant_scaling_factor") for p in parts]
    given = [v for v in pre if v is not None]
    if given and (len(given) < len(pre) or any(not torch.equal(v, given[0]) for v in given)):
        raise ToolchainError("linears sharing one input carry different pre_quant_scale vectors",
                             "the engine's fused GEMM takes one; re-export the checkpoint")
    shared = given[0].to(dtype) if given else torch.ones(in_f, dtype=dtype)
    return [{"weight": p["weight"], "weights_scaling_factor": p["weights_scaling_factor"],
             "prequant_scaling_factor": shared.clone()} for p in parts]  # own storage: saved separately


def _pad_mlp(t: dict[str, torch.Tensor], rows: bool, extra: int, group: int) -> dict[str, torch.Tensor]:
    """Per-group int4 MLP widened by `extra` channels the way the engine path pads it (zero weights,
    unit scales and prequant; TensorRT-LLM WeightOnlyGroupwiseQuantLinear)."""
    w, s = t["weight"], t["weights_scaling_factor"]
    if rows:  # fc / gate: more output rows
        t["weight"] = torch.cat([w, w.new_zeros(extra // 2, w.shape[1])])
        t["weights_scaling_factor"] = torch.cat([s, s.new_ones(extra, s.shape[1])])
    else:     # proj: more input columns
        t["weight"] = torch.cat([w, w.new_zeros(w.shape[0], extra)], dim=1)
        t["weights_scaling_factor"] = torch.cat([s, s.new_ones(s.shape[0], extra // group)], dim=1)
        p = t["prequant_scaling_factor"]
        t["prequant_scaling_factor"] = torch.cat([p, p.new_ones(extra)])
    return t


def hf_quantized_to_engine_tensors(directory: Path | str) -> tuple[dict[str, torch.Tensor], dict]:
    """An exported HF-format checkpoint as one full (tp 1, pp 1) engine checkpoint: (name -> tensor,
    config.json with its `quantization`), the layout `toolchain.checkpoint.convert` writes for the
    same model and method, so the sharding rules can split it and the CPU engine can run it."""

    directory = Path(directory)
    fmt = read_hf_quant_format(directory)
    algo = fmt["quant_algo"]
    row = formats.BY_ALGO[algo]
    per_group = row.per_group
    # Tensors with a row per output channel: the fused q/k/v module stacks them (the others are shared).
    by_rows = {t.suffix for t in row.stored if t.layout in formats.ROW_LAYOUTS}
    quantized = dict(read_hf_quantized(directory))
    with HFCheckpoint(directory) as ckpt:
        family, params = load_params(ckpt.config, str(ckpt.config_path))
        table = NameTable(family, params)
        dtype = getattr(torch, params.dtype or "float16")
        out: dict[str, torch.Tensor] = {}
        qkv_parts: dict[str, dict[str, torch.Tensor]] = {}
        for name in ckpt.names():
            prefix, _, leaf = name.rpartition(".")
            if (prefix in quantized and leaf == "weight") or leaf in COMPANIONS:  # biases go through the table
                continue
            m = _match(table, name, str(directory))
            if m.row.shard is Shard.DROP:
                continue
            if m.row.shard is Shard.QKV:
                assert m.row.part is not None  # Family checks that every QKV row names its part
                qkv_parts.setdefault(trt_name(m.row, m.layer), {})[m.row.part] = ckpt.load(name)
            else:
                out[trt_name(m.row, m.layer)] = ckpt.load(name)
        if "lm_head.weight" not in out:  # tied: the engine checkpoint always writes lm_head
            out["lm_head.weight"] = out["transformer.vocab_embedding.weight"].clone()
        excluded = list(ENGINE_EXCLUDED)
        group = fmt["group_size"]
        if per_group and group is None:  # config.json alone does not say: the shapes do
            w = next(iter(quantized.values()))
            group = w["weight"].shape[1] // w["weights_scaling_factor"].shape[1]
        multiple = per_group_multiple(group or 128, 1)
        padded = -(-params.intermediate_size // multiple) * multiple
        for layer in range(params.num_hidden_layers):
            base = f"model.layers.{layer}"
            if fmt["kv_cache_quant_algo"] == "FP8":
                k, v = (ckpt.load(f"{base}.self_attn.{n}") for n in ("k_proj.k_scale", "v_proj.v_scale"))
                out[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"] = engine_kv_scale(k, v)
            for _slot, members, _norm in GROUPS:
                prefixes = [f"{base}.{mm}" for mm in members]
                matches = [_match(table, p + ".weight", str(directory)) for p in prefixes]
                trt = [trt_name(mt.row, mt.layer).removesuffix(".weight") for mt in matches]
                if not any(p in quantized for p in prefixes):  # kept fp: its tensors went through the table above
                    excluded += sorted(set(trt))
                    continue
                if not all(p in quantized for p in prefixes):
                    raise ToolchainError(f"{directory}: only part of {', '.join(prefixes)} is quantized",
                                         "the engine fuses them into one GEMM; re-export the checkpoint")
                in_f = ckpt.info(prefixes[0] + ".weight").shape[1]
                fused = fuse_group([quantized[p] for p in prefixes], algo, in_f, dtype)
                if per_group and padded != params.intermediate_size and members[0].startswith("mlp."):
                    fused = [_pad_mlp(f, mm != "mlp.down_proj", padded - params.intermediate_size, group)
                             for f, mm in zip(fused, members, strict=False)]
                if matches[0].row.shard is Shard.QKV:  # q, k, v rows stacked into one module
                    out.update({f"{trt[0]}.{s}": torch.cat([f[s] for f in fused]) if s in by_rows else fused[0][s]
                                for s in fused[0]})
                else:
                    out.update({f"{t}.{s}": v for t, f in zip(trt, fused, strict=False) for s, v in f.items()})
        for name, parts in qkv_parts.items():
            out[name] = torch.cat([parts[p] for p in ("q", "k", "v")])
    config = build_config(family, params, dtype=str(dtype).removeprefix("torch."), tp=1, pp=1)
    q: dict = {"quant_algo": algo, "kv_cache_quant_algo": fmt["kv_cache_quant_algo"]}
    if algo is not None:
        q["exclude_modules"] = excluded
    if per_group:
        q.update(group_size=group, has_zero_point=False, pre_quant_scale=True)
    elif row.group_size is not None:  # a block the format fixes, as the engine path writes it (Quantizer.config)
        q["group_size"] = row.group_size
    config["quantization"] = q
    return out, config
