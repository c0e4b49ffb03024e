"""HF checkpoint directory -> TensorRT-LLM 1.2 checkpoint directory.

Order matters for error quality: config.json is normalised and the
parallelism checked (sharding.check_parallelism) before any safetensors file is opened, names are
matched and every rank planned from headers before any weight is read, and
only then is data read and written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch

from toolchain.archs import load_params, moe
from toolchain.archs.common import NameTable
from toolchain.archs.layout import Layout, splits_tp
from toolchain.archs.params import ArchParams, engine_dtype
from toolchain.checkpoint import sharding
from toolchain.checkpoint.config import build_config
from toolchain.checkpoint.config_only import ConfigOnlyCheckpoint
from toolchain.weights_source import has_weights
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.checkpoint.layout import TORCH_DTYPES, Options, Plan, build_plan
from toolchain.checkpoint.hf_quant import read_stored_format
from toolchain.checkpoint.mtp import attach_mtp
from toolchain.checkpoint.quantize import Quantizer
from toolchain.checkpoint.stored import stored_group_size, virtualize_modelopt, virtualize_prequantized
from toolchain.checkpoint.writer import write_plan
from toolchain.errors import ToolchainError
from toolchain.quant import exclude
from toolchain.quant.recipe import ModelShape, check_recipe, is_excluded
from toolchain.quant.view import Quantization, quantization_of
from toolchain.targets import ENGINE, LLMAPI, engine_row

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")


def resolve_dtype(requested: str, params: ArchParams, ckpt: HFCheckpoint, target: str) -> str:
    """The checkpoint dtype, by the one rule the planner uses too (archs.params.engine_dtype)."""
    if requested not in DTYPE_CHOICES:
        raise ToolchainError(f"unknown dtype '{requested}'", f"use one of {', '.join(DTYPE_CHOICES)}")
    engine_row(target)
    hf = params.dtype
    if requested == "auto" and hf is None:
        # config.json without dtype/torch_dtype: the embedding's stored dtype is the truth.
        stored = ckpt.tensors.get("model.embed_tokens.weight")
        hf = str(stored.dtype).removeprefix("torch.") if stored is not None else "float32"
        if hf not in ("float32", "float16", "bfloat16"):
            hf = "float32"
    return engine_dtype(requested, hf, target)


def plan_checkpoint(hf_dir: Path | str, *, tp: int, pp: int, dtype: str = "auto", target: str = "cpu",
                    use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                    ckpt: HFCheckpoint | None = None, quantization: Quantization | None = None,
                    gpu: tuple[str | None, int | None] | None = None, moe_tp: int | None = None,
                    moe_ep: int | None = None, path: str | None = None, mtp_layers: int = 0) -> Plan:
    """Everything `convert_checkpoint` would write, per rank, without reading weights. `quantization` is
    the spec's request (Quantization.of its section), to which quantization_of adds the source checkpoint's
    own format (its config.json, and a ModelOpt export's hf_quant_config.json). `gpu` is (name, SM) of the
    target GPU when the spec names one (format checks); `moe_tp`/`moe_ep` the spec's expert parallelism
    (None: derived as TensorRT-LLM's Mapping does). `path` is the path whose runtime loads the result, the target's
    unless given: CpuLLM, the LLM-API path's stand-in, converts for the CPU engine with path llmapi, so a stored
    format the PyTorch backend loads and trtllm-build lacks (FP8 block scales) is imported there too.
    `mtp_layers`: the model's multi-token-prediction layers to keep (speculative.mode mtp; checkpoint/mtp.py),
    0 to drop them."""
    ckpt = ckpt or HFCheckpoint(hf_dir)
    family, params = load_params(ckpt.config, str(ckpt.config_path))
    if family.parallel_embedding_at_tp:  # the family's TensorRT-LLM config decides (archs/gemma.py)
        use_parallel_embedding = tp > 1
    layout = Layout(tp, pp, moe_tp, moe_ep, use_parallel_embedding, embedding_sharding_dim)
    sharding.check_parallelism(params, layout)
    requested = quantization or Quantization()
    if path == LLMAPI and (why := family.llmapi_problem(params, tp, pp, requested.active)) is not None:
        # CpuLLM stands in for LLM(): it refuses what the PyTorch backend's model of the family refuses
        raise ToolchainError(f"{ckpt.config_path}: {why}")
    qc = ckpt.config.get("quantization_config")
    stored = str(qc.get("quant_method", "quantization_config")) if isinstance(qc, dict) else None
    refusal = family.quantization_refusal(params, requested.method, requested.kv_cache, stored)
    if refusal is not None:
        raise ToolchainError(f"{ckpt.config_path}: {refusal.why}", refusal.hint)
    config_only = isinstance(ckpt, ConfigOnlyCheckpoint)
    fmt = read_stored_format(ckpt.directory, ckpt.config)
    if fmt is not None and fmt.get("modules") is not None:
        # A format the family's own rows carry as stored (gpt-oss's MXFP4 experts): nothing is virtualised and no
        # quantizer runs; the config names the format (`stored_rows_quantization`).
        q = quantization_of(requested, ckpt.config, modelopt=fmt)
        fmt = None
    elif fmt is not None:
        # A ModelOpt Hugging Face-format export (the LLM-API path's pre-quantized checkpoint) or a DeepSeek-style
        # FP8 block-scale checkpoint: imported as stored, in the format it was quantized in (parse_prequantized
        # knows AutoAWQ/GPTQ only).
        q = quantization_of(requested, ckpt.config, modelopt=fmt)
        if q.per_group and fmt["group_size"] is None and not config_only:
            # config.json alone does not say; the stored shapes do
            q = dataclasses.replace(q, group_size=stored_group_size(ckpt) or 128)
        if q.per_group:
            fmt = {**fmt, "group_size": q.group_size}
    else:
        q = quantization_of(requested, ckpt.config, origin=str(ckpt.config_path))
    shape = ModelShape.of(params, family)
    layout_plan = check_recipe(q, shape, tp=tp, target=target, gpu_name=(gpu or (None, None))[0],
                               gpu_sm=(gpu or (None, None))[1], splits=lambda t: splits_tp(params, layout, t),
                               path=path)
    raw = virtualize_prequantized(ckpt, q.prequantized.kind) if q.prequantized is not None else {}
    kv_sources: dict[int, tuple[str, str]] = {}
    if fmt is not None:
        stored_dtype = TORCH_DTYPES.get(params.dtype or "float16", torch.float16)
        raw, excluded, kv_sources = virtualize_modelopt(ckpt, NameTable(family, params), fmt, stored_dtype,
                                                        config_only=config_only)
        q = dataclasses.replace(q, exclude_modules=tuple(excluded))
    resolved = resolve_dtype(dtype, params, ckpt, target)
    opts = Options(tp=tp, pp=pp, dtype=resolved, use_parallel_embedding=use_parallel_embedding,
                   embedding_sharding_dim=embedding_sharding_dim, moe_tp=moe_tp, moe_ep=moe_ep)
    config = build_config(family, params, dtype=resolved, tp=tp, pp=pp,
                          use_parallel_embedding=use_parallel_embedding,
                          embedding_sharding_dim=embedding_sharding_dim, moe=(opts.layout.moe_tp, opts.layout.moe_ep))
    if layout_plan.padded_intermediate != params.intermediate_size and any(
            is_excluded(f"transformer.layers.{i}.mlp.{m}", q.exclude_modules)
            for i in range(params.num_hidden_layers) for m in ("fc", "gate", "proj")):
        # A padded int4 MLP next to an unpadded fp one would disagree on the width
        # (quant/recipe.py per_group_multiple).
        raise ToolchainError(f"intermediate_size {params.intermediate_size} is padded to "
                             f"{layout_plan.padded_intermediate} for per-group int4 at tp {tp}, which needs every "
                             "MLP linear quantized",
                             "use another parallelism.tp, or re-export the checkpoint with every MLP linear quantized"
                             if q.modelopt else "remove the mlp modules from quantization.exclude_modules, "
                             "or use quantization.group_size 64 or another parallelism.tp")
    if q.per_group:  # (a mixture of experts stored quantized was refused above: quantization_refusal)
        problem = moe.per_group_problem(params, q.weight_group_size, opts.layout.moe_tp)
        if problem is not None:
            smaller = "quantization.group_size 64, " if q.weight_group_size > 64 else ""
            raise ToolchainError(f"{ckpt.config_path}: {problem}",
                                 f"use {smaller}a smaller parallelism.moe_tp (a larger moe_ep), or quantization.method "
                                 "int4_wo")
    tiles = moe.tile_problem(params, q.format.tile, tp, opts.layout.moe_tp) if q.format.tile else None
    if tiles is not None:
        raise ToolchainError(f"{ckpt.config_path}: {tiles}", "use a larger parallelism.moe_ep (a smaller moe_tp), or "
                             "another parallelism.tp")
    if q.modules is not None and q.covers("experts") and q.format.group_size:  # MXFP4's blocks of 32
        problem = moe.block_problem(params, q.format.group_size, opts.layout.moe_tp)
        if problem is not None:
            raise ToolchainError(f"{ckpt.config_path}: {q.method} experts: {problem}",
                                 "use a smaller parallelism.moe_tp (a larger moe_ep)")
    quant = None
    if q.modules is not None:
        config["quantization"] = stored_rows_quantization(q, params)
    elif q.active or q.prequantized is not None:
        quant = Quantizer(q, params.num_attention_heads, params.num_key_value_heads, tp,
                          sharding.pp_layers(params.num_hidden_layers, pp), layout_plan, params.intermediate_size,
                          TORCH_DTYPES[resolved], raw=raw, kv_sources=kv_sources,
                          mapping=opts.layout,
                          moe_exclude=tuple(exclude.moe_exclusions(params.shared_expert_size > 0)) if params.is_moe
                          else ())
        config["quantization"] = quant.config()
    plan = build_plan(family, params, ckpt, opts, config, quant=quant)
    plan.config_only = config_only
    if mtp_layers:
        attach_mtp(plan, ckpt, mtp_layers)
    return plan


# The engine checkpoint's modules kept in the model dtype beside MXFP4 experts: TensorRT-LLM's own list for an mxfp4
# checkpoint names attention qkv and out, the router, the embedding and the unembedding (QuantConfig
# .update_from_model_ckpt: 'block.*.attn.out', 'block.*.mlp.gate', 'block.*.attn.qkv', 'embedding', 'unembedding';
# notes/i35-facts.md section 5), here in this checkpoint's names.
EXPERTS_ONLY_EXCLUDE = ("*attention.qkv", "*attention.dense", *exclude.ROUTER_EXCLUDE, "*vocab_embedding", "*lm_head")


def stored_rows_quantization(q: Quantization, params: ArchParams) -> dict:
    """config.json `quantization` of a checkpoint whose family rows carry a stored format holding the experts alone
    (q.modules: MXFP4): its QuantAlgo, the block the format fixes and every other module excluded."""
    if set(q.modules or ()) != {"experts"}:
        raise ToolchainError(f"a stored {q.method} checkpoint quantizing {sorted(q.modules or ())} cannot be converted",
                             "only one whose experts alone are quantized can")
    return {"quant_algo": q.quant_algo, "kv_cache_quant_algo": None, "group_size": q.format.group_size,
            "exclude_modules": list(EXPERTS_ONLY_EXCLUDE)}


def plan_any(hf_dir: Path | str, **options) -> Plan:
    """`plan_checkpoint`, or from config.json alone when the directory holds no
    weights yet (dry runs only: converting still needs the safetensors)."""
    if has_weights(hf_dir) or not (Path(hf_dir) / "config.json").is_file():
        with HFCheckpoint(hf_dir) as ckpt:
            return plan_checkpoint(ckpt.directory, ckpt=ckpt, **options)
    return plan_checkpoint(hf_dir, ckpt=ConfigOnlyCheckpoint(hf_dir), **options)


def calibrate(plan: Plan, hf_dir: Path | str, *, tokenizer_dir: Path | str | None = None,
              calibration: list | None = None, echo: Callable[[str], None] | None = None,
              trust_remote_code: bool = False) -> None:
    """Collect the activation statistics the plan's quantizer needs (runs the HF
    model layer by layer; only after every check has passed). `calibration`
    gives token sequences directly instead of the view's calibration dataset."""
    quant = plan.quant
    if quant is None or not quant.quantization.needs_calibration:
        return
    from toolchain.quant.calibration import calibration_tokens, collect_stats, hf_tokenizer

    r = quant.quantization
    seqs = calibration
    if seqs is None:
        tokenize = hf_tokenizer(Path(tokenizer_dir or hf_dir), trust_remote_code)
        seqs = calibration_tokens(tokenize, r.calibration_dataset, r.calibration_samples, r.calibration_seq_len)
    vocab = plan.params.vocab_size
    if any(int(s.max()) >= vocab or int(s.min()) < 0 for s in seqs):
        raise ToolchainError(f"calibration tokens fall outside the model's vocabulary [0, {vocab})",
                             "set model.tokenizer to the model's own tokenizer")
    quant.stats = collect_stats(Path(hf_dir), seqs, covariance="cov" in r.format.stats, progress=echo)


def convert_checkpoint(hf_dir: Path | str, out_dir: Path | str, *, tp: int, pp: int, dtype: str = "auto",
                       target: str = "cpu", use_parallel_embedding: bool = False,
                       embedding_sharding_dim: int = 0, quantization: Quantization | None = None,
                       tokenizer_dir: Path | str | None = None, calibration: list | None = None,
                       gpu: tuple[str | None, int | None] | None = None, moe_tp: int | None = None,
                       moe_ep: int | None = None, path: str | None = None, mtp_layers: int = 0) -> dict:
    """Write config.json and rank{N}.safetensors into `out_dir` (existing, empty);
    return the config written. `path`: as plan_checkpoint's."""
    out = Path(out_dir)
    if not out.is_dir() or any(out.iterdir()):
        raise ToolchainError(f"output directory {out} must exist and be empty",
                             "pass a fresh directory (the convert stage uses a temporary one)")
    with HFCheckpoint(hf_dir) as ckpt:
        plan = plan_checkpoint(hf_dir, tp=tp, pp=pp, dtype=dtype, target=target,
                               use_parallel_embedding=use_parallel_embedding,
                               embedding_sharding_dim=embedding_sharding_dim, ckpt=ckpt, quantization=quantization,
                               gpu=gpu, moe_tp=moe_tp, moe_ep=moe_ep, path=path, mtp_layers=mtp_layers)
        if plan.quant is not None and not plan.quant.imports:
            # a pending quantizer, before calibrating (--dry-run still plans it)
            plan.quant.format.check_implemented(ENGINE)
        calibrate(plan, hf_dir, tokenizer_dir=tokenizer_dir, calibration=calibration)
        write_plan(plan, ckpt, out)
    (out / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    return plan.config
