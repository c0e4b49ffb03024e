"""The performance model: how fast a deployment serves, predicted from the same facts as its memory plan.

A step of the engine on one rank costs the larger of its memory time (the weights it reads once per step, the
experts its tokens touch, the KV cache its sequences read and write, over the card's bandwidth) and its compute
time (2 FLOPs per weight per token at the format's tensor-core peak, attention at the half-precision peak), plus
its tensor-parallel all-reduces (two per layer, of the step's activations, ring formula). A pipeline runs
`pp` micro-batches through its stages, so a step takes `pp` times its slowest stage's time, and fewer sequences
than stages leave the bubble idle. In-flight batching in steady state at concurrency C mixes the generation
tokens of the requests past their prompt with chunks of the prompts of the others, within `max_num_tokens`; TTFT,
TPOT and throughput follow from that mix (`Schedule`), and the maximum throughput is the best concurrency up to
the largest batch the limits and the KV cache allow, as `trtllm-bench throughput` measures it (uniform ISL/OSL,
every request sent at once: TensorRT-LLM docs/source/performance/perf-overview.md).

A pure roofline is optimistic, so every time is divided by an achieved fraction of the datasheet figure
(`Efficiency`, one row per GPU generation). The rows are uncalibrated defaults and the output says so
(`basis`); fitting them to measurements is a later step that replaces the table, not the formulas.
Pure functions of the model's parameters, the format's bytes (quant/formats.py through plan/memory.py) and the
GPU table (gpus.py): nothing here reads weights or runs anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from toolchain.archs.moe import moe_sizes
from toolchain.archs.params import ArchParams
from toolchain.gpus import Gpu, Link
from toolchain.plan import memory as mem
from toolchain.plan.model import DTYPE_BYTES, ModelInfo, QuantFormat, kv_dtype, kv_dtype_bytes, weight_dtype
from toolchain.plan.plan import MemoryPlan
from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.targets import CPU, target_of

ACT_BYTES = 2  # activations travel between ranks in the half type (fp16/bf16) under every weight format


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the datasheet: memory bandwidth, dense tensor-core peak, interconnect bandwidth."""

    bandwidth: float
    compute: float
    link: float
    fixed_us: float = 0.0
    """A fixed cost per step of a rank in microseconds (kernel launches, the scheduler): 0 in the uncalibrated
    table, a term for calibration to fit; it is what keeps a tiny model from the roofline's extreme rates."""


# Defaults per GPU generation (gpus.Gpu.arch), uncalibrated: one row for all until measurements fit them.
# bandwidth: the share of the datasheet bandwidth a step's bytes move at, what Databricks' "LLM Inference
#   Performance Engineering: Best Practices" (2023) calls model bandwidth utilization (MBU); a streaming copy gets
#   closest to the datasheet, a decode step's GEMVs and attention kernels less: 0.8 until calibrated.
# compute: the share of the dense peak the GEMMs and attention reach (model FLOPs utilization); large GEMMs get
#   near the peak, inference's skinny ones less: 0.7 until calibrated.
# link: the share of one direction of the link an all-reduce moves data at, which nccl-tests reports as "bus
#   bandwidth" (NVIDIA/nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for an all-reduce): 0.8.
# The target, +-20% of NVIDIA's published trtllm-bench figures, is for the calibrated table; until then
# `basis` says the numbers rest on these defaults.
DEFAULT_EFFICIENCY = Efficiency(bandwidth=0.80, compute=0.70, link=0.80)
EFFICIENCY: dict[str, Efficiency] = {arch: DEFAULT_EFFICIENCY for arch in ("Ampere", "Ada", "Hopper", "Blackwell")}
BASIS = "roofline x default efficiencies, uncalibrated"


def efficiency_of(gpu: Gpu) -> Efficiency:
    return EFFICIENCY.get(gpu.arch, DEFAULT_EFFICIENCY)


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


