"""Checks that guard convert and build-engine: limits, KV cache, RoPE, parallelism,
quantization, GPU support, memory and speculative decoding.

Each check's description cites the upstream TensorRT-LLM code, doc or issue it
rests on (the build-time rules mostly come from tensorrt_llm/commands/build.py
and tensorrt_llm/builder.py). Each check returns (status, message); a failing
message names the spec field to change.
"""

from __future__ import annotations

import fnmatch

from toolchain import targets
from toolchain.archs import get_family, moe
from toolchain.archs.layout import layout_problems, splits_tp
from toolchain.archs.params import trained_positions
from toolchain.errors import ToolchainError
from toolchain.engine.trtllm import default_workers, planned_mpi
from toolchain.plan import memory as mem
from toolchain.plan.model import read_json
from toolchain.plan.plan import checkpoint_bytes_per_rank
from toolchain.quant import exclude
from toolchain.quant.formats import BLACKWELL, KV_CACHE
from toolchain.quant.recipe import (ModelShape, check_blocks, check_per_group, check_pytorch_per_group, check_tiles,
                                    device_refusal, path_refusal, per_group_multiple)
from toolchain.checks.registry import (ENGINE, ENGINE_PATH, FAIL, GPU_ONLY, LLMAPI_PATH, PASS, SKIP, UNREGISTERED, WARN,
                                       Context, check)

NO_MODEL = "model config not readable here; the stage reports why"


def _model(ctx: Context):
    return ctx.model.params if ctx.model is not None else None


# ---- limits (BuildConfig; TensorRT-LLM issues #2702, #2717) ---------------------------------------------------------
@check("limits.input-vs-seq", ENGINE, "max_input_len must leave room for output (TensorRT-LLM builder.py)")
def _input_vs_seq(ctx: Context):
    lim = ctx.spec.limits
    if lim.max_input_len >= lim.max_seq_len:
        return FAIL, (f"limits.max_input_len ({lim.max_input_len}) must be below limits.max_seq_len "
                      f"({lim.max_seq_len}); raise max_seq_len or lower max_input_len")
    return PASS, f"max_input_len {lim.max_input_len} < max_seq_len {lim.max_seq_len}"


