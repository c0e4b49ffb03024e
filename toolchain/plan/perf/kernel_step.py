"""One step of one rank from measured kernels: the stage's GEMMs, attention and all-reduces each looked up in
AIConfigurator's per-operation database (kernels.py) at the step's shapes, one after another, plus the elementwise
kernels between them and the step's fixed costs.

A layer runs, as both TensorRT-LLM paths lay a dense decoder out (AIConfigurator's sdk/models/llama.py lists the
same operations): the fused qkv GEMM, attention (the prompt chunks' context attention and the generating
sequences' decode attention, each at its own batch and length), the output projection, an all-reduce, the
residual add and norm (inside the all-reduce's kernel at tp > 1, as the PyTorch backend fuses them), the fused
gate-and-up GEMM, the activation, the down projection, an all-reduce, the add and norm. The last stage adds the lm_head over the rows that sample (in the half type). The elementwise kernels
move their bytes at AIConfigurator's memory-bound rule (bytes / (0.8 x bandwidth) + 3 us: its systems/*.yaml
`mem_bw_empirical_scaling_factor` and `mem_empirical_constant_latency`).
"""

from __future__ import annotations

import dataclasses
from functools import cache

from toolchain.gpus import Gpu
from toolchain.plan.perf import kernels as db
from toolchain.plan.perf.attention import Span
from toolchain.plan.perf.efficiency import Efficiency
from toolchain.quant.formats import BLACKWELL
from toolchain.plan.perf.step import (ACT_BYTES, KernelShapes, StageCost, StepTime, Work, experts_touched, sequences,
                                      transfer_seconds)

ELEMENTWISE_BANDWIDTH = 0.8
ELEMENTWISE_US = 3.0
FMHA = "bfloat16"
"""The context attention's own precision looked up (the database also times FP8 context FMHA): bf16 over the KV
cache's precision, the choice that needs no option; which one TensorRT-LLM 1.2 picks for an FP8 checkpoint by
default is UNVERIFIED here."""


def available(cost: StageCost, gpu: Gpu, tp: int) -> bool:
    """The database has this GPU, the format's GEMMs, the stage's attention and (tp > 1) the all-reduce."""
    return cost.kernels is not None and _available(cost.kernels, gpu.name, gpu.sm, tp)


@cache
def _available(k: KernelShapes, gpu_name: str, sm: int | None, tp: int) -> bool:
    if gpu_name not in db.SYSTEMS:
        return False
    system = db.SYSTEMS[gpu_name]
    if db.gemm_sites(system, k.gemm_dtype) is None or db.gemm_sites(system, "bfloat16") is None:
        return False
    if k.latent is not None:
        if not db.mla_grids(system, "context", k.kv_dtype) or not db.mla_grids(system, "generation", k.kv_dtype):
            return False
        if db.mla_bmm_ms(system, k.latent.bmm_dtype, 1.0, k.heads) is None:
            return False
    elif not db.attention_grids(system, "context", k.head_dim, k.kv_dtype, FMHA):
        return False
    elif not db.attention_grids(system, "generation", k.head_dim, k.kv_dtype):
        return False
    if k.experts is not None and _experts_ms(k, system, sm, 1.0) is None:
        return False
    return tp <= 1 or db.allreduce_ms(system, 1.0, tp) is not None


def experts_dtype(k: KernelShapes, sm: int | None) -> str:
    """The experts' moe_dtype on a GPU of SM `sm` (which picks the format's algorithm, Format.algo_on)."""
    assert k.experts is not None
    return k.experts.blackwell_dtype if sm is not None and sm >= BLACKWELL.start else k.experts.dtype


def _experts_ms(k: KernelShapes, system: str, sm: int | None, tokens: float) -> float | None:
    """One layer's fused MoE on one rank for `tokens` tokens (every rank's under attention DP), or None where the
    MoE table lacks the shape."""
    e = k.experts
    assert e is not None
    return db.moe_ms(system, experts_dtype(k, sm), tokens, e.hidden, e.inter, e.topk, e.num_experts,
                     e.moe_tp, e.moe_ep, e.distribution)