def stage_cost(p: ArchParams, *, tp: int, pp_rank: int, pp: int, quant: QuantFormat, dt_bytes: int, kv_bytes: int,
               qkv_bias: bool = False, dense_bias: bool = False, moe_tp: int | None = None,
               moe_ep: int | None = None) -> StageCost:
    """The cost figures of one rank of stage `pp_rank` (every rank of a stage holds the same shapes)."""
    layers = len(mem.stage_layers(p.num_hidden_layers, pp)[pp_rank])
    w = mem.rank_weights(p, tp=tp, pp_rank=pp_rank, pp=pp, quant=quant, dt_bytes=dt_bytes, qkv_bias=qkv_bias,
                         dense_bias=dense_bias, moe_tp=moe_tp, moe_ep=moe_ep)
    read = w.layers + w.norms + w.lm_head
    last = pp_rank == pp - 1
    if last and w.lm_head == 0:  # a tied table serves as the lm_head, read whole every step
        read += w.embedding
    shapes = mem.linear_shapes(p, tp, quant)
    if p.is_moe:
        shapes = [s for s in shapes if s[0] in ("qkv", "dense")]
    gemm = 2.0 * sum(out * inp for _, out, inp in shapes) * layers
    expert_bytes, experts, share = 0.0, 0, 0.0
    if p.is_moe:
        m_tp, m_ep = moe_sizes(tp, moe_tp, moe_ep)
        width = p.intermediate_size // m_tp
        experts = p.num_experts // m_ep
        share = p.top_k / p.num_experts
        # fc (w3, w1) and proj in the engine's format, as memory.expert_bytes counts them
        per_expert_layer = (mem.linear_bytes(2 * width, p.hidden_size, quant, dt_bytes)
                            + mem.linear_bytes(p.hidden_size, width, quant, dt_bytes))
        expert_bytes = per_expert_layer * layers
        read -= experts * expert_bytes
        # a token runs top_k experts, of which top_k / moe_ep on average live on this rank; and the router
        gemm += (2.0 * 3 * width * p.hidden_size * p.top_k / m_ep + 2.0 * p.num_experts * p.hidden_size) * layers
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

    @property
    def seconds(self) -> float:
        # Memory and compute overlap within a kernel; the all-reduce waits for both.
        return max(self.memory_s, self.compute_s) + self.comm_s + self.fixed_s

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


