"""One step of one rank: what it reads and computes (`StageCost`), the work a step runs (`Work`), and its time
(`step_time`: memory, compute, the tensor-parallel all-reduce or the experts' exchange, and fixed costs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolchain.archs.layout import Layout
from toolchain.archs.params import ArchParams
from toolchain.gpus import Gpu, Link
from toolchain.plan import memory as mem
from toolchain.plan import mla
from toolchain.plan.perf import attention, kernels
from toolchain.plan.perf.attention import Span
from toolchain.plan.perf.efficiency import DEFAULT_EFFICIENCY, Efficiency
from toolchain.plan.perf.lora import LoraLoad
from toolchain.quant import formats
from toolchain.quant.view import Quantization

ACT_BYTES = 2  # activations travel between ranks in the half type (fp16/bf16) under every weight format


# ----------------------------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class ExpertShapes:
    """What the measured-kernel step looks up for a stage's mixture-of-experts layers: the routed experts as
    AIConfigurator's MoE table keys them (the model's whole shapes and their moe_tp x moe_ep split; kernels.moe_ms),
    and the GEMMs around them: the router, the shared expert, and the dense MLP of the layers without experts."""

    dtype: str
    """The experts' `moe_dtype` (kernels.MOE_DTYPES) on GPUs before SM 100."""
    blackwell_dtype: str
    """The same from SM 100 on, where a format's algorithm differs there (MXFP4: W4A8_MXFP4_MXFP8)."""
    hidden: int
    inter: int
    """One expert's whole intermediate size (the table's inter_size; moe_tp splits it)."""
    topk: int
    num_experts: int
    moe_tp: int
    moe_ep: int
    layers: int
    """The stage's layers with experts."""
    router: tuple[int, int]
    """(n, k) of the router GEMM, run in the half type as AIConfigurator's MoE block runs it."""
    shared: tuple[tuple[int, int], ...]
    """(n, k) of the shared expert's fused gate-and-up and its down projection on this rank (() without one)."""
    shared_width: int
    dense: tuple[tuple[int, int], ...]
    """(n, k) of the dense MLP's GEMMs on the stage's layers without experts."""
    distribution: str = kernels.MOE_DISTRIBUTION
    """The routing skew of the table's rows the lookup takes (kernels.MOE_DISTRIBUTION, MLA_MOE_DISTRIBUTION)."""


@dataclass(frozen=True)
class LatentShapes:
    """What the measured-kernel step looks up for multi-head latent attention (DeepSeek-V3) beyond KernelShapes'
    GEMMs (the fused q_a and kv_a down-projection, q_b and the output projection, run by every token): the
    attention kernels of the `mla` tables, kv_b's up-projection run by the prompt tokens, and the two absorbed BMMs
    a generating token runs instead (AIConfigurator's sdk/models/deepseek.py lays a layer out so)."""

    kv_b: tuple[int, int]
    """(n, k) of kv_b on this rank (the prompt chunk's keys and values out of the latent)."""
    bmm_dtype: str
    """The absorbed BMMs' dtype: fp8 under a quantized format, else bfloat16 (DeepSeekModel's mla_bmm_quant_mode)."""
    norm_values: int
    """Values of one token's latent norms (q_a_layernorm, kv_a_layernorm) a layer runs."""


@dataclass(frozen=True)
class KernelShapes:
    """What the measured-kernel step (kernel_step.py) looks up for one rank of a stage: its GEMMs by shape in the
    format's measured precision, its attention heads and KV precision, and a mixture-of-experts model's experts."""

    gemm_dtype: str
    """The format's gemm_dtype in AIConfigurator's database (quant/formats.py Format.measured_gemm)."""
    weight_bytes: float
    """Bytes per weight element in the built format, scales included (the speed of light of an unmeasured shape)."""
    gemms: tuple[tuple[int, int], ...]
    """(n, k) of one layer's GEMMs as both paths fuse them: qkv, the output projection, gate and up together, down
    (with `experts`: qkv and the output projection only)."""
    lm_head: tuple[int, int] | None
    """(n, k) of the lm_head on the last stage (its rank's vocabulary slice), run in the half type; else None."""
    heads: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    """"fp8" for a one-byte KV cache (int8 too: the database has fp8 only), else "bfloat16"."""
    mlp_width: int
    """The rank's intermediate size (the activation's elementwise bytes)."""
    experts: ExpertShapes | None = None
    latent: LatentShapes | None = None