def measured_kernels(dep) -> bool:
    """Every stage of a GPU deployment steps on measured kernels (`available`)."""
    return all(available(c, dep.gpu, dep.tp) for c in dep.stages)


def unmeasured(dep) -> str | None:
    """Why a GPU deployment does not step on measured kernels (None: it does): what AIConfigurator 0.12.0's
    database lacks for it, in words for the basis."""
    gpu = dep.gpu
    if gpu.name not in db.SYSTEMS:
        return f"AIConfigurator {db.VERSION} has no kernel data for {gpu.name}"
    if db.data_root() is None:
        return f"{db.PACKAGE} {db.VERSION} (its kernel database) is not installed: run `make setup`"
    for cost in dep.stages:
        k = cost.kernels
        if k is None:
            return ("the kernel database holds no kernels for this family or format (attention DP on a dense model, "
                    "or linears in a format it lacks)")
        system = db.SYSTEMS[gpu.name]
        if db.gemm_sites(system, k.gemm_dtype) is None:
            return f"the kernel database has no {k.gemm_dtype} GEMMs on {gpu.name}"
        if k.experts is not None and _experts_ms(k, system, gpu.sm, 1.0) is None:
            e, table = k.experts, db.moe_curves(system, k.experts.distribution)[0]
            version = f"TensorRT-LLM {table.version}'s " if table else ""
            return (f"the kernel database's {version}MoE table has no {experts_dtype(k, gpu.sm)} experts of hidden "
                    f"{e.hidden}, width {e.inter}, top {e.topk} of {e.num_experts} at moe_tp {e.moe_tp} x moe_ep "
                    f"{e.moe_ep} on {gpu.name}")
        if k.latent is not None and not available(cost, gpu, dep.tp):
            return (f"the kernel database lacks latent attention with a {k.kv_dtype} KV cache, its {k.heads}-head "
                    f"{k.latent.bmm_dtype} BMMs or a {dep.tp}-GPU all-reduce on {gpu.name}")
        if not available(cost, gpu, dep.tp):
            return (f"the kernel database lacks attention of head size {k.head_dim} with a {k.kv_dtype} KV cache or "
                    f"a {dep.tp}-GPU all-reduce on {gpu.name}")
    return None


def describe(dep, runs: str | None) -> str:
    """What a measured-kernel prediction rests on: the database's tables for the card, and the measured runs the
    serving costs were fitted to (`runs`, the words of the row efficiency.kernel_row took)."""
    k = dep.stages[0].kernels
    assert k is not None
    sites = db.gemm_sites(db.SYSTEMS[dep.gpu.name], k.gemm_dtype)
    assert sites is not None
    experts = ""
    if k.experts is not None:
        table = db.moe_curves(sites.table.system, k.experts.distribution)[0]
        assert table is not None
        experts = f"; the experts from its TensorRT-LLM {table.version} MoE table"
    kernels = (f"AIConfigurator {db.VERSION}'s measured kernels ({sites.table.system}, TensorRT-LLM "
               f"{sites.table.version}, the PyTorch backend's; on the engine path they stand in for its own"
               f"{experts})")
    return kernels if runs is None else f"{kernels} + serving costs fitted to {runs}"