def step_time(cost: StageCost, gpu: Gpu, work: Work, *, math_precision: str = "fp16", tp: int = 1,
              eff: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """One step of one rank: memory time, compute time and all-reduce time (2 per layer when tp > 1)."""
    assert gpu.bandwidth_gb_s is not None and gpu.link is not None
    half = gpu.peak("fp16")
    assert half is not None
    gemm_peak = gpu.peak(math_precision) or half
    nbytes = (cost.weight_bytes + experts_touched(cost, work.tokens) * cost.expert_bytes
              + (work.kv_read + work.tokens) * cost.kv_bytes_per_token)  # read the cache, write the new tokens
    memory_s = nbytes / (gpu.bandwidth_gb_s * 1e9 * eff.bandwidth)
    compute_s = (work.tokens * cost.gemm_flops / (gemm_peak * 1e12 * eff.compute)
                 + (work.logits * cost.lm_head_flops + work.pairs * cost.attention_flops) / (half * 1e12 * eff.compute))
    comm_s = 0.0
    if tp > 1 and work.tokens > 0:
        comm_s = 2 * cost.layers * allreduce_seconds(work.tokens * cost.hidden * ACT_BYTES, tp, gpu.link, eff.link)
    return StepTime(memory_s, compute_s, comm_s, eff.fixed_us * 1e-6)


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


# ------------------------------------------------------------------------------------------- a deployment


@dataclass(frozen=True)
class Deployment:
    """Everything the schedule reads about one replica (tp x pp GPUs) of the deployment."""

    gpu: Gpu
    stages: tuple[StageCost, ...]
    tp: int
    math_precision: str
    eff: Efficiency
    draft: StageCost | None = None
    """A draft_target draft model (tp 1, all layers, on rank 0's GPU), run draft_len times per step."""
    draft_len: int = 0
    tokens_per_step: float = 1.0
    """Tokens a generating sequence gains per step: 1 + acceptance x draft_len."""

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def iteration(self, work: Work, sequences: float, generating: float = 0.0, context: float = 0.0,
                  whole: Work | None = None) -> tuple[float, StepTime]:
        """Seconds of one engine iteration running `work` for `sequences` sequences (`generating` of them past
        their prompt, with `context` cached tokens each: the draft model drafts for those), and the slowest
        stage's step. With pp > 1 the batch splits into min(pp, sequences) micro-batches that follow each other
        through the stages: each token crosses every stage (pp stage times and pp - 1 transfers), and with fewer
        micro-batches than stages the rest of the pipeline idles (the bubble). `whole` is work of one sequence
        that stays in one micro-batch (a prompt chunk whose TTFT is asked), on top of its share of `work`."""
        micro = max(1, min(self.pp, math.floor(sequences))) if self.pp > 1 else 1
        part = work.scaled(1 / micro)
        if whole is not None:
            part = add(part, whole)
        steps = [step_time(c, self.gpu, part, math_precision=self.math_precision, tp=self.tp, eff=self.eff)
                 for c in self.stages]
        slowest = max(steps, key=lambda s: s.seconds)
        assert self.gpu.link is not None
        seconds = self.pp * slowest.seconds
        if self.pp > 1:
            seconds += (self.pp - 1) * transfer_seconds(part.tokens * self.stages[0].hidden * ACT_BYTES,
                                                        self.gpu.link, self.eff.link)
        if self.draft is not None and self.draft_len and generating > 0:
            draft = step_time(self.draft, self.gpu, generation_work(generating, context), eff=self.eff)
            seconds += self.draft_len * draft.seconds
        return seconds, slowest


@dataclass(frozen=True)
class Workload:
    isl: int
    osl: int
    max_num_tokens: int
    chunked: bool = True
    """Chunked context: a prompt runs in chunks of max_num_tokens; else whole in one step."""

    @property
    def chunk(self) -> int:
        return min(self.isl, self.max_num_tokens) if self.chunked else self.isl

    @property
    def context_steps(self) -> int:
        return math.ceil(self.isl / self.chunk)

    @property
    def prior_tokens(self) -> int:
        """Cached prompt tokens the chunks of one prompt read before their own: sum of each chunk's start."""
        return sum(min(j * self.chunk, self.isl) for j in range(self.context_steps))


@dataclass(frozen=True)
class Point:
    """The steady state at one concurrency."""

    concurrency: int
    output_tokens_per_s: float
    ttft_s: float
    tpot_s: float
    context_bound: str
    generation_bound: str


def steady_state(dep: Deployment, w: Workload, concurrency: int) -> Point:
    """In-flight batching with `concurrency` requests always in the system (a closed loop, or trtllm-bench's
    queue that refills a slot as soon as a request ends), over one cycle of I iterations in which each of the C
    slots serves one request.

    A request spends cs = `context_steps` iterations on its prompt (its first token comes from the last) and
    gen_steps = (osl - 1) / tokens_per_step generating. The C prompts of a cycle ride in P iterations, as many as
    max_num_tokens (less the generation tokens beside them) needs and at least cs; when P exceeds a request's life
    the prompts queue and the cycle stretches to P iterations. The cycle is P mixed iterations (prompt tokens of
    r = C cs / P requests beside the others' generation tokens) and I - P generation-only ones; a request not on
    its prompt generates in gen_steps of its I - cs other iterations. Throughput = C x osl / cycle. TPOT is the
    mean iteration a request sees while it generates (the P - cs that carry other prompts, and the rest); TTFT is
    its own chunks beside the others' generation tokens, after half of the generation iteration it arrives
    behind, without queueing."""
    c, cs = concurrency, w.context_steps
    verify = 1 + dep.draft_len
    gen_steps = max(w.osl - 1, 0) / dep.tokens_per_step
    context = w.isl + w.osl / 2  # the mean cache of a generating sequence
    iters, prompts_iters = cs + gen_steps, cs
    for _ in range(4):  # the room for prompts depends on the cycle's length and the length on that room
        busy = gen_steps / (iters - cs) if iters > cs else 0.0  # the chance a request off its prompt generates
        g_mixed = (c - c * cs / prompts_iters) * busy
        room = max(w.max_num_tokens - g_mixed * verify, 1.0)
        if w.chunked:  # prompt tokens fill the room left; one prompt's chunks take cs iterations
            prompts_iters = max(math.ceil(c * w.isl / room), cs)
        else:  # whole prompts only: as many as fit the room share an iteration
            prompts_iters = math.ceil(c / max(1, int(room // w.isl)))
        iters = max(cs + gen_steps, prompts_iters)
    busy = gen_steps / (iters - cs) if iters > cs else 0.0
    in_prompt = c * cs / prompts_iters
    g_mixed, g_plain = (c - in_prompt) * busy, c * busy
    per = c / prompts_iters  # prompts' worth of tokens per mixed iteration
    prefill = Work(per * w.isl, per, per * w.prior_tokens, per * w.isl * (w.isl + 1) / 2)
    mixed, _ = dep.iteration(add(generation_work(g_mixed, context, verify), prefill), g_mixed + in_prompt,
                             g_mixed, context)
    plain, gen_step = dep.iteration(generation_work(g_plain, context, verify), g_plain, g_plain, context)
    cycle = prompts_iters * mixed + (iters - prompts_iters) * plain
    throughput = c * w.osl / cycle if cycle > 0 else 0.0
    seen = iters - cs
    tpot = ((prompts_iters - cs) * mixed + (iters - prompts_iters) * plain) / seen / dep.tokens_per_step \
        if seen > 0 else 0.0

    others_gen = generation_work(g_mixed, context, verify)
    wait = 0.5 * dep.iteration(others_gen, g_mixed, g_mixed, context)[0] if g_mixed > 0 else 0.0
    ttft = wait
    context_step: StepTime | None = None
    for j in range(cs):
        start = j * w.chunk
        chunk = context_work(min(w.chunk, w.isl - start), start)
        t, slow = dep.iteration(others_gen, g_mixed + 1, g_mixed, context, whole=chunk)
        ttft += t
        context_step = context_step or slow
    assert context_step is not None
    if g_plain == 0:  # one output token: the bound of a generation step of the batch all the same
        gen_step = dep.iteration(generation_work(c, context, verify), c)[1]
    return Point(c, throughput, ttft, tpot, context_step.bound, gen_step.bound)


def batch_candidates(limit: int) -> list[int]:
    """The concurrencies tried for the maximum: every one up to 64, then 64 steps up to `limit` (the throughput
    curve is smooth there, and a plan stays quick whatever the KV cache holds)."""
    limit = max(limit, 1)
    return sorted({*range(1, min(limit, 64) + 1), *(max(1, round(limit * k / 64)) for k in range(1, 65))})


def best_point(dep: Deployment, w: Workload, limit: int) -> Point:
    """The concurrency up to `limit` with the highest output throughput (the smallest such on a tie)."""
    best: Point | None = None
    for c in batch_candidates(limit):
        point = steady_state(dep, w, c)
        if best is None or point.output_tokens_per_s > best.output_tokens_per_s * (1 + 1e-9):
            best = point
    assert best is not None
    return best


# ------------------------------------------------------------------------------------------- the spec


@dataclass
class Performance:
    """The `performance` object of `toolchain plan`."""

    max_output_tokens_per_s: float
    per_gpu_output_tokens_per_s: float
    batch_size_at_max: int
    batch_limit: int
    batch_limited_by: str
    concurrency: int
    ttft_ms: float
    tpot_ms: float
    bound: dict[str, str]
    usd_per_million_output_tokens: float | None
    basis: str
    workload: dict[str, int]
    tokens_per_step: float
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"predicted": True,
                "max_output_tokens_per_s": round(self.max_output_tokens_per_s, 1),
                "per_gpu_output_tokens_per_s": round(self.per_gpu_output_tokens_per_s, 1),
                "batch_size_at_max": self.batch_size_at_max,
                "batch_limit": self.batch_limit, "batch_limited_by": self.batch_limited_by,
                "concurrency": self.concurrency, "ttft_ms": round(self.ttft_ms, 2), "tpot_ms": round(self.tpot_ms, 3),
                "bound": self.bound,
                "usd_per_million_output_tokens": None if self.usd_per_million_output_tokens is None
                else round(self.usd_per_million_output_tokens, 4),
                "basis": self.basis, "workload": self.workload, "tokens_per_step": round(self.tokens_per_step, 3),
                "notes": self.notes}


def unavailable(spec, device: Gpu | None, memory: MemoryPlan | None) -> str | None:
    """Why no prediction is made for this spec, or None when one is."""
    if target_of(spec).device == CPU:
        return "predicted for GPU targets only (probe-host comes later)"
    if device is None:
        return "no GPU named: set gpu.name to one from the GPU table"
    if not device.has_performance:
        return (f"no bandwidth, peak or interconnect figures for '{device.name}': set gpu.name to one from the GPU "
                "table")
    if memory is None or not memory.fits:
        return "the deployment does not fit (see the verdict), so it has no throughput"
    return None


def acceptance(spec) -> tuple[float, str | None]:
    """(expected share of draft tokens accepted, a note when none is assumed)."""
    sp = spec.speculative
    if sp.mode == "none":
        return 0.0, None
    if sp.expected_acceptance is not None:
        return sp.expected_acceptance, None
    default = mode_of(sp.mode).expected_acceptance
    if default is not None:
        return default, None
    return 0.0, (f"speculative.mode {sp.mode}: no acceptance assumed (its draft tokens only cost); set "
                 "speculative.expected_acceptance to the share you expect accepted")


def deployment(spec, model: ModelInfo, quant: QuantFormat, device: Gpu, draft: ModelInfo | None = None,
               eff: Efficiency | None = None) -> tuple[Deployment, list[str]]:
    """The replica the spec describes, and notes on what the prediction assumes."""
    p, par = model.params, spec.parallelism
    dt_bytes = DTYPE_BYTES[weight_dtype(spec, p)]
    kv_bytes = kv_dtype_bytes(kv_dtype(spec, p, quant))
    stages = tuple(stage_cost(p, tp=par.tp, pp_rank=r, pp=par.pp, quant=quant, dt_bytes=dt_bytes, kv_bytes=kv_bytes,
                              qkv_bias=model.qkv_bias, dense_bias=model.dense_bias, moe_tp=par.moe_tp,
                              moe_ep=par.moe_ep) for r in range(par.pp))
    notes: list[str] = []
    sp = spec.speculative
    draft_len = sp.max_draft_len if sp.mode != "none" else 0
    if sp.mode != "none" and draft_len == 0:
        notes.append(f"speculative.mode {sp.mode}: the draft length comes from the checkpoint, which plan does "
                     "not read; predicted as one token per step")
    share, note = acceptance(spec)
    if note:
        notes.append(note)
    draft_cost = None
    if mode_of(sp.mode).adds == DRAFT_ENGINE and draft is not None:
        dp = draft.params
        ddt = DTYPE_BYTES[weight_dtype(spec, dp)]
        draft_cost = stage_cost(dp, tp=1, pp_rank=0, pp=1, quant=QuantFormat(), dt_bytes=ddt, kv_bytes=ddt)
    elif mode_of(sp.mode).adds == DRAFT_ENGINE:
        notes.append("the draft model's config is not readable: its steps are not counted")
    if mode_of(sp.mode).adds != DRAFT_ENGINE and draft_len:
        notes.append(f"speculative.mode {sp.mode}: drafting networks counted only as the tokens they add to a step")
    dep = Deployment(device, stages, par.tp, quant.format.math, eff or efficiency_of(device), draft_cost,
                     draft_len, 1.0 + share * draft_len)
    return dep, notes


def predict(spec, model: ModelInfo, quant: QuantFormat, device: Gpu, memory: MemoryPlan,
            draft: ModelInfo | None = None, eff: Efficiency | None = None) -> Performance:
    """TTFT and TPOT at validation.workload.concurrency, and the maximum output throughput, of a spec that fits."""
    dep, notes = deployment(spec, model, quant, device, draft, eff)
    wl, lim = spec.validation.workload, spec.limits
    w = Workload(wl.input_tokens, wl.output_tokens, lim.max_num_tokens, spec.build.chunked_context)
    if w.isl > lim.max_input_len or w.isl + w.osl > lim.max_seq_len:
        notes.append(f"the workload's {w.isl} + {w.osl} tokens exceed limits.max_input_len {lim.max_input_len} or "
                     f"max_seq_len {lim.max_seq_len}: the engine would refuse such requests")
    if not w.chunked and w.isl > lim.max_num_tokens:
        notes.append(f"input_tokens {w.isl} > limits.max_num_tokens without build.chunked_context: "
                     "predicted as one context step, which the engine would refuse")
    tpb = spec.build.tokens_per_block
    seq = math.ceil((w.isl + w.osl + dep.draft_len) / tpb) * tpb
    limits = {"max_batch_size": lim.max_batch_size, "kv_cache": memory.kv_tokens_capacity // seq,
              "max_num_tokens": lim.max_num_tokens // (1 + dep.draft_len)}
    limited_by = min(limits, key=lambda k: limits[k])
    limit = limits[limited_by]
    if limit < 1:
        notes.append(f"not one {seq}-token request fits ({limited_by}); predicted at batch 1")
        limit = 1
    best = best_point(dep, w, limit)
    c = wl.concurrency
    if c > limit:
        notes.append(f"validation.workload.concurrency {c} is above the batch limit {limit} ({limited_by}): "
                     f"TTFT and TPOT predicted at {limit}, without the queueing the rest would see")
        c = limit
    at = steady_state(dep, w, c)
    usd = None
    hourly = spec.gpu.hourly_usd
    if hourly is not None and best.output_tokens_per_s > 0:
        usd = hourly * dep.gpus / (best.output_tokens_per_s * 3600) * 1e6
    basis = BASIS if (eff or efficiency_of(device)) == DEFAULT_EFFICIENCY else "roofline x given efficiencies"
    return Performance(best.output_tokens_per_s, best.output_tokens_per_s / dep.gpus, best.concurrency, limit,
                       limited_by, c, at.ttft_s * 1e3, at.tpot_s * 1e3,
                       {"context": at.context_bound, "generation": at.generation_bound}, usd, basis,
                       {"input_tokens": w.isl, "output_tokens": w.osl, "concurrency": wl.concurrency},
                       dep.tokens_per_step, notes)


def performance_dict(spec, model: ModelInfo | None, quant: QuantFormat, device: Gpu | None,
                     memory: MemoryPlan | None, draft: ModelInfo | None = None) -> dict:
    """`toolchain plan`'s performance object: the prediction, or why there is none."""
    reason = unavailable(spec, device, memory) if model is not None else "the model's config is not readable"
    if reason is not None:
        return {"predicted": False, "note": reason}
    assert model is not None and device is not None and memory is not None
    return predict(spec, model, quant, device, memory, draft).as_dict()
