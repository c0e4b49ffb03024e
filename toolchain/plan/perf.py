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

A pure roofline is optimistic, so every time is divided by an achieved fraction of the datasheet figure and
fixed costs are added (`Efficiency`, one row per GPU generation). The rows are fitted to public measurements
(data/efficiency.json, made by tools/fit_efficiency.py from AIConfigurator's measured TensorRT-LLM runs;
plan/calibration.py holds the data and the checks), and every prediction names what it rests on (`basis`).
Pure functions of the model's parameters, the format's bytes (quant/formats.py through plan/memory.py) and the
GPU table (gpus.py): nothing here reads weights or runs anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from toolchain.archs.moe import moe_sizes
from toolchain.archs.params import ArchParams
from toolchain.gpus import GPUS, Gpu, Link
from toolchain.hostprofile import HostProfile, load_profile, missing_note
from toolchain.plan import memory as mem
from toolchain.plan.model import DTYPE_BYTES, ModelInfo, QuantFormat, kv_dtype, kv_dtype_bytes, weight_dtype
from toolchain.plan.model import load_model, quant_format
from toolchain.plan.plan import DraftModel, MemoryPlan, plan_memory
from toolchain import gpus
from toolchain.errors import ToolchainError
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
    """A fixed cost per step of a rank in microseconds (kernel launches, the scheduler): 0 in the documented
    defaults, fitted per generation; it is what keeps a tiny model from the roofline's extreme rates."""
    latency: float = 1.0
    """The fixed cost of one tensor-parallel all-reduce as a multiple of the link's default (gpus.Link.latency_us):
    a decode step of a TP group runs two per layer, so calibration fits it; a multiple carries over to a card
    whose link was not measured (PCIe's default is higher than NVLink's)."""
    seq_us: float = 0.0
    """A cost per sequence that a step samples a token for (a row of logits), in microseconds: sampling and the
    runtime's per-request work each iteration, which grow with the batch, not with the model. Fitted for GPUs;
    measured on this host by probe-host for the CPU engine (sampling in Python, its bookkeeping, handing the token out)."""
    ttft_ms: float = 0.0
    """What a request spends before its first iteration (receiving, tokenizing, scheduling) and after its first
    token (detokenizing, sending), in milliseconds, added to TTFT only."""


# The documented defaults, for what the fit does not reach (and the hand-computed tests' reference):
# bandwidth: the share of the datasheet bandwidth a step's bytes move at, what Databricks' "LLM Inference
#   Performance Engineering: Best Practices" (2023) calls model bandwidth utilization (MBU); a streaming copy gets
#   closest to the datasheet, a decode step's GEMVs and attention kernels less: 0.8.
# compute: the share of the dense peak the GEMMs and attention reach (model FLOPs utilization); large GEMMs get
#   near the peak, inference's skinny ones less: 0.7.
# link: the share of one direction of the link an all-reduce moves data at, which nccl-tests reports as "bus
#   bandwidth" (NVIDIA/nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for an all-reduce): 0.8.
DEFAULT_EFFICIENCY = Efficiency(bandwidth=0.80, compute=0.70, link=0.80)

FITTED_FILE = Path(__file__).resolve().parent / "data" / "efficiency.json"
"""The fitted rows with their provenance: made by tools/fit_efficiency.py from data/silicon_points.json
(AIConfigurator 0.12.0's measured TensorRT-LLM runs); plan/calibration.py recomputes its held-out error."""
FITTED: dict = json.loads(FITTED_FILE.read_text())
CARRIED_FROM = "Hopper"
"""The generation whose fitted row a generation with neither measurements nor a derived row takes. The table's
derived rows (FITTED["derived"]: Ampere, Ada) are Hopper's scaled by AIConfigurator's kernel measurements of
those cards (tools/fit_efficiency.py derive_rows): their fixed costs (per step, per all-reduce as a multiple of
the card's own link latency, per sequence, per request) come from the host and the same TensorRT-LLM software,
so they carry over. The basis says which kind of row a card gets."""
EFFICIENCY: dict[str, Efficiency] = {arch: Efficiency(**row) for arch, row in FITTED["rows"].items()}
for _arch in ("Ampere", "Ada", "Hopper", "Blackwell"):
    EFFICIENCY.setdefault(_arch, EFFICIENCY.get(CARRIED_FROM, DEFAULT_EFFICIENCY))