def kernel_step_time(cost: StageCost, gpu: Gpu, work: Work, *, math_precision: str, tp: int,
                     eff: Efficiency) -> StepTime:
    """One step of one rank of a stage from the measured kernels (`available` must hold); `math_precision`
    the format's (quant/formats.py Format.math), whose peak an unmeasured GEMM's speed of light takes. Under
    attention DP (cost.dp > 1) the rank runs its own 1/dp of the sequences through its attention and the GEMMs
    around it, and the experts every rank's tokens, as the roofline's gpu_step_time has it; the tokens' dispatch
    and combine between the ranks stay the roofline's (the database's all-to-all tables are partial)."""
    k = cost.kernels
    assert k is not None and gpu.bandwidth_gb_s is not None and gpu.link is not None
    system = db.SYSTEMS[gpu.name]
    sites = db.gemm_sites(system, k.gemm_dtype)
    half = db.gemm_sites(system, "bfloat16")
    assert sites is not None and half is not None
    everyone = work
    work = work.scaled(1 / cost.dp) if cost.dp > 1 else work
    tokens = work.tokens
    memory_ms = compute_ms = 0.0

    def add(ms: float, memory_bound: bool) -> None:
        nonlocal memory_ms, compute_ms
        if memory_bound:
            memory_ms += ms
        else:
            compute_ms += ms

    if tokens > 0:
        for n, kk in k.gemms:
            ms, _ = db.gemm_ms(gpu, sites, math_precision, k.weight_bytes, tokens, n, kk)
            add(ms * cost.layers, _memory_bound(gpu, math_precision, k.weight_bytes, tokens, n, kk))
    if k.latent is not None:
        memory_ms, compute_ms = _add_latent(k, gpu, system, work, cost.layers, math_precision, sites, memory_ms,
                                            compute_ms)
    if k.experts is not None:
        memory_ms, compute_ms = _add_experts(cost, k, gpu, everyone.tokens, tokens, math_precision, sites, half,
                                             memory_ms, compute_ms)
    if k.lm_head is not None and work.logits > 0:
        n, kk = k.lm_head
        ms, _ = db.gemm_ms(gpu, half, "fp16", 2.0, work.logits, n, kk)
        add(ms, _memory_bound(gpu, "fp16", 2.0, work.logits, n, kk))
    context_ms, generation_ms = attention_ms(cost, k, system, work, gpu)
    add(context_ms * eff.attention_scale, False)
    add(generation_ms * eff.attention_scale, True)
    elementwise_ms = 0.0
    if tokens > 0:
        hidden_bytes = tokens * cost.hidden * ACT_BYTES
        # the activation; and the residual add and norm twice, unless the all-reduce does them (tp > 1: the
        # PyTorch backend's Llama decoder layer passes AllReduceParams(fusion_op=RESIDUAL_RMS_NORM, or its
        # _QUANT_FP8 form) to its all-reduce, tensorrt_llm/_torch/models/modeling_llama.py)
        fused = tp > 1 and cost.dp == 1
        per_layer = [3 * tokens * k.mlp_width * ACT_BYTES] + ([3 * hidden_bytes] * 2 if not fused else [])
        if k.experts is None:
            elementwise_ms = cost.layers * sum(_elementwise_ms(gpu, b) for b in per_layer)
        else:  # the experts' activation is inside the fused MoE; the shared expert's and the dense layers' are not
            e = k.experts
            shared = [3 * tokens * e.shared_width * ACT_BYTES] if e.shared else []
            elementwise_ms = ((cost.layers - e.layers) * sum(_elementwise_ms(gpu, b) for b in per_layer)
                              + e.layers * sum(_elementwise_ms(gpu, b) for b in shared + per_layer[1:]))
        if k.latent is not None:  # the latent norms (q_a_layernorm, kv_a_layernorm)
            elementwise_ms += cost.layers * _elementwise_ms(gpu, 3 * tokens * k.latent.norm_values * ACT_BYTES)
        elementwise_ms += _elementwise_ms(gpu, hidden_bytes)  # the embedding's gather
    comm_ms = 0.0
    if cost.dp > 1 and tokens > 0:
        link = dataclasses.replace(gpu.link, latency_us=gpu.link.latency_us * eff.latency)
        exchange = tokens * cost.hidden * ACT_BYTES * cost.exchange_share
        comm_ms = 2 * cost.moe_layers * transfer_seconds(exchange, link, eff.link) * 1e3 if exchange else 0.0
    elif tp > 1 and tokens > 0:
        one = db.allreduce_ms(system, tokens * cost.hidden, tp)
        assert one is not None
        comm_ms = 2 * cost.layers * (one * eff.link_scale + eff.allreduce_us * 1e-3)
    if cost.lora is not None:  # the adapters' shrink and expand GEMMs (not in the database): the roofline's
        lora_bytes = cost.lora.bytes_read(sequences(work)) / (gpu.bandwidth_gb_s * 1e9 * eff.bandwidth)
        lora_flops = tokens * cost.lora.flops_per_token / ((gpu.peak("fp16") or 1.0) * 1e12 * eff.compute)
        add(max(lora_bytes, lora_flops) * 1e3 / eff.kernel_scale, lora_bytes >= lora_flops)
    fixed_s = (eff.fixed_us + eff.seq_us * work.logits) * 1e-6
    kernels_ms = (memory_ms + compute_ms + elementwise_ms) * eff.kernel_scale
    return StepTime((memory_ms + elementwise_ms) * 1e-3 * eff.kernel_scale, compute_ms * 1e-3 * eff.kernel_scale,
                    comm_ms * 1e-3, fixed_s, kernels_ms * 1e-3, overlapped=True)