@dataclass(frozen=True)
class StageCost:
    """What one rank of a pipeline stage reads and computes, per step and per token."""

    layers: int
    hidden: int
    weight_bytes: float
    """Bytes every step reads whatever its batch: the rank's linears (in the format's built bytes), norms, the
    lm_head on the last stage and an MoE's routers. The embedding is a gather of the step's rows, not read whole."""
    expert_bytes: float
    """One expert's bytes on this rank over the stage's layers (0 for a dense model)."""
    experts: int
    """Experts this rank holds (num_experts / moe_ep; 0 for a dense model)."""
    expert_share: float
    """top_k / num_experts: the chance that a token routes to a given expert (0 for a dense model)."""
    gemm_flops: float
    """FLOPs per token through the rank's linears in the format's precision (MoE: the experts it expects)."""
    lm_head_flops: float
    """FLOPs per token whose logits the last stage computes (0 elsewhere), in the half type."""
    kv_bytes_per_token: int
    attention_flops: float
    """FLOPs of one query token against one cached token, over the rank's heads and layers: 4 x heads x head_size
    (QK^T and PV, a multiply and an add each) x layers; under MLA the absorbed form of a generation step
    (attention.pair_flops)."""
    caps: tuple[tuple[int | None, int], ...] = ()
    """The stage's layers grouped by the most cached tokens a query sees (attention.layer_caps; (): all full)."""
    context_attention_flops: float | None = None
    """attention_flops of a prompt chunk where it differs (MLA's plain form); None: the same."""
    expand_flops: float = 0.0
    """FLOPs per cached token a prompt chunk reads, over the stage's layers (MLA: up-projecting the latent)."""
    expert_flops: float = 0.0
    """The part of gemm_flops that the routed experts take, per token of the whole batch (their share on this
    rank): under attention DP the experts see every rank's tokens, the rest of gemm_flops only the rank's own."""
    dp: int = 1
    """Attention data-parallel ranks (attention DP: tp; else 1): each runs 1/dp of the batch's sequences through
    its whole attention, dense MLP, shared expert and lm_head."""
    moe_layers: int = 0
    """The stage's layers with experts (the others' MLP is dense)."""
    exchange_share: float = 0.0
    """Under attention DP, the hidden states a rank sends each way per own token per MoE layer to and from the
    ranks holding its tokens' experts (`exchange_tokens`); 0 without attention DP, where the all-reduces combine."""
    lora: LoraLoad | None = None
    """The LoRA adapters the workload runs on this rank (perf/lora.py); None without LoRA."""
    kernels: KernelShapes | None = None
    """The shapes the measured-kernel step looks up (dense stages in a measured format); None: the roofline only."""


