"""One step of one rank: what it reads and computes (`StageCost`), the work a step runs (`Work`), and its time
(`step_time`: memory, compute, the tensor-parallel all-reduce and fixed costs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolchain.archs.layout import Layout
from toolchain.archs.params import ArchParams
from toolchain.gpus import Gpu, Link
from toolchain.plan import memory as mem
from toolchain.plan.perf.efficiency import DEFAULT_EFFICIENCY, Efficiency
from toolchain.quant.view import Quantization

ACT_BYTES = 2  # activations travel between ranks in the half type (fp16/bf16) under every weight format


# ----------------------------------------------------------------------------------------------- one rank


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
    (QK^T and PV, a multiply and an add each) x layers."""


def stage_cost(p: ArchParams, *, tp: int, pp_rank: int, pp: int, quant: Quantization, dt_bytes: int, kv_bytes: int,
               qkv_bias: bool = False, dense_bias: bool = False, moe_tp: int | None = None,
               moe_ep: int | None = None) -> StageCost:
    """The cost figures of one rank of stage `pp_rank` (every rank of a stage holds the same shapes)."""
    layout = Layout(tp, pp, moe_tp, moe_ep)
    stage = layout.stage_layers(p.num_hidden_layers)[pp_rank]
    layers = len(stage)
    moe_layers = sum(1 for i in stage if p.is_moe_layer(i))  # all of a MoE model's but Llama 4's or DeepSeek's dense ones
    w = mem.rank_weights(p, tp=tp, pp_rank=pp_rank, pp=pp, quant=quant, dt_bytes=dt_bytes, qkv_bias=qkv_bias,
                         dense_bias=dense_bias, moe_tp=moe_tp, moe_ep=moe_ep)
    read = w.layers + w.norms + w.lm_head
    last = pp_rank == pp - 1
    if last and w.lm_head == 0:  # a tied table serves as the lm_head, read whole every step
        read += w.embedding
    shapes = mem.linear_shapes(p, tp, quant)
    gemm = 2.0 * sum(out * inp * (layers - moe_layers if name in mem.MLP_LINEARS else layers)
                     for name, out, inp in shapes)
    expert_bytes, experts, share = 0.0, 0, 0.0
    if moe_layers:
        m_tp, m_ep = layout.moe_tp, layout.moe_ep
        width = p.expert_size // m_tp  # moe_intermediate_size where the family has one (Qwen MoE), as memory.expert_bytes
        experts = layout.experts_per_rank(p.num_experts)
        share = p.top_k / p.num_experts
        # fc (w3, w1) and proj in the engine's format, as memory.expert_bytes counts them
        routed = quant.on("experts")  # a stored format may hold the experts alone (MXFP4)
        per_expert_layer = (mem.linear_bytes(2 * width, p.hidden_size, routed, dt_bytes)
                            + mem.linear_bytes(p.hidden_size, width, routed, dt_bytes))
        expert_bytes = per_expert_layer * moe_layers
        read -= experts * expert_bytes
        # a token runs top_k experts, of which top_k / moe_ep on average live on this rank; and the router
        gemm += (2.0 * 3 * width * p.hidden_size * p.top_k / m_ep + 2.0 * p.num_experts * p.hidden_size) * moe_layers
        # a shared expert (Qwen2-MoE, Llama 4) runs for every token: its tp slice of fc and proj, and its gate if any
        shared = (3 * p.shared_expert_size // tp + int(p.shared_expert_gated)) * p.hidden_size
        gemm += 2.0 * shared * moe_layers if p.shared_expert_size else 0.0
    lm_head = 2.0 * (mem.padded_vocab(p, tp) // tp) * p.hidden_size if last else 0.0
    heads = p.num_attention_heads // tp
    return StageCost(layers, p.hidden_size, read, expert_bytes, experts, share, gemm, lm_head,
                     mem.kv_bytes_per_token(p, tp=tp, stage_layer_count=layers, kv_bytes=kv_bytes),
                     4.0 * heads * p.head_size * layers)


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

    @property
    def seconds(self) -> float:
        # the all-reduce waits for the kernels before it
        if self.serial:
            kernels = self.memory_s + self.compute_s
        else:
            kernels = max(self.memory_s, self.compute_s) if self.kernels_s is None else self.kernels_s
        return kernels + self.comm_s + self.fixed_s

    @property
    def bound(self) -> str:
        """Which term dominates: "memory", "compute" or "communication"."""
        terms = {"memory": self.memory_s, "compute": self.compute_s, "communication": self.comm_s}
        return max(terms, key=lambda k: terms[k])


@dataclass(frozen=True)
class Work:
    """What one step runs on one rank: tokens through the linears, rows of logits, cached tokens read, and
    (query, key) pairs of attention."""

    tokens: float
    logits: float
    kv_read: float
    pairs: float

    def scaled(self, factor: float) -> "Work":
        return Work(self.tokens * factor, self.logits * factor, self.kv_read * factor, self.pairs * factor)


def gpu_step_time(cost: StageCost, gpu: Gpu, work: Work, *, math_precision: str = "fp16", tp: int = 1,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """One step of one rank on a GPU: memory time, compute time and all-reduce time (2 per layer when tp > 1)."""
    assert gpu.bandwidth_gb_s is not None and gpu.link is not None
    half = gpu.peak("fp16")
    assert half is not None
    gemm_peak = gpu.peak(math_precision) or half
    bandwidth = gpu.bandwidth_gb_s * 1e9 * eff.bandwidth
    linear_bytes = cost.weight_bytes + experts_touched(cost, work.tokens) * cost.expert_bytes
    kv_bytes = (work.kv_read + work.tokens) * cost.kv_bytes_per_token  # read the cache, write the new tokens
    linear_flops = (work.tokens * cost.gemm_flops / (gemm_peak * 1e12 * eff.compute)
                    + work.logits * cost.lm_head_flops / (half * 1e12 * eff.compute))
    attention_flops = work.pairs * cost.attention_flops / (half * 1e12 * eff.compute)
    memory_s = (linear_bytes + kv_bytes) / bandwidth
    compute_s = linear_flops + attention_flops
    kernels_s = max(linear_bytes / bandwidth, linear_flops) + max(kv_bytes / bandwidth, attention_flops)
    comm_s = 0.0
    if tp > 1 and work.tokens > 0:
        link = dataclasses.replace(gpu.link, latency_us=gpu.link.latency_us * eff.latency)
        comm_s = 2 * cost.layers * allreduce_seconds(work.tokens * cost.hidden * ACT_BYTES, tp, link, eff.link)
    fixed_s = (eff.fixed_us + eff.seq_us * work.logits) * 1e-6
    return StepTime(memory_s, compute_s, comm_s, fixed_s, kernels_s)


def generation_work(batch: float, context: float, tokens_per_seq: int = 1) -> Work:
    """A generation step of `batch` sequences of `context` cached tokens, each running `tokens_per_seq` tokens
    (1, or 1 + the draft length when the step verifies drafts)."""
    return Work(batch * tokens_per_seq, batch * tokens_per_seq, batch * context, batch * tokens_per_seq * context)


def context_work(tokens: int, start: int = 0) -> Work:
    """A context (prefill) chunk of `tokens` prompt tokens after `start` already cached: its tokens attend
    causally to the cache and to each other; one row of logits (its last token, when the chunk ends the prompt)."""
    pairs = tokens * start + tokens * (tokens + 1) / 2
    return Work(tokens, 1, start, pairs)


def add(*works: Work) -> Work:
    return Work(sum(w.tokens for w in works), sum(w.logits for w in works), sum(w.kv_read for w in works),
                sum(w.pairs for w in works))