def _add_latent(k: KernelShapes, gpu: Gpu, system: str, work: Work, layers: int, math_precision: str,
                sites: db.GemmSites, memory_ms: float, compute_ms: float) -> tuple[float, float]:
    """(memory_ms, compute_ms) with latent attention's own GEMMs added (its attention kernels are attention_ms'):
    kv_b over the prompt chunks' tokens and the cached latents they read (a chunk after cached tokens
    up-projects those too), and the two absorbed BMMs over the generating tokens."""
    lat = k.latent
    assert lat is not None
    prompt = sum(s.sequences * (s.start + s.tokens) for s in work.spans if s.causal)
    generating = sum(s.sequences * s.tokens for s in work.spans if not s.causal)
    if prompt > 0:
        n, kk = lat.kv_b
        ms, _ = db.gemm_ms(gpu, sites, math_precision, k.weight_bytes, prompt, n, kk)
        bound = _memory_bound(gpu, math_precision, k.weight_bytes, prompt, n, kk)
        memory_ms, compute_ms = (memory_ms + ms * layers, compute_ms) if bound else \
            (memory_ms, compute_ms + ms * layers)
    bmm = db.mla_bmm_ms(system, lat.bmm_dtype, generating, k.heads)
    assert bmm is not None
    return memory_ms + bmm * layers, compute_ms


def _add_experts(cost: StageCost, k: KernelShapes, gpu: Gpu, routed: float, tokens: float, math_precision: str,
                 sites: db.GemmSites, half: db.GemmSites, memory_ms: float, compute_ms: float) -> tuple[float, float]:
    """(memory_ms, compute_ms) with a mixture-of-experts stage's layers added: per MoE layer the fused MoE over the
    `routed` tokens (every rank's under attention DP), the router in the half type and the shared expert over the
    rank's own `tokens`, and the dense MLP on the layers without experts. The fused MoE counts as memory-bound
    while reading the experts its tokens touch takes longer at the datasheet's bandwidth than their FLOPs at the
    format's peak."""
    e = k.experts
    assert e is not None and gpu.bandwidth_gb_s is not None
    if routed <= 0:
        return memory_ms, compute_ms
    system = db.SYSTEMS[gpu.name]
    moe = _experts_ms(k, system, gpu.sm, routed)
    assert moe is not None
    per_layer_bytes = experts_touched(cost, routed) * cost.expert_bytes / max(e.layers, 1)
    flops = 2.0 * 3 * e.inter / e.moe_tp * e.hidden * routed * e.topk / e.moe_ep
    memory_s = per_layer_bytes / (gpu.bandwidth_gb_s * 1e9)
    compute_s = flops / ((gpu.peak(math_precision) or gpu.peak("fp16") or 1.0) * 1e12)
    if memory_s > compute_s:
        memory_ms += moe * e.layers
    else:
        compute_ms += moe * e.layers
    gemms = [(sites, math_precision, k.weight_bytes, g, e.layers) for g in e.shared]
    gemms += [(half, "fp16", 2.0, e.router, e.layers)]
    gemms += [(sites, math_precision, k.weight_bytes, g, cost.layers - e.layers) for g in e.dense]
    for table, precision, weight_bytes, (n, kk), layers in gemms:
        if tokens <= 0 or layers <= 0:
            continue
        ms, _ = db.gemm_ms(gpu, table, precision, weight_bytes, tokens, n, kk)
        if _memory_bound(gpu, precision, weight_bytes, tokens, n, kk):
            memory_ms += ms * layers
        else:
            compute_ms += ms * layers
    return memory_ms, compute_ms