BASIS = "roofline x efficiencies fitted to AIConfigurator 0.12.0 silicon samples"
"""The start of every fitted prediction's `basis`; `basis_of` completes it for a card."""


def efficiency_of(gpu: Gpu) -> Efficiency:
    return EFFICIENCY.get(gpu.arch, DEFAULT_EFFICIENCY)


def basis_of(gpu: Gpu) -> str:
    """What a prediction on `gpu` rests on: the fit (the runs of its generation it was fitted to, with their
    TensorRT-LLM versions, and the held-out error), and whether this card itself, its generation, or neither was
    measured end to end."""
    held = FITTED["holdout_mape"]
    error = (f"held-out MAPE TPOT {held['tpot']:.0f}%, throughput {held['throughput']:.0f}%, "
             f"TTFT {held['ttft']:.0f}%")
    measured = FITTED["measured"]
    arch_of = {g.name: g.arch for g in GPUS}
    derived = FITTED.get("derived", {})
    if gpu.arch in derived:
        return f"{BASIS} of {CARRIED_FROM} cards ({error}), for {gpu.name}: {derived[gpu.arch]}"
    arch = gpu.arch if gpu.arch in FITTED["rows"] else CARRIED_FROM
    runs = "; ".join(f"{name}: {what}" for name, what in measured.items() if arch_of.get(name) == arch)
    if gpu.name in measured:
        return f"{BASIS} ({runs}), {error}"
    if arch == gpu.arch:
        return f"{BASIS} ({runs}), carried over to {gpu.name} (not measured), {error}"
    return f"{BASIS} ({runs}), carried over to {gpu.name} ({gpu.arch} not measured), {error}"


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
        width = p.expert_size // m_tp  # moe_intermediate_size where the family has one (Qwen MoE), as memory.expert_bytes
        experts = p.num_experts // m_ep
        share = p.top_k / p.num_experts
        # fc (w3, w1) and proj in the engine's format, as memory.expert_bytes counts them
        per_expert_layer = (mem.linear_bytes(2 * width, p.hidden_size, quant, dt_bytes)
                            + mem.linear_bytes(p.hidden_size, width, quant, dt_bytes))
        expert_bytes = per_expert_layer * layers
        read -= experts * expert_bytes
        # a token runs top_k experts, of which top_k / moe_ep on average live on this rank; and the router
        gemm += (2.0 * 3 * width * p.hidden_size * p.top_k / m_ep + 2.0 * p.num_experts * p.hidden_size) * layers
        # a shared expert (Qwen2-MoE) runs for every token: its tp slice of fc and proj, and its gate
        gemm += 2.0 * (3 * p.shared_expert_size // tp + 1) * p.hidden_size * layers if p.shared_expert_size else 0.0
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


def step_time(cost: StageCost, gpu: Gpu, work: Work, *, math_precision: str = "fp16", tp: int = 1,
              eff: Efficiency = DEFAULT_EFFICIENCY, shards: int = 1) -> StepTime:
    """One step of one rank: memory time, compute time and all-reduce time (2 per layer when tp > 1). On this
    host (a `HostRow`) the process runs `shards` ranks' shards one after another (serving.launch single)."""
    if isinstance(gpu, HostRow):
        return host_step_time(cost, gpu, work, math_precision=math_precision, tp=tp, eff=eff, shards=shards)
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


# ------------------------------------------------------------------------------------------- this host


HOST_ACT_BYTES = 4  # the CPU engine's activations are float32 (engine/cpu/weights.py computes in fp32)
CPU_PRECISION = {None: "fp32", "int8_wo": "int8_wo", "int4_wo": "int4_wo", "int4_group": "int4_wo", "sq": "int8",
                 "fp8": "fp32"}
"""The kernel precision of each CPU kernel (quant/formats.py `cpu_kernel`, engine/cpu/qlinear.py): float weights
are widened to float32 at load; weight-only int8/int4 run torch's packed kernels on bf16 activations; SmoothQuant
runs torch._int_mm; FP8 is emulated over float32 weights widened at load."""


@dataclass(frozen=True)
class HostRow(Gpu):
    """This host as the model's device: its profile (hostprofile.py) laid out as a Gpu row, so one set of
    formulas serves both. `bandwidth_gb_s` is main memory as the engine's matrix-vector product reads it, the peaks
    are the engine's linear kernels at their largest measured row count, and `link` the rank exchange over gloo."""

    cache_gb_s: float = 0.0
    cache_bytes: int = 0
    curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    """Per precision: (rows per call, TFLOP/s) as measured; a call between two row counts interpolates in
    log(rows)."""
    attention_gb_s: float = 0.0
    attention_tflops: float = 0.0

    def weight_gb_s(self, resident: float) -> float:
        """The rate a step reads `resident` bytes of weights at: the cache's when they all fit it (every step
        reads the same weights, so they stay there), main memory's otherwise."""
        assert self.bandwidth_gb_s is not None
        return self.cache_gb_s if 0 < resident <= self.cache_bytes and self.cache_gb_s else self.bandwidth_gb_s

    def gemm_tflops(self, precision: str, rows: float) -> float:
        """TFLOP/s of the engine's linear kernel at `precision` for a call of `rows` rows (fp32's curve for a
        precision not measured), clamped to the measured ends."""
        curve = dict(self.curves).get(precision) or dict(self.curves)["fp32"]
        if rows <= curve[0][0]:
            return curve[0][1]
        for (r0, t0), (r1, t1) in zip(curve, curve[1:], strict=False):
            if rows <= r1:
                f = math.log(rows / r0) / math.log(r1 / r0)
                return t0 + f * (t1 - t0)
        return curve[-1][1]


def host_row(profile: HostProfile, rank_processes: bool = False) -> HostRow:
    """The row of this host; `rank_processes`: the ranks are processes exchanging over gloo (serving.launch
    mpirun), else they share one process and nothing crosses a link."""
    curves = tuple((prec, tuple(sorted((int(r), g / 1e3) for r, g in by_rows.items())))
                   for prec, by_rows in profile.gemm_gflops.items())
    peaks = tuple((prec, c[-1][1]) for prec, c in curves)
    link = Link("gloo", 0.0, 0.0)
    if profile.gloo and rank_processes:  # the served exchange's fixed cost where probe-host measured it (probe_ranks)
        link = Link("gloo", profile.gloo["gb_s"], profile.gloo.get("served_latency_us", profile.gloo["latency_us"]))
    return HostRow(f"this host ({profile.key.cpu}, {profile.key.threads} thread(s))", 0.0, None, kind="host",
                   bandwidth_gb_s=profile.stream_gb_s, peak_tflops=peaks, link=link,
                   cache_gb_s=profile.cache_gb_s, cache_bytes=profile.cache_bytes, curves=curves,
                   attention_gb_s=profile.attention_gb_s, attention_tflops=profile.attention_gflops / 1e3)


def host_efficiency(profile: HostProfile, layers: int, shards: int) -> Efficiency:
    """The measured rates are achieved ones (efficiency 1); the fixed cost of a step is its per-step cost plus the
    probe's per-layer cost for every layer of every shard the process runs, and a cost per sequence. The per-step
    and per-sequence costs are the served path's (engine and serving together, measured through it) where the
    profile has them, else the engine's alone."""
    step_us, sequence_us = profile.step_us, profile.sequence_us
    if profile.serving:  # the served path's own costs, measured through it, stand in for the engine's alone
        step_us, sequence_us = profile.serving["step_us"], profile.serving["sequence_us"]
    return Efficiency(1.0, 1.0, 1.0, fixed_us=step_us + profile.layer_us * layers * shards,
                      seq_us=sequence_us)


def host_step_time(cost: StageCost, host: HostRow, work: Work, *, math_precision: str, tp: int, eff: Efficiency,
                   shards: int) -> StepTime:
    """One step of the CPU engine over `shards` rank shards run one after another. Its kernels do not overlap,
    so each costs the larger of its bytes and its FLOPs and the step their sum: the linears (weights at the cache's
    or memory's rate, FLOPs at the precision's rate for this many rows), the float32 lm_head over the sampled rows,
    and attention (cached K/V gathered out of the paged pool at the measured attention rate, a context's causal
    FLOPs at its own rate)."""
    lm_bytes = 2.0 * cost.lm_head_flops  # its params (flops / 2) in float32
    weights = cost.weight_bytes + experts_touched(cost, work.tokens) * cost.expert_bytes
    bw = host.weight_gb_s(shards * (cost.weight_bytes + cost.experts * cost.expert_bytes)) * 1e9
    kernels = [
        ((weights - lm_bytes) / bw,
         work.tokens * cost.gemm_flops / (host.gemm_tflops(math_precision, work.tokens) * 1e12)),
        (lm_bytes / bw if work.logits else 0.0,
         work.logits * cost.lm_head_flops / (host.gemm_tflops("fp32", work.logits) * 1e12)),
        ((work.kv_read + work.tokens) * cost.kv_bytes_per_token / (host.attention_gb_s * 1e9),
         work.pairs * cost.attention_flops / (host.attention_tflops * 1e12)),
    ]
    memory_s = shards * sum(m for m, c in kernels if m >= c)
    compute_s = shards * sum(c for m, c in kernels if c > m)
    comm_s = 0.0
    if tp > shards and work.tokens > 0 and host.link is not None and host.link.gb_s > 0:
        comm_s = 2 * cost.layers * allreduce_seconds(work.tokens * cost.hidden * HOST_ACT_BYTES, tp, host.link)
    return StepTime(memory_s, compute_s, comm_s, (eff.fixed_us + eff.seq_us * work.logits) * 1e-6,
                    serial=True)


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
    shards: int = 1
    """Rank shards one process runs one after another: tp for the CPU engine in one process, else 1."""

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
        steps = [step_time(c, self.gpu, part, math_precision=self.math_precision, tp=self.tp, eff=self.eff,
                           shards=self.shards) for c in self.stages]
        slowest = max(steps, key=lambda s: s.seconds)
        assert self.gpu.link is not None
        seconds = self.pp * slowest.seconds
        if self.pp > 1 and self.gpu.link.gb_s > 0:  # 0: the stages share one process (the CPU engine)
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
    batch_wait_iters: int = 0
    """TensorRT-LLM's batch_wait_timeout_iters: iterations new prompts are held back to gather more (0: off, the
    default; see `batch_wait`)."""
    batch_wait_ratio: float = 0.0
    """TensorRT-LLM's batch_wait_max_tokens_ratio: held prompts go once the iteration's tokens reach this share of
    max_num_tokens (0: off, the default)."""
    requests: int = 0
    """Requests a benchmark run sends in all, when it sends a fixed number from a standing start: the first C
    arrive together (`first_wave_ttft`) and weigh C / requests in the mean TTFT (`predict` with `bench_run`
    passes a level's validation.workload.num_requests, as `toolchain bench` runs it). 0: the steady state alone
    (`toolchain plan`, tune)."""

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


def generation_alone(dep: Deployment, generating: float, context: float, verify: int = 1) -> float:
    """Seconds of a generation-only iteration of `generating` sequences (0 for none)."""
    if generating <= 0:
        return 0.0
    return dep.iteration(generation_work(generating, context, verify), generating, generating, context)[0]


def arrival_wait(mean_iteration: float, rate: float, prompt_work: float) -> float:
    """What a request of a closed loop in steady state waits before its prompt's first chunk runs.

    Its requests are staggered: each arrives when another ends, at an iteration's end, while the next iteration
    has just started without it; it waits for that one (half an iteration on average: the client's round trip
    eats into it, and at concurrency 1 no iteration runs). Then it queues behind prompts that arrived before
    it and still wait for room: prompts reach the engine at `rate` (C per cycle) and each holds the prompt room
    for `prompt_work` seconds (its chunks' time beyond the generation iterations they displace), a single
    server with utilization rho = rate x work, whose mean wait with random arrivals and fixed service is
    rho x work / (2 (1 - rho)) (the M/D/1 queue: the Pollaczek-Khinchine mean wait rate E[S^2] / (2 (1 - rho))
    with E[S^2] = work^2). rho is kept below 0.95: past that the cycle itself is prompt-bound and steady_state
    stretches it instead."""
    work = max(prompt_work, 0.0)
    rho = min(rate * work, 0.95)
    return 0.5 * mean_iteration + rho * work / (2 * (1 - rho))


def batch_wait(w: Workload, arrivals: float, generating: float) -> tuple[float, float]:
    """(Mean iterations a prompt is held back, prompts released together) under TensorRT-LLM's batch waiting
    (PyExecutor._waiting_requests in tensorrt_llm/_torch/pyexecutor/py_executor.py, which _schedule calls when
    both context and generation requests are scheduled): while generation requests run, waiting prompts are not
    scheduled until batch_wait_timeout_iters iterations have passed since the last release, or the iteration's
    tokens (their prompt tokens and one per generating sequence) reach batch_wait_max_tokens_ratio x
    max_num_tokens; with either setting 0 the test passes at once and nothing waits. A prompt that finds none
    waiting opens a window of W = min(timeout, (k - 1) / a) iterations, k the prompts the threshold needs and a
    the prompts arriving per iteration; the a W that join it later wait W / 2 on average, and all 1 + a W run
    their first chunks in one iteration."""
    if w.batch_wait_iters <= 0 or w.batch_wait_ratio <= 0 or arrivals <= 0:
        return 0.0, 1.0
    need = max(w.batch_wait_ratio * w.max_num_tokens - generating, 0.0)
    k = max(1, math.ceil(need / w.isl))
    window = min(float(w.batch_wait_iters), (k - 1) / arrivals)
    joined = arrivals * window
    return (window + joined * window / 2) / (1 + joined), 1 + joined


def first_wave_ttft(dep: Deployment, w: Workload, concurrency: int) -> float:
    """Mean TTFT of the first `concurrency` requests of a benchmark run, sent together into an idle engine
    (a closed-loop client starts by filling every slot at once: vLLM's benchmark_serving.py with
    --request-rate inf and --max-concurrency C): their prompts fill iterations of max_num_tokens prompt tokens
    one after another (whole prompts when they fit one iteration, as the scheduler packs them), so the k-th
    iteration's prompts see their first token after k such iterations; a prompt longer than max_num_tokens
    runs its own chunks, the prompts one after another."""
    c = max(concurrency, 1)
    if w.chunked and w.isl > w.max_num_tokens:
        one = sum(dep.iteration(context_work(min(w.chunk, w.isl - j * w.chunk), j * w.chunk), 1)[0]
                  for j in range(w.context_steps))
        return one * (c + 1) / 2
    per = max(1, w.max_num_tokens // w.isl)

    def prompts(n: int) -> float:
        return dep.iteration(context_work(w.isl).scaled(n), n)[0]

    full, rest = divmod(c, per)
    total = sum(per * (k + 1) for k in range(full)) * prompts(per)
    if rest:
        total += rest * (full * prompts(per) + prompts(rest))
    return total / c


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
    mean iteration a request sees while it generates (the P - cs that carry other prompts, and the rest). TTFT is
    its own chunks beside the others' generation tokens after its wait for the iteration in flight and the prompts
    ahead of it (`arrival_wait`: the requests are staggered, each arriving as another ends), and with
    `w.requests` the run's first wave (`first_wave_ttft`) weighed in."""
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
    context_step: StepTime | None = None
    own = 0.0  # the request's own chunks, each beside the generation tokens of a mixed iteration
    for j in range(cs):
        start = j * w.chunk
        chunk = context_work(min(w.chunk, w.isl - start), start)
        t, slow = dep.iteration(others_gen, g_mixed + 1.0, g_mixed, context, whole=chunk)
        own += t
        context_step = context_step or slow
    assert context_step is not None
    ttft = own + dep.eff.ttft_ms * 1e-3
    if c > 1 and cycle > 0:
        ttft += arrival_wait(cycle / iters, c / cycle, own - cs * generation_alone(dep, g_mixed, context, verify))
    held, group = batch_wait(w, c / iters, g_plain) if c > 1 and g_plain > 0 else (0.0, 1.0)
    if held > 0:  # held back for generation-only iterations, then released with the prompts that joined it
        ttft += held * generation_alone(dep, g_plain, context, verify)
        chunk = context_work(w.chunk)
        ttft += (dep.iteration(add(others_gen, chunk.scaled(group - 1)), g_mixed + group, g_mixed, context,
                               whole=chunk)[0]
                 - dep.iteration(others_gen, g_mixed + 1.0, g_mixed, context, whole=chunk)[0])
    if w.requests > c:  # the run's first C requests arrive together: 1 in requests / C waves of a benchmark
        wave = first_wave_ttft(dep, w, c) + dep.eff.ttft_ms * 1e-3
        ttft += (wave - ttft) * c / w.requests
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
    output_tokens_per_s: float = 0.0
    """Output throughput at `concurrency`."""

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
                "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "basis": self.basis, "workload": self.workload, "tokens_per_step": round(self.tokens_per_step, 3),
                "notes": self.notes}


def unavailable(spec, device: Gpu | None, memory: MemoryPlan | None, profile: HostProfile | None = None) -> str | None:
    """Why no prediction is made for this spec, or None when one is."""
    if target_of(spec).device == CPU:
        if profile is None:
            return missing_note(spec.serving.engine_threads)
        if spec.parallelism.tp > 1 and spec.serving.launch == "mpirun" and not profile.gloo:
            return "the host profile has no gloo exchange figures for rank processes: run `toolchain probe-host --force`"
        if memory is None or not memory.fits:
            return "the deployment does not fit (see the verdict), so it has no throughput"
        return None
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
               eff: Efficiency | None = None, profile: HostProfile | None = None) -> tuple[Deployment, list[str]]:
    """The replica the spec describes, and notes on what the prediction assumes. With `profile` (a CPU target)
    the device is this host (`host_row`), in the CPU engine's bytes and precisions."""
    p, par = model.params, spec.parallelism
    dt_bytes = DTYPE_BYTES[weight_dtype(spec, p)]
    kv_bytes = kv_dtype_bytes(kv_dtype(spec, p, quant))
    math_precision, shards = quant.format.math, 1
    if profile is not None:
        in_process = spec.serving.launch != "mpirun"
        device = host_row(profile, rank_processes=not in_process)
        math_precision = CPU_PRECISION[quant.format.cpu_kernel]
        dt_bytes = 4  # float weights are widened to float32 at load (engine/cpu/weights.py)
        if quant.format.cpu_kernel == "fp8":  # emulated over float32 weights (engine/cpu/qlinear.py Fp8PerTensor)
            quant = dataclasses.replace(quant, method="none")
        shards = par.tp if in_process else 1
        layers = p.num_hidden_layers if in_process else math.ceil(p.num_hidden_layers / par.pp)
        eff = host_efficiency(profile, layers, shards)
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
    dep = Deployment(device, stages, par.tp, math_precision, eff or efficiency_of(device), draft_cost,
                     draft_len, 1.0 + share * draft_len, shards)
    return dep, notes