def stage_cost(p: ArchParams, *, tp: int, pp_rank: int, pp: int, quant: Quantization, dt_bytes: int, kv_bytes: int,
               qkv_bias: bool = False, dense_bias: bool = False, moe_tp: int | None = None,
               moe_ep: int | None = None, attention_dp: bool = False) -> StageCost:
    """The cost figures of one rank of stage `pp_rank` (every rank of a stage holds the same shapes). With
    `attention_dp` each rank holds the attention, dense MLP, shared expert and lm_head whole (Layout.attn_tp 1,
    as memory.rank_weights holds them) for its own sequences, and the experts keep their moe_tp x moe_ep split."""
    layout = Layout(tp, pp, moe_tp, moe_ep, attention_dp=attention_dp)
    attn_tp = layout.attn_tp
    stage = layout.stage_layers(p.num_hidden_layers)[pp_rank]
    layers = len(stage)
    moe_layers = sum(1 for i in stage if p.is_moe_layer(i))  # all of a MoE model's but Llama 4's or DeepSeek's dense ones
    w = mem.rank_weights(p, tp=tp, pp_rank=pp_rank, pp=pp, quant=quant, dt_bytes=dt_bytes, qkv_bias=qkv_bias,
                         dense_bias=dense_bias, moe_tp=moe_tp, moe_ep=moe_ep, attention_dp=attention_dp)
    read = w.layers + w.norms + w.lm_head
    last = pp_rank == pp - 1
    if last and w.lm_head == 0:  # a tied table serves as the lm_head, read whole every step
        read += w.embedding
    shapes = mem.linear_shapes(p, attn_tp, quant)
    gemm = 2.0 * sum(out * inp * (layers - moe_layers if name in mem.MLP_LINEARS else layers)
                     for name, out, inp in shapes)
    expert_bytes, experts, share, routed, exchange = 0.0, 0, 0.0, 0.0, 0.0
    if moe_layers:
        m_tp, m_ep = layout.moe_tp, layout.moe_ep
        width = p.expert_size // m_tp  # moe_intermediate_size where the family has one (Qwen MoE), as memory.expert_bytes
        experts = layout.experts_per_rank(p.num_experts)
        share = p.top_k / p.num_experts
        # fc (w3, w1) and proj in the engine's format, as memory.expert_bytes counts them
        expert_quant = quant.on("experts")  # a stored format may hold the experts alone (MXFP4)
        per_expert_layer = (mem.linear_bytes(2 * width, p.hidden_size, expert_quant, dt_bytes)
                            + mem.linear_bytes(p.hidden_size, width, expert_quant, dt_bytes))
        expert_bytes = per_expert_layer * moe_layers
        read -= experts * expert_bytes
        # a token runs top_k experts, of which top_k / moe_ep on average live on this rank; and the router
        routed = 2.0 * 3 * width * p.hidden_size * p.top_k / m_ep * moe_layers
        gemm += routed + 2.0 * p.num_experts * p.hidden_size * moe_layers
        # a shared expert (Qwen2-MoE, Llama 4, DeepSeek-V3) runs for every token: its slice of fc and proj (whole
        # under attention DP), and its gate if any
        shared = (3 * p.shared_expert_size // attn_tp + int(p.shared_expert_gated)) * p.hidden_size
        gemm += 2.0 * shared * moe_layers if p.shared_expert_size else 0.0
        if attention_dp and tp > 1:
            exchange = exchange_tokens(p.top_k, tp, m_ep)
    lm_head = 2.0 * (mem.padded_vocab(p, attn_tp) // attn_tp) * p.hidden_size if last else 0.0
    heads = p.num_attention_heads // attn_tp
    generation, context = attention.pair_flops(p, heads)
    kernels = None
    if not moe_layers and p.mla is None and not attention_dp and quant.format.measured_gemm and layers:
        kernels = kernel_shapes(p, shapes, quant, dt_bytes, kv_bytes, attn_tp, last)
    elif moe_layers and layers:
        kernels = moe_kernel_shapes(p, shapes, quant, dt_bytes, kv_bytes, layout, last, moe_layers)
    return StageCost(layers, p.hidden_size, read, expert_bytes, experts, share, gemm, lm_head,
                     mem.kv_bytes_per_token(p, tp=attn_tp, stage_layer_count=layers, kv_bytes=kv_bytes),
                     generation * layers, attention.layer_caps(p, stage),
                     None if context == generation else context * layers,
                     attention.expand_flops(p, heads) * layers, routed, tp if attention_dp else 1,
                     moe_layers, exchange, kernels=kernels)


def kernel_shapes(p: ArchParams, shapes: list[tuple[str, int, int]], quant: Quantization, dt_bytes: int,
                  kv_bytes: int, tp: int, last: bool) -> KernelShapes:
    """A dense stage's GEMMs as the engine runs them: q, k and v as one GEMM, gate and up (fc) as one."""
    by_name = {name: (out, inp) for name, out, inp in shapes}
    (qkv_n, h), (dense_n, dense_k) = by_name["qkv"], by_name["dense"]
    fc_n, _ = by_name["fc"]
    proj_n, proj_k = by_name["proj"]
    element = mem.linear_bytes(qkv_n, h, quant, dt_bytes) / (qkv_n * h)
    lm_head = (mem.padded_vocab(p, tp) // tp, p.hidden_size) if last else None
    return KernelShapes(str(quant.format.measured_gemm), element,
                        ((qkv_n, h), (dense_n, dense_k), (2 * fc_n, h), (proj_n, proj_k)), lm_head,
                        p.num_attention_heads // tp, mem.kv_heads_per_rank(p, tp), p.head_size,
                        "fp8" if kv_bytes == 1 else "bfloat16", proj_k)


def moe_kernel_shapes(p: ArchParams, shapes: list[tuple[str, int, int]], quant: Quantization, dt_bytes: int,
                      kv_bytes: int, layout: Layout, last: bool, moe_layers: int) -> KernelShapes | None:
    """A mixture-of-experts stage's kernels: the attention and its GEMMs as a dense stage's (on the attention's
    ranks, attn_tp), the routed experts as one fused MoE per layer, the router, the shared expert and the dense
    MLP of the other layers; None where a part has no measured counterpart (the non-expert linears in a format the
    GEMM table lacks or in two formats, the experts in an algorithm the MoE table does not name)."""
    dense = {quant.on(kind).format.measured_gemm for kind in ("attention", "mlp", "shared_expert")}
    experts = quant.on("experts").format
    dtypes = [kernels.MOE_DTYPES.get(a, "") for a in (experts.quant_algo, experts.algo_on(formats.BLACKWELL.start))]
    if len(dense) != 1 or None in dense or not all(dtypes):
        return None
    attention = quant.on("attention")
    shaped = latent_kernel_shapes if p.mla is not None else kernel_shapes
    base = shaped(p, shapes, attention, dt_bytes, kv_bytes, layout.attn_tp, last)
    h, s_tp = p.hidden_size, p.shared_expert_size // layout.attn_tp
    shared = ((2 * s_tp, h), (h, s_tp)) if p.shared_expert_size else ()
    skew = kernels.MLA_MOE_DISTRIBUTION if p.mla is not None else kernels.MOE_DISTRIBUTION
    moe = ExpertShapes(dtypes[0], dtypes[1], h, p.expert_size, p.top_k, p.num_experts, layout.moe_tp,
                       layout.moe_ep, moe_layers, (p.num_experts, h), shared, s_tp, base.gemms[-2:], skew)
    return dataclasses.replace(base, gemms=base.gemms[:-2], experts=moe)


def latent_kernel_shapes(p: ArchParams, shapes: list[tuple[str, int, int]], quant: Quantization, dt_bytes: int,
                         kv_bytes: int, tp: int, last: bool) -> KernelShapes:
    """A latent-attention stage's GEMMs as AIConfigurator's DeepSeek model lays them out: q_a and kv_a as one
    down-projection, q_b, the output projection (every token), then the dense MLP's fused gate-and-up and down;
    kv_b and the absorbed BMMs in `latent`."""
    by_name = {name: (out, inp) for name, out, inp in shapes}
    (q_a, h), (kv_a, _), q_b, kv_b, dense = by_name["q_a"], by_name["kv_a"], by_name["q_b"], by_name["kv_b"], \
        by_name["dense"]
    fc_n, _ = by_name["fc"]
    proj_n, proj_k = by_name["proj"]
    element = mem.linear_bytes(q_b[0], q_b[1], quant, dt_bytes) / (q_b[0] * q_b[1])
    lm_head = (mem.padded_vocab(p, tp) // tp, p.hidden_size) if last else None
    gemm_dtype = str(quant.format.measured_gemm)
    latent = LatentShapes(kv_b, "bfloat16" if gemm_dtype == "bfloat16" else "fp8", mla.norm_values(p))
    return KernelShapes(gemm_dtype, element, ((q_a + kv_a, h), q_b, dense, (2 * fc_n, h), (proj_n, proj_k)),
                        lm_head, p.num_attention_heads // tp, 1, mla.kv_values_per_token(p),
                        "fp8" if kv_bytes == 1 else "bfloat16", proj_k, latent=latent)


def exchange_tokens(top_k: int, ranks: int, moe_ep: int) -> float:
    """Hidden states one attention-DP rank sends each way per own token per MoE layer (and receives as many).
    TensorRT-LLM's fused MoE under attention DP either all-gathers every rank's tokens before the experts and
    reduce-scatters after (each rank moving (n - 1) tokens per own token each way), or, where the experts are
    spread over all n ranks (moe_ep n) and n > top_k, runs an all-to-all that sends each token to the ranks of
    its top_k experts (top_k x (n - 1)/n of them off the rank, duplicates not merged); the cheaper one is taken,
    as the all-to-all's gate on moe_ep_size > top_k picks it (tensorrt_llm/_torch/modules/fused_moe/, as
    recalled: UNVERIFIED here). Without attention DP every tp rank holds every token after the attention's
    all-reduce, so the experts need no dispatch and the MoE's all-reduce combines their outputs."""
    if ranks <= 1:
        return 0.0
    gather = float(ranks - 1)
    if moe_ep == ranks:
        return min(gather, top_k * (ranks - 1) / ranks)
    return gather


def experts_touched(cost: StageCost, tokens: float) -> float:
    """Expected distinct experts of this rank that `tokens` routed tokens use: each expert is missed by one token
    with chance 1 - top_k/E, by all of them with that to the power `tokens` (routing taken as uniform)."""
    if not cost.experts:
        return 0.0
    return cost.experts * (1.0 - (1.0 - cost.expert_share) ** tokens)


def allreduce_seconds(nbytes: float, ranks: int, link: Link, efficiency: float = 1.0) -> float:
    """One all-reduce of `nbytes` over `ranks` GPUs: each moves 2 (n-1)/n of the buffer over its link at best
    (reduce-scatter, then all-gather; NVIDIA/nccl-tests doc/PERFORMANCE.md, "AllReduce": t = S/B x 2(n-1)/n),
    plus the link's fixed latency; 0 on one rank."""
    if ranks <= 1:
        return 0.0
    return link.latency_us * 1e-6 + 2 * (ranks - 1) / ranks * nbytes / (link.gb_s * 1e9 * efficiency)


def transfer_seconds(nbytes: float, link: Link, efficiency: float = 1.0) -> float:
    """One point-to-point send between pipeline stages."""
    return link.latency_us * 1e-6 + nbytes / (link.gb_s * 1e9 * efficiency)


@dataclass(frozen=True)
class StepTime:
    memory_s: float
    compute_s: float
    comm_s: float
    fixed_s: float = 0.0
    kernels_s: float | None = None
    """The kernels' time: memory and compute overlap within a kernel, not across kernels, so the linears
    (weights read, GEMM FLOPs) and attention (KV cache read, attention FLOPs) each take the larger of their own
    two, one after the other. None: max(memory_s, compute_s), as if one kernel did everything."""
    serial: bool = False
    """The kernels run one after another (the CPU engine): memory_s and compute_s are then the summed times of
    the kernels each bounds, not two overlapping totals."""
    overlapped: bool = False
    """The host's work (fixed_s) runs while the GPU executes the previous step, so a step takes the longer of the
    two rather than their sum: the PyTorch backend's overlap scheduler, on unless `disable_overlap_scheduler`
    (TorchLlmArgs, default False, toolchain/upstream/facts/llmapi.json), which schedules and samples iteration
    n + 1 while iteration n's kernels run. The measured-kernel step, whose rows are fitted to PyTorch-path runs,
    takes it on both paths (the engine path's C++ executor also prepares the next batch on the host while the
    GPU works); the roofline and the CPU engine add the two."""

    @property
    def seconds(self) -> float:
        # the all-reduce waits for the kernels before it
        if self.serial:
            kernels = self.memory_s + self.compute_s
        else:
            kernels = max(self.memory_s, self.compute_s) if self.kernels_s is None else self.kernels_s
        if self.overlapped:
            return max(kernels + self.comm_s, self.fixed_s)
        return kernels + self.comm_s + self.fixed_s

    @property
    def bound(self) -> str:
        """Which term dominates: "memory", "compute" or "communication"."""
        terms = {"memory": self.memory_s, "compute": self.compute_s, "communication": self.comm_s}
        return max(terms, key=lambda k: terms[k])


@dataclass(frozen=True)
class Work:
    """What one step runs on one rank: tokens through the linears, rows of logits, cached tokens read, and
    (query, key) pairs of attention, all with every layer attending in full; `spans` says whose they are, for
    layers that see fewer keys (windows, chunks) and for MLA's two forms."""

    tokens: float
    logits: float
    kv_read: float
    pairs: float
    spans: tuple[Span, ...] = ()

    def scaled(self, factor: float) -> "Work":
        return Work(self.tokens * factor, self.logits * factor, self.kv_read * factor, self.pairs * factor,
                    tuple(s.scaled(factor) for s in self.spans))


def attention_load(cost: StageCost, work: Work) -> tuple[float, float]:
    """(KV bytes read and written, attention FLOPs) of `work` on one rank. With every layer in full and one
    attention form, work's totals; else layer group by group (StageCost.caps), each span under its group's
    cap, a prompt chunk's pairs at the context form's FLOPs plus its cached latents' up-projection."""
    full = (work.kv_read + work.tokens) * cost.kv_bytes_per_token, work.pairs * cost.attention_flops
    plain = cost.context_attention_flops is None and not cost.expand_flops
    if not work.spans or (not cost.caps and plain) or not cost.layers:
        return full
    kv_bytes = flops = 0.0
    for cap, n in cost.caps or ((None, cost.layers),):
        share = n / cost.layers
        kv_bytes += share * (sum(s.kv_read(cap) for s in work.spans) + work.tokens) * cost.kv_bytes_per_token
        for s in work.spans:
            per_pair = cost.context_attention_flops if s.causal and cost.context_attention_flops else cost.attention_flops
            flops += share * s.pairs(cap) * per_pair
            flops += share * s.kv_read(cap) * cost.expand_flops if s.causal else 0.0
    return kv_bytes, flops


def gpu_step_time(cost: StageCost, gpu: Gpu, work: Work, *, math_precision: str = "fp16", tp: int = 1,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """One step of one rank on a GPU: memory time, compute time and communication time: 2 all-reduces per
    layer when tp > 1; under attention DP (cost.dp > 1) none, each rank running 1/dp of the sequences through
    its attention and dense linears, the experts every rank's tokens, and a dispatch and a combine per MoE layer.
    Attention DP has no attention all-reduce: the PyTorch backend's Attention takes tp_size 1 under it (its o_proj
    unsplit, nothing to reduce; archs/layout.py Layout.attn_tp), and the dense MLP and shared expert run unsplit
    (memory.rank_weights)."""
    assert gpu.bandwidth_gb_s is not None and gpu.link is not None
    half = gpu.peak("fp16")
    assert half is not None
    gemm_peak = gpu.peak(math_precision) or half
    bandwidth = gpu.bandwidth_gb_s * 1e9 * eff.bandwidth
    own = work.scaled(1 / cost.dp) if cost.dp > 1 else work
    linear_bytes = cost.weight_bytes + experts_touched(cost, work.tokens) * cost.expert_bytes
    kv_bytes, attention_flops = attention_load(cost, own)  # read the cache, write the new tokens
    gemm_flops = own.tokens * (cost.gemm_flops - cost.expert_flops) + work.tokens * cost.expert_flops
    linear_flops = (gemm_flops / (gemm_peak * 1e12 * eff.compute)
                    + own.logits * cost.lm_head_flops / (half * 1e12 * eff.compute))
    if cost.lora is not None:  # the adapters' shrink and expand GEMMs in the half type, each adapter read once
        linear_bytes += cost.lora.bytes_read(sequences(own))
        linear_flops += own.tokens * cost.lora.flops_per_token / (half * 1e12 * eff.compute)
    attention_s = attention_flops / (half * 1e12 * eff.compute)
    memory_s = (linear_bytes + kv_bytes) / bandwidth
    compute_s = linear_flops + attention_s
    kernels_s = max(linear_bytes / bandwidth, linear_flops) + max(kv_bytes / bandwidth, attention_s)
    comm_s = 0.0
    link = dataclasses.replace(gpu.link, latency_us=gpu.link.latency_us * eff.latency)
    if cost.dp > 1 and work.tokens > 0:
        if cost.exchange_share:
            exchange = own.tokens * cost.hidden * ACT_BYTES * cost.exchange_share
            comm_s = 2 * cost.moe_layers * transfer_seconds(exchange, link, eff.link)
    elif tp > 1 and work.tokens > 0:
        comm_s = 2 * cost.layers * allreduce_seconds(work.tokens * cost.hidden * ACT_BYTES, tp, link, eff.link)
    fixed_s = (eff.fixed_us + eff.seq_us * own.logits) * 1e-6
    return StepTime(memory_s, compute_s, comm_s, fixed_s, kernels_s)


def sequences(work: Work) -> float:
    """Sequences a step runs (its spans' own; its rows of logits where it has no spans)."""
    return sum(s.sequences for s in work.spans) if work.spans else work.logits


def generation_work(batch: float, context: float, tokens_per_seq: int = 1) -> Work:
    """A generation step of `batch` sequences of `context` cached tokens, each running `tokens_per_seq` tokens
    (1, or 1 + the draft length when the step verifies drafts)."""
    return Work(batch * tokens_per_seq, batch * tokens_per_seq, batch * context, batch * tokens_per_seq * context,
                (Span(batch, context, tokens_per_seq, causal=False),))


def context_work(tokens: int, start: int = 0) -> Work:
    """A context (prefill) chunk of `tokens` prompt tokens after `start` already cached: its tokens attend
    causally to the cache and to each other; one row of logits (its last token, when the chunk ends the prompt)."""
    pairs = tokens * start + tokens * (tokens + 1) / 2
    return Work(tokens, 1, start, pairs, (Span(1, start, tokens, causal=True),))


def add(*works: Work) -> Work:
    return Work(sum(w.tokens for w in works), sum(w.logits for w in works), sum(w.kv_read for w in works),
                sum(w.pairs for w in works), tuple(s for w in works for s in w.spans))