def _memory_bound(gpu: Gpu, precision: str, weight_bytes: float, m: float, n: int, k: int) -> bool:
    compute, memory = db.gemm_sol_terms(gpu, precision, weight_bytes, m, n, k)
    return memory > compute


def _elementwise_ms(gpu: Gpu, nbytes: float) -> float:
    assert gpu.bandwidth_gb_s is not None
    return (nbytes / (gpu.bandwidth_gb_s * 1e9 * ELEMENTWISE_BANDWIDTH) + ELEMENTWISE_US * 1e-6) * 1e3


def attention_ms(cost: StageCost, k: KernelShapes, system: str, work: Work, gpu: Gpu) -> tuple[float, float]:
    """(context, generation) attention milliseconds of the step over the stage's layers: each prompt chunk at its
    batch and length (a chunk after cached tokens in proportion to its (query, key) pairs), each generation span
    at its batch and cached length, layer group by group under their caps (windows, chunks). Neither is taken
    faster than the datasheet allows: a generation span reads its cached K and V at most at the card's
    bandwidth, a chunk's FLOPs run at most at its half-precision peak (the A100's generation table in
    AIConfigurator 0.12.0, a `legacy` collection, reads faster than the A100's 2039 GB/s)."""
    assert gpu.bandwidth_gb_s is not None
    bandwidth = gpu.bandwidth_gb_s * 1e9
    peak = (gpu.peak("fp16") or 1.0) * 1e12
    per_layer_kv = cost.kv_bytes_per_token / max(cost.layers, 1)
    # a chunk's pairs at the context form's FLOPs where it has its own (MLA's plain form)
    per_layer_flops = (cost.context_attention_flops or cost.attention_flops) / max(cost.layers, 1)
    if k.latent is not None:  # the heads' whole latent attention (kv_heads 1), as the mla tables key it
        ctx_grids = db.mla_grids(system, "context", k.kv_dtype)
        gen_grids = db.mla_grids(system, "generation", k.kv_dtype)
    else:
        ctx_grids = db.attention_grids(system, "context", k.head_dim, k.kv_dtype, FMHA)
        gen_grids = db.attention_grids(system, "generation", k.head_dim, k.kv_dtype)
    ctx = db.nearest_grid(ctx_grids, k.heads, k.kv_heads)
    gen = db.nearest_grid(gen_grids, k.heads, k.kv_heads)
    assert ctx is not None and gen is not None
    spans: tuple[Span, ...] = work.spans
    context = generation = 0.0
    groups = cost.caps or ((None, cost.layers),)
    for cap, layers in groups:
        for s in spans:
            if s.sequences <= 0 or s.tokens <= 0:
                continue
            if s.causal:
                grid, scale = ctx
                whole = s.start + s.tokens if cap is None else min(s.start + s.tokens, cap)
                ms = db.grid_ms(grid, s.sequences, whole, lambda x: x * x)
                full_pairs = whole * (whole + 1) / 2
                share = s.pairs(cap) / s.sequences / full_pairs if full_pairs else 0.0
                floor = s.pairs(cap) * per_layer_flops / peak * 1e3
                context += layers * max(ms * scale * share, floor)
            else:
                grid, scale = gen
                seen = s.start if cap is None else min(s.start, cap)
                ms = db.grid_ms(grid, s.sequences * s.tokens, max(seen, 1.0), lambda x: x)
                floor = s.sequences * seen * per_layer_kv / bandwidth * 1e3
                generation += layers * max(ms * scale, floor)
    return context, generation