def predict(spec, model: ModelInfo, quant: QuantFormat, device: Gpu, memory: MemoryPlan,
            draft: ModelInfo | None = None, eff: Efficiency | None = None, profile: HostProfile | None = None,
            concurrency: int | None = None, bench_run: bool = False) -> Performance:
    """TTFT and TPOT at `concurrency` (default validation.workload.concurrency), and the maximum output
    throughput, of a spec that fits; on this host's CPU engine with `profile`. TTFT is the steady state's (a
    service long running), or with `bench_run` the mean over a `toolchain bench` level, whose num_requests
    requests start with all C at once (Workload.requests; not with duration_s or an open loop)."""
    dep, notes = deployment(spec, model, quant, device, draft, eff, profile)
    wl, lim = spec.validation.workload, spec.limits
    run = bench_run and wl.duration_s is None and wl.mode == "concurrency"
    requests = wl.num_requests if run else 0
    w = Workload(wl.input_tokens, wl.output_tokens, lim.max_num_tokens, spec.build.chunked_context,
                 requests=requests)
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
    c = concurrency or wl.concurrency
    at = queued(dep, w, c, limit)
    if profile is not None and profile.serving:  # a request's way in and its first token's way out
        at = dataclasses.replace(at, ttft_s=at.ttft_s + profile.serving.get("request_us", 0.0) * 1e-6)
        if wl.protocol != profile.serving["protocol"]:
            notes.append(f"what serving adds was measured over {profile.serving['protocol']}, the workload uses "
                         f"{wl.protocol}")
    if c > limit:
        notes.append(f"concurrency {c} is above the batch limit {limit} ({limited_by}): {c - limit} requests wait "
                     f"for a slot, which TTFT includes (Little's law over the cycle at {limit})")
    usd = None
    hourly = spec.gpu.hourly_usd
    if hourly is not None and best.output_tokens_per_s > 0:
        usd = hourly * dep.gpus / (best.output_tokens_per_s * 3600) * 1e6
    if profile is not None:
        basis = f"host profile {profile.date}" + (f" (serving: {profile.serving['protocol']})"
                                                  if profile.serving else " (engine only)")
    else:
        basis = basis_of(device) if eff is None else "roofline x given efficiencies"
    return Performance(best.output_tokens_per_s, best.output_tokens_per_s / dep.gpus, best.concurrency, limit,
                       limited_by, c, at.ttft_s * 1e3, at.tpot_s * 1e3,
                       {"context": at.context_bound, "generation": at.generation_bound}, usd, basis,
                       {"input_tokens": w.isl, "output_tokens": w.osl, "concurrency": c},
                       dep.tokens_per_step, notes, at.output_tokens_per_s)