@check("limits.num-tokens-vs-input", ENGINE,
       "without chunked context max_num_tokens caps a prompt (TensorRT-LLM issue #2702)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _num_tokens_vs_input(ctx: Context):
    lim, b = ctx.spec.limits, ctx.spec.build
    chunked = b.chunked_context and b.use_paged_context_fmha and b.context_fmha
    if lim.max_num_tokens >= lim.max_input_len or chunked:
        how = "chunked context" if lim.max_num_tokens < lim.max_input_len else f"max_num_tokens {lim.max_num_tokens}"
        return PASS, f"prompts up to max_input_len {lim.max_input_len} fit one step ({how})"
    return FAIL, (f"limits.max_num_tokens ({lim.max_num_tokens}) caps a prompt below limits.max_input_len "
                  f"({lim.max_input_len}) without chunked context; raise max_num_tokens to {lim.max_input_len} "
                  "or set build.chunked_context=true (with build.use_paged_context_fmha=true)")


@check("limits.num-tokens-vs-block", ENGINE,
       "with context FMHA max_num_tokens must hold one KV block (TensorRT-LLM _common.py)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _num_tokens_vs_block(ctx: Context):
    lim, b = ctx.spec.limits, ctx.spec.build
    if b.context_fmha and lim.max_num_tokens < b.tokens_per_block:
        return FAIL, (f"limits.max_num_tokens ({lim.max_num_tokens}) is below build.tokens_per_block "
                      f"({b.tokens_per_block}); raise max_num_tokens or lower tokens_per_block")
    return PASS, f"max_num_tokens {lim.max_num_tokens} >= tokens_per_block {b.tokens_per_block}"


@check("limits.seq-vs-positions", ENGINE,
       "max_seq_len beyond the trained context degrades quality (TensorRT-LLM builder.py)")
def _seq_vs_positions(ctx: Context):
    p = _model(ctx)
    if p is None:
        return SKIP, NO_MODEL
    trained = trained_positions(p.max_position_embeddings, p.rotary_scaling)
    if ctx.spec.limits.max_seq_len > trained:
        return WARN, (f"limits.max_seq_len ({ctx.spec.limits.max_seq_len}) exceeds the model's trained positions "
                      f"({trained}); output quality past that length is not guaranteed")
    return PASS, f"max_seq_len {ctx.spec.limits.max_seq_len} <= trained positions {trained}"


# ---- KV cache (TensorRT-LLM kv-cache-reuse.md, builder.py; tensorrtllm_backend model_config.md) ---------------------
@check("kv.paged-context-fmha", ENGINE,
       "KV reuse and chunked context need paged context FMHA (TensorRT-LLM kv-cache-reuse.md)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _paged_context_fmha(ctx: Context):
    b = ctx.spec.build
    wanted = [f for f in ("kv_cache_reuse", "chunked_context") if getattr(b, f)]
    if wanted and not (b.use_paged_context_fmha and b.context_fmha):
        off = "build.use_paged_context_fmha" if not b.use_paged_context_fmha else "build.context_fmha"
        return FAIL, (f"{' and '.join('build.' + w for w in wanted)} need paged context FMHA, but {off} is false; "
                      f"set {off}=true or turn {' and '.join('build.' + w for w in wanted)} off")
    return PASS, ("paged context FMHA on" if b.use_paged_context_fmha else "no feature needs paged context FMHA")


@check("kv.int8-disables-paged-fmha", ENGINE,
       "an INT8 KV cache turns paged context FMHA off (TensorRT-LLM builder.py)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _int8_kv(ctx: Context):
    if ctx.quant.kv_cache != "int8":
        return PASS, f"KV cache {ctx.quant.kv_cache if ctx.quant.kv_cache != 'none' else 'in the model dtype'}"
    b = ctx.spec.build
    on = [f"build.{f}" for f in ("use_paged_context_fmha", "kv_cache_reuse", "chunked_context") if getattr(b, f)]
    if on:
        return FAIL, (f"quantization.kv_cache=int8 turns paged context FMHA off, so {', '.join(on)} cannot take "
                      f"effect; set {'=false, '.join(on)}=false, or use quantization.kv_cache=fp8")
    return PASS, "INT8 KV cache with paged context FMHA, reuse and chunked context off"


def _kv_quant_advice(ctx: Context) -> str:
    """"set quantization.kv_cache=X, " where a smaller KV dtype exists for this spec, else ""."""
    if ctx.quant.kv_cache != "none":
        return ""  # int8 and fp8 both store one byte: nothing smaller to offer
    dev = ctx.device
    if not ctx.row.on_gpu or dev is None or dev.kind != "gpu":
        kv = "int8"
    else:
        kv = "int8" if KV_CACHE["fp8"].refused_on(dev.sm or 0) else "fp8"
    found = ctx.family()
    if found is not None and ctx.model is not None and \
            found[0].quantization_refusal(ctx.model.params, ctx.quant.weight_method, kv, ctx.quant.imported):
        return ""  # the family refuses that KV cache (Llama 4, gpt-oss: every format yet)
    return f"set quantization.kv_cache={kv}, "


@check("kv.one-sequence", ENGINE, "the KV cache must hold one full sequence (tensorrtllm_backend model_config.md)")
def _one_sequence(ctx: Context):
    m = ctx.memory
    if m is None:
        return SKIP, "no memory plan (see gpu.known, tp.heads, pp.layers)"
    if not m.weights_fit:
        return SKIP, "weights do not fit (see memory.fits)"
    if m.concurrency < 1:
        return FAIL, (f"the KV cache holds {m.kv_tokens_capacity} tokens per rank, less than one sequence of "
                      f"{m.sequence_tokens}; lower limits.max_seq_len, {_kv_quant_advice(ctx)}raise "
                      "serving.kv_cache_free_gpu_mem_fraction")
    if m.draft_kv_tokens_capacity is not None and m.draft_kv_tokens_capacity < (m.draft_sequence_tokens or 0):
        return FAIL, (f"the draft model's KV cache holds {m.draft_kv_tokens_capacity} tokens, less than one "
                      f"sequence of {m.draft_sequence_tokens}; raise speculative.draft_kv_cache_free_gpu_mem_fraction")
    return PASS, f"{m.kv_tokens_capacity} KV tokens per rank hold {m.concurrency} full sequences"


@check("kv.batch-concurrency", ENGINE, "fewer full-length sequences fit than max_batch_size")
def _batch_concurrency(ctx: Context):
    m = ctx.memory
    if m is None or not m.fits:
        return SKIP, "no fitting memory plan"
    if m.concurrency < ctx.spec.limits.max_batch_size:
        return WARN, (f"only {m.concurrency} sequences of {m.sequence_tokens} tokens fit in the KV cache at once, "
                      f"below limits.max_batch_size {ctx.spec.limits.max_batch_size}: requests wait under "
                      f"guaranteed_no_evict ({_kv_quant_advice(ctx)}lower limits.max_batch_size to "
                      f"{max(m.concurrency, 1)} to match)")
    return PASS, f"{m.concurrency} full-length sequences fit (max_batch_size {ctx.spec.limits.max_batch_size})"


# ---- memory (TensorRT-LLM memory.md) --------------------------------------------------------------------------------
@check("memory.fits", ENGINE, "weights, activations and workspace must fit each GPU (TensorRT-LLM memory.md)")
def _memory_fits(ctx: Context):
    if ctx.memory is None:
        return SKIP, "no memory plan (see gpu.known, tp.heads, pp.layers)" if ctx.model else NO_MODEL
    return (PASS if ctx.memory.weights_fit else FAIL), ctx.memory.verdict()


@check("build.host-ram", ENGINE,
       "parallel builds hold two rank checkpoints each in host RAM (TensorRT-LLM build.py --workers)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _host_ram(ctx: Context):
    if ctx.model is None:
        return SKIP, NO_MODEL
    spec, gib = ctx.spec, mem.GIB
    sizes = checkpoint_bytes_per_rank(spec, ctx.quant)
    per = 2 * max(sizes)
    world = spec.parallelism.world_size
    # Under mpirun every rank on a host builds at once; otherwise --workers of them do.
    mpi = planned_mpi(spec, world)
    at_once = min(world, spec.gpu.per_node) if mpi else min(default_workers(spec), world)
    how = f"{at_once} rank process(es) under mpirun" if mpi else f"--workers {at_once}"
    need = at_once * per
    host = spec.build.host_memory_gib
    if not host:
        return WARN, (f"{how} need about {need / gib:.1f} GiB of host RAM ({per / gib:.1f} GiB each); "
                      "set build.host_memory_gib to the build host's RAM to check it (unset, nothing here "
                      "reads this machine's)")
    if need > host * gib:
        fix = ("set build.mpi=never and lower build.workers" if mpi else "lower build.workers" if at_once > 1
               else "build on a host with more RAM (build.host_memory_gib says how much it has)")
        return FAIL, (f"{how} need about {need / gib:.1f} GiB of host RAM ({per / gib:.1f} GiB each), "
                      f"the build host has {host:.1f} GiB; {fix}")
    return PASS, f"{how}: about {need / gib:.1f} GiB of {host:.1f} GiB host RAM"


@check("build.multiple-profiles", ENGINE,
       "multiple_profiles and opt_num_tokens exclude each other (TensorRT-LLM build.py)", paths=ENGINE_PATH)
def _multiple_profiles(ctx: Context):
    b = ctx.spec.build
    if b.multiple_profiles and b.opt_num_tokens is not None:
        return FAIL, "build.multiple_profiles=true cannot be combined with build.opt_num_tokens; unset one of them"
    return PASS, "profile flags compatible"


# ---- RoPE (TensorRT-LLM functional.py RotaryScalingType, layers/attention.py; issue #2105) --------------------------
def _rope(ctx: Context, check_id: str):
    if ctx.model is None:
        return SKIP, NO_MODEL
    for pid, message in ctx.model.rope_problems:
        if pid == check_id:
            return FAIL, message
    scaling = ctx.model.params.rotary_scaling
    return PASS, f"rope type {scaling['type']}" if scaling else "no rope scaling"


@check("rope.unknown-type", ENGINE, "TensorRT-LLM 1.2 rejects unknown rope types (functional.py RotaryScalingType)", paths=ENGINE_PATH)
def _rope_type(ctx: Context):
    return _rope(ctx, "rope.unknown-type")


@check("rope.missing-keys", ENGINE,
       "llama3/yarn/linear/dynamic scaling needs its keys (TensorRT-LLM layers/attention.py)", paths=ENGINE_PATH)
def _rope_keys(ctx: Context):
    return _rope(ctx, "rope.missing-keys")


# ---- parallelism (TensorRT-LLM convert_utils.py, mapping.py); convert enforces these itself, so plan only -----------
def _problems(ctx: Context, p, axis: str) -> list[str]:
    """What the one layout rule (archs/layout.py layout_problems) finds about `axis` of the spec's split."""
    return [text for a, text in layout_problems(p, ctx.spec.parallelism.layout) if a == axis]


@check("tp.heads", (),
       "tp must divide the heads, the KV heads (or be a multiple of them) and the MLP (TensorRT-LLM convert_utils.py)")
def _tp_heads(ctx: Context):
    p, layout = _model(ctx), ctx.spec.parallelism.layout
    if p is None:
        return SKIP, NO_MODEL
    tp = layout.tp
    if splits_tp(p, layout, tp):
        dup = f", each KV head duplicated {tp // p.num_key_value_heads}x" if tp > p.num_key_value_heads else ""
        return PASS, f"tp {tp} splits {p.num_attention_heads} heads and {p.num_key_value_heads} KV heads{dup}"
    good = [t for t in (1, 2, 4, 8, 16, 32, 64) if splits_tp(p, layout, t)]
    hidden = f", hidden_size={p.hidden_size} (embedding_sharding_dim 1)" if layout.embedding_split_hidden else ""
    return FAIL, (f"parallelism.tp={tp} does not split num_attention_heads={p.num_attention_heads}, "
                  f"num_key_value_heads={p.num_key_value_heads}, intermediate_size={p.intermediate_size}{hidden}; "
                  f"use tp {', '.join(map(str, good))}")


@check("pp.layers", (), "pp cannot exceed the number of layers (TensorRT-LLM mapping.py)")
def _pp_layers(ctx: Context):
    p, layout = _model(ctx), ctx.spec.parallelism.layout
    if p is None:
        return SKIP, NO_MODEL
    pp = layout.pp
    if _problems(ctx, p, "pp"):
        return FAIL, f"parallelism.pp={pp} exceeds num_hidden_layers={p.num_hidden_layers}; lower pp"
    sizes = sorted({len(r) for r in layout.stage_layers(p.num_hidden_layers)}, reverse=True)
    return PASS, f"{p.num_hidden_layers} layers in {pp} stage(s) of {'/'.join(map(str, sizes))}"


@check("moe.parallelism", (),
       "moe_tp x moe_ep must equal tp, moe_ep divide the experts and moe_tp the expert width (TensorRT-LLM "
       "mapping.py, layers/moe.py)")
def _moe_parallelism(ctx: Context):
    p, par = _model(ctx), ctx.spec.parallelism
    if p is None:
        return SKIP, NO_MODEL
    problems = _problems(ctx, p, "moe")
    if problems:
        return FAIL, f"{problems[0]}; {moe.fitting_sizes(p, par.tp)}"
    if not p.is_moe:
        return PASS, "dense model: no experts to place"
    moe_tp, moe_ep = par.layout.moe_tp, par.layout.moe_ep
    shared_tp = par.layout.attn_tp  # whole on each attention-DP rank (plan/memory.py expert_bytes)
    shared = (f"; the shared expert {p.shared_expert_size // shared_tp} wide of {p.shared_expert_size} on each rank "
              f"(tp {shared_tp})" if p.shared_expert_size else "")
    return PASS, (f"{p.num_experts} experts, {par.layout.experts_per_rank(p.num_experts)} on each rank (moe_ep {moe_ep}), each "
                  f"{p.expert_size // moe_tp} wide of {p.expert_size} (moe_tp {moe_tp}){shared}")


@check("parallelism.attention-dp", (), "attention data parallelism is planned for mixture-of-experts models "
       "(archs/layout.py layout_problems; the spec refuses it on the engine path and at tp 1)",
       paths=LLMAPI_PATH)
def _attention_dp(ctx: Context):
    p, layout = _model(ctx), ctx.spec.parallelism.layout
    if not layout.attention_dp:
        return PASS, f"attention split over tp {layout.tp}"
    if p is None:
        return SKIP, NO_MODEL
    for problem in _problems(ctx, p, "attention_dp"):
        return FAIL, f"{problem}; remove parallelism.attention_dp"
    return PASS, (f"attention data-parallel over {layout.tp} ranks: each holds all {p.num_attention_heads} heads and "
                  f"its own requests' KV ({p.num_key_value_heads} KV heads)")


@check("arch.quantization", (), "the family must convert the quantization asked for (archs/*.py: the family's "
       "`quantization` refusal, which convert and the HF-format export also ask)")
def _arch_quantization(ctx: Context):
    if ctx.model is None:
        return SKIP, "model config not readable here or not a registered family; the stage reports why"
    p, q = ctx.model.params, ctx.quant
    # a stored ModelOpt / FP8 block-scale checkpoint is asked about as convert asks: method none, its format stored
    stored = q.imported or (q.format.name if q.modelopt else None)
    refusal = get_family(p.architecture).quantization_refusal(p, "none" if q.modelopt else q.weight_method,
                                                               q.kv_cache, stored)
    if refusal is not None:
        return FAIL, f"{refusal.why}; {refusal.hint}"
    return PASS, f"{p.architecture} {q.weight_method}" + (f", kv_cache {q.kv_cache}" if q.kv_cache != "none" else "")


@check("arch.supported", (), "the converter must support the architecture (convert refuses otherwise)")
def _arch(ctx: Context):
    if ctx.model is None:
        return SKIP, NO_MODEL
    return PASS, f"{ctx.model.params.architecture} is supported by convert"


@check("arch.engine-path", ENGINE, "trtllm-build of the pinned release must build the architecture (archs/*.py: "
       "the family's `engine_refusal`; target cpu stands in for it and refuses alike)", paths=ENGINE_PATH)
def _arch_engine_path(ctx: Context):
    found = ctx.family()
    if found is None:
        return SKIP, UNREGISTERED
    family, arch = found
    if family.engine_refusal is not None:
        llmapi = targets.named(targets.LLMAPI, ctx.row.device)
        return FAIL, f"{family.engine_refusal}; set target: {llmapi} to serve {arch}"
    return PASS, f"{arch} builds on the engine path"


# ---- quantization (TensorRT-LLM quantization/layers.py, modeling_utils.py, builder.py; issues #648, #988) -----------
def _full_dims(p) -> dict[str, int]:
    return {"hidden_size": p.hidden_size, "intermediate_size": p.intermediate_size,
            "attention width (heads x head_size)": p.num_attention_heads * p.head_size}


@check("quant.group-size", ENGINE, "int4 per-group kernels exist for group sizes 64 and 128 (TensorRT-LLM issue #988)")
def _group_size(ctx: Context):
    q = ctx.quant
    if not q.per_group:
        return PASS, "no per-group format"
    if q.weight_group_size not in (64, 128):
        return FAIL, f"quantization.group_size={q.weight_group_size} has no int4 kernel; use 64 or 128"
    return PASS, f"group size {q.weight_group_size}"


def _shape(p) -> ModelShape:
    return ModelShape.of(p, get_family(p.architecture))


@check("quant.group-padding", ENGINE,
       "per-group int4: trtllm-build pads every dim to max(64, g) x tp (TensorRT-LLM quantization/layers.py, "
       "WeightOnlyGroupwiseQuantLinear), the PyTorch backend pads nothing (_torch/modules/linear.py); a block the "
       "format fixes (NVFP4's 16, FP4Linear) must be whole in every rank's input width; FP8 block scales' 128x128 "
       "tiles whole in each fused part's rows and each row-parallel input per rank (_torch/modules/linear.py)")
def _group_padding(ctx: Context):
    q, p, tp = ctx.quant, _model(ctx), ctx.spec.parallelism.tp
    if p is not None and q.format.tile is not None:
        # convert's own rule (check_recipe), so plan and convert agree; a ToolchainError is this check's FAIL
        check_tiles(q, _shape(p), tp, lambda t: splits_tp(p, ctx.spec.parallelism.layout, t))
        experts = moe.tile_problem(p, q.format.tile, tp, ctx.spec.parallelism.layout.moe_tp)
        if experts is not None:
            return FAIL, f"{experts}; use a larger parallelism.moe_ep (a smaller moe_tp), or another parallelism.tp"
        return PASS, (f"every per-rank q, k/v and gate/up width and row-parallel input is whole {q.format.tile}x"
                      f"{q.format.tile} tiles")
    if p is not None and q.format.group_size is not None:
        # convert's own rules (check_recipe, moe.block_problem), so plan and convert agree; a ToolchainError is this
        # check's FAIL
        check_blocks(q, _shape(p), tp, lambda t: splits_tp(p, ctx.spec.parallelism.layout, t))
        if q.covers("experts") and (problem := moe.block_problem(p, q.format.group_size,
                                                                 ctx.spec.parallelism.layout.moe_tp)):
            return FAIL, f"{q.method} experts: {problem}; use a smaller parallelism.moe_tp (a larger moe_ep)"
        return PASS, f"every per-rank input width is whole blocks of {q.format.group_size}"
    if not q.per_group or p is None:
        return (PASS, "no per-group format") if p is not None else (SKIP, NO_MODEL)
    if q.weight_group_size not in (64, 128):
        return SKIP, "see quant.group-size"
    shape = _shape(p)
    if not ctx.row.builds_engine:
        # a ToolchainError is this check's FAIL
        check_pytorch_per_group(shape, q.weight_group_size, tp, lambda t: splits_tp(p, ctx.spec.parallelism.layout, t))
        return PASS, f"every per-rank input width splits into whole groups of {q.weight_group_size}"
    field = "a checkpoint quantized with group size" if q.imported else "quantization.group_size"
    try:  # the converter's own rule, so plan and convert agree
        padded = check_per_group(shape, q.weight_group_size, tp, field)
    except ToolchainError as err:
        good = [f"tp {t}" for t in (1, 2, 4, 8) if t != tp and splits_tp(p, ctx.spec.parallelism.layout, t)
                and _per_group_ok(shape, q.weight_group_size, t)]
        if q.weight_group_size == 128 and not q.imported and _per_group_ok(shape, 64, tp):
            good.append("quantization.group_size=64")
        return FAIL, f"{err.message}; use {' or '.join(good) or 'another quantization.method'}"
    problem = moe.per_group_problem(p, q.weight_group_size, ctx.spec.parallelism.layout.moe_tp)
    if problem is not None:  # convert's refusal of per-group int4 experts
        return FAIL, f"{problem}; use a smaller parallelism.moe_tp (a larger moe_ep) or quantization.method int4_wo"
    if padded != p.intermediate_size:
        return PASS, (f"intermediate_size {p.intermediate_size} is zero-padded to {padded} ({padded // tp} per rank), "
                      "as trtllm-build pads it (harmless: zero channels add nothing)")
    return PASS, f"every linear dim is a multiple of {per_group_multiple(q.weight_group_size, tp)}"


def _per_group_ok(shape: ModelShape, group: int, tp: int) -> bool:
    try:
        check_per_group(shape, group, tp, "quantization.group_size")
    except ToolchainError:
        return False
    return True


@check("quant.weight-only-padding", ENGINE,
       "weight-only dims must be multiples of 64 x tp (TensorRT-LLM quantization/layers.py)", paths=ENGINE_PATH)
def _weight_only_padding(ctx: Context):
    q, p, tp = ctx.quant, _model(ctx), ctx.spec.parallelism.tp
    if p is None:
        return SKIP, NO_MODEL
    if not q.weight_only:
        return PASS, "no weight-only format"
    problems = [f"{n} {d}" for n, d in _full_dims(p).items() if d % (64 * tp)]
    if problems:
        return FAIL, (f"{q.weight_method} at tp {tp} pads dims to multiples of {64 * tp}: {', '.join(problems)} "
                      "are not; use a smaller parallelism.tp or another quantization.method")
    return PASS, f"every linear dim is a multiple of {64 * tp}"


@check("quant.lm-head-excluded", ("build-engine",), "lm_head (and for weight-only the embedding) stay unquantized "
       "in the checkpoint's exclude_modules (TensorRT-LLM modeling_utils.py QuantConfig)", paths=ENGINE_PATH)
def _lm_head_excluded(ctx: Context):
    if ctx.quant.weight_method == "none":
        return PASS, "no weight quantization"
    path, excl = _checkpoint_exclude(ctx)
    if path is None:
        return SKIP, "no converted checkpoint yet"
    if excl is None:
        return PASS, "TensorRT-LLM's default exclusions (lm_head, embeddings) apply"
    need = ["lm_head"] + (["transformer.vocab_embedding"] if ctx.quant.weight_only else [])
    missing = [m for m in need if not any(fnmatch.fnmatch(m, pat) for pat in excl)]
    if missing:
        return FAIL, (f"{path} lists exclude_modules, which replace TensorRT-LLM's defaults, without "
                      f"{', '.join(missing)}: the build would expect quantized tensors there; rerun "
                      "`toolchain convert --force` with a converter that keeps them")
    return PASS, f"the checkpoint keeps {', '.join(need)} unquantized"


def _checkpoint_exclude(ctx: Context):
    """(the converted checkpoint's config.json, its quantization.exclude_modules) or (None, None) before convert.
    None for the list means absent: only then do TensorRT-LLM's defaults apply (an empty list replaces them
    too: quantize_layers, tensorrt_llm/quantization/quantize.py; quant/exclude.py)."""
    path = ctx.workspace.checkpoint_dir(ctx.spec) / "config.json" if ctx.workspace is not None else None
    cfg = read_json(path) if path is not None else None
    if cfg is None:
        return None, None
    return path, (cfg.get("quantization") or {}).get("exclude_modules")


@check("quant.moe-router-excluded", ("build-engine",), "a mixture of experts' router and shared_expert_gate stay "
       "unquantized in the checkpoint's exclude_modules (TensorRT-LLM quantization/quantize.py quantize_layers, "
       "models/convert_utils.py weight_only_quantize_dict)", paths=ENGINE_PATH)
def _moe_router_excluded(ctx: Context):
    p = _model(ctx)
    if p is None:
        return SKIP, NO_MODEL
    if ctx.quant.weight_method == "none" or not p.is_moe:
        return PASS, "no quantized mixture of experts"
    path, excl = _checkpoint_exclude(ctx)
    if path is None:
        return SKIP, "no converted checkpoint yet"
    shared = p.shared_expert_size > 0
    left = exclude.left_quantized(excl, p.num_hidden_layers, shared, ctx.quant.weight_only)
    if left:
        names = sorted({n.split(".", 3)[3] for n in left})  # per module, whatever the layer
        want = ", ".join(f"'{x}'" for x in exclude.moe_exclusions(shared))
        return FAIL, (f"{path} lists exclude_modules without {', '.join(names)} ({len(left)} in all over "
                      f"{p.num_hidden_layers} layers): the list replaces TensorRT-LLM's defaults, so the build "
                      f"quantizes them and its load fails (\"Required but not provided tensors\"); add {want}, "
                      "as `toolchain convert --force` now writes it")
    return PASS, "the checkpoint keeps the router" + (" and shared_expert_gate" if shared else "") + " unquantized"


@check("quant.fp8-needs-sm89", ENGINE, "FP8 weights and FP8 KV need SM 89 or newer (TensorRT-LLM precision.md)")
def _fp8_sm(ctx: Context):
    q, dev = ctx.quant, ctx.device
    # The formats with a minimum SM (quant/formats.py): FP8 weights and the FP8 KV cache.
    fp8 = [(f"quantization.{field}={value}", row.min_sm) for field, value, row in
           (("method", q.weight_method, q.format), ("kv_cache", q.kv_cache, q.kv_format)) if row.min_sm is not None]
    if not fp8:
        return PASS, "no FP8"
    if dev is None or dev.sm is None:
        return SKIP, "no GPU named"
    old = [what for what, sm in fp8 if dev.sm < sm]
    if old:
        return FAIL, (f"{' and '.join(old)} need SM {fp8[0][1]}+ (Ada/Hopper); the {dev.name} is SM {dev.sm}: "
                      "use int8 formats or a newer GPU")
    return PASS, f"FP8 on SM {dev.sm}"


@check("quant.blackwell-int-formats", ENGINE,
       "SM 100-119 rejects int8/int4 weight formats and INT8 KV (TensorRT-LLM builder.py)", paths=ENGINE_PATH)
def _blackwell(ctx: Context):
    q, dev = ctx.quant, ctx.device
    if dev is None or dev.sm is None or dev.sm not in BLACKWELL:
        return PASS, "not a Blackwell GPU"
    weights = f"the checkpoint's stored {q.imported.upper()} int4" if q.imported \
        else f"quantization.method={q.weight_method}"
    bad = [what for what, row in ((weights, q.format), (f"quantization.kv_cache={q.kv_cache}", q.kv_format))
           if row.refused_on(dev.sm) == "blackwell"]
    if bad:
        return FAIL, f"SM {dev.sm} (Blackwell) cannot build {' and '.join(bad)}; use fp8 (or NVFP4) instead"
    return PASS, f"formats build on SM {dev.sm}"


@check("quant.engine-path", ENGINE, "trtllm-build of the pinned release must build the weight format (the row's "
       "path rule, quant/formats.py engine_why_not: FP8 block scales have no branch in quantize(), "
       "tensorrt_llm/quantization/quantize.py)", paths=ENGINE_PATH)
def _engine_path(ctx: Context):
    refused = path_refusal(ctx.quant, ctx.row.path)
    if refused:
        return FAIL, refused
    return PASS, f"quantization.method={ctx.quant.weight_method} builds on the engine path"


@check("quant.gemm-plugin", ENGINE, "a format whose GEMMs need a plugin gets it (the row's gemm_plugin: FP4Linear "
       "runs its FP4 GEMM only under --gemm_plugin nvfp4, tensorrt_llm/quantization/layers.py)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _gemm_plugin(ctx: Context):
    needed, given = ctx.quant.format.gemm_plugin, ctx.spec.build.gemm_plugin
    if needed and given not in ("auto", needed):
        return FAIL, (f"build.gemm_plugin {given} with quantization.method={ctx.quant.weight_method}: its linears "
                      f"run their quantized GEMM only under --gemm_plugin {needed}, and otherwise dequantize to a "
                      f"dense matmul; set build.gemm_plugin auto (or {needed})")
    if given == "nvfp4" and needed != "nvfp4":
        return FAIL, (f"build.gemm_plugin nvfp4 needs NVFP4 weights, not quantization.method="
                      f"{ctx.quant.weight_method}; set build.gemm_plugin auto")
    return PASS, f"--gemm_plugin {needed if needed and given == 'auto' else given}"


@check("quant.device", ENGINE, "the device must run the formats: on a GPU the row's SM rule (quant/formats.py "
       "Devices; TensorRT-LLM docs/source/features/quantization.md hardware matrix), on the CPU engine its kernel")
def _device(ctx: Context):
    q, dev = ctx.quant, ctx.device
    if ctx.row.device == targets.CPU:
        # The CPU engine refuses a pending kernel at load (engine/cpu/config.py); say so before anything is built.
        if not q.format.cpu_kernel_ready:
            return FAIL, (f"quantization.method={q.weight_method}: the CPU engine's {q.format.cpu_kernel} kernel is "
                          "not implemented yet; use a GPU target or another quantization.method")
        return PASS, "the CPU engine runs the formats"
    if dev is None or dev.sm is None:
        return SKIP, "no GPU named"
    refused = device_refusal(q, dev.name, dev.sm)
    if refused:
        return FAIL, refused
    if q.format.blackwell_algo:  # the runtime picks the algorithm by GPU (MXFP4)
        return PASS, f"the formats run on SM {dev.sm}, the weights as {q.format.algo_on(dev.sm)}"
    return PASS, f"the formats run on SM {dev.sm}"


@check("gpu.known", (), "a trtllm plan needs the GPU it runs on")
def _gpu_known(ctx: Context):
    if ctx.device is not None:
        sm = f", SM {ctx.device.sm}" if ctx.device.sm else ""
        return PASS, f"{ctx.device.name}: {ctx.device.memory_gib:.1f} GiB{sm}"
    return FAIL, (f"target {ctx.spec.target} names no GPU, so the memory fit cannot be checked; set gpu.name "
                  "(e.g. 'H100 80GB') or gpu.memory_gib and gpu.sm")