def queued(dep: Deployment, w: Workload, concurrency: int, limit: int) -> Point:
    """The steady state at `concurrency` when at most `limit` requests run at once: above it the batch runs full
    and the rest queue. A closed loop keeps C requests in the system, so by Little's law each spends C / (request
    rate) in it; what the running ones do not spend on their own service (TTFT + (osl - 1) TPOT at `limit`) is
    the wait for a slot, which its TTFT carries."""
    if concurrency <= limit:
        return steady_state(dep, w, concurrency)
    full = steady_state(dep, w, limit)
    rate = full.output_tokens_per_s / w.osl  # requests per second
    service = full.ttft_s + max(w.osl - 1, 0) * full.tpot_s
    wait = max(concurrency / rate - service, 0.0) if rate > 0 else 0.0
    return dataclasses.replace(full, concurrency=concurrency, ttft_s=full.ttft_s + wait)


def host_profile_of(spec) -> HostProfile | None:
    """This host's cached profile for a CPU target's engine threads (never measured here); None for a GPU
    target or when there is none."""
    if target_of(spec).device != CPU:
        return None
    return load_profile(spec.serving.engine_threads)


def performance_dict(spec, model: ModelInfo | None, quant: QuantFormat, device: Gpu | None,
                     memory: MemoryPlan | None, draft: ModelInfo | None = None, *,
                     concurrency: int | None = None, profile: HostProfile | None = None,
                     bench_run: bool = False) -> dict:
    """`toolchain plan`'s performance object: the prediction, or why there is none. A CPU target is predicted
    from `profile`, by default this host's cached one (`toolchain probe-host`); `bench_run`: as `predict`."""
    profile = profile or host_profile_of(spec)
    reason = unavailable(spec, device, memory, profile) if model is not None else "the model's config is not readable"
    if reason is not None:
        return {"predicted": False, "note": reason}
    assert model is not None and device is not None and memory is not None
    return predict(spec, model, quant, device, memory, draft, profile=profile, concurrency=concurrency,
                   bench_run=bench_run).as_dict()


def predict_spec(spec, concurrency: int | None = None, profile: HostProfile | None = None) -> dict:
    """The performance object of a spec on its own (what `toolchain bench` sets beside its measurement): the
    model's config, the format and the memory plan read as `toolchain plan` reads them, then `performance_dict`
    at `concurrency`, TTFT as the bench's level runs it (`bench_run`: its first wave weighed in). Never raises
    for an unreadable model: the object says why there is no prediction."""
    device = gpus.resolve(spec)
    try:
        model = load_model(spec.model.checkpoint)
    except (ToolchainError, OSError) as err:
        return {"predicted": False, "note": f"the model's config is not readable: {err}"}
    quant = quant_format(spec, model.hf_config)
    draft = None
    sp = spec.speculative
    if sp.mode == "draft_target" and sp.draft_model is not None:
        try:
            draft = load_model(sp.draft_model)
        except (ToolchainError, OSError):
            draft = None
    try:
        memory = plan_memory(spec, model, quant, device, DraftModel(draft) if draft else None) if device else None
    except ToolchainError as err:
        return {"predicted": False, "note": f"no memory plan: {err}"}
    return performance_dict(spec, model, quant, device, memory, draft, concurrency=concurrency, profile=profile,
                            bench_run=True)
