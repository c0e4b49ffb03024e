"""This host as the model's device: `toolchain probe-host`'s profile laid out as a GPU row (`HostRow`), and the
CPU engine's step, whose kernels run one after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolchain.gpus import Gpu, Link
from toolchain.hostprofile import HostProfile
from toolchain.plan.perf import kernel_step
from toolchain.plan.perf.efficiency import DEFAULT_EFFICIENCY, Efficiency
from toolchain.plan.perf.step import (StageCost, StepTime, Work, allreduce_seconds, experts_touched, gpu_step_time,
                                      sequences)

# ------------------------------------------------------------------------------------------- this host


HOST_ACT_BYTES = 4  # the CPU engine's activations are float32 (engine/cpu/weights.py computes in fp32)
CPU_PRECISION = {None: "fp32", "int8_wo": "int8_wo", "int4_wo": "int4_wo", "int4_group": "int4_wo", "sq": "int8",
                 "fp8": "fp32", "nvfp4": "fp32", "fp8_block": "fp32"}
"""The kernel precision of each CPU kernel (quant/formats.py `cpu_kernel`, engine/cpu/qlinear.py): float weights
are widened to float32 at load; weight-only int8/int4 run torch's packed kernels on bf16 activations; SmoothQuant
runs torch._int_mm; FP8, NVFP4 and FP8 block scales are emulated over float32 weights widened at load (their
per-call activation rounding is not counted)."""


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
    if cost.lora is not None:  # the adapters' float32 shrink and expand GEMMs, each adapter read once
        kernels.append((cost.lora.bytes_read(sequences(work)) / bw,
                        work.tokens * cost.lora.flops_per_token / (host.gemm_tflops("fp32", work.tokens) * 1e12)))
    memory_s = shards * sum(m for m, c in kernels if m >= c)
    compute_s = shards * sum(c for m, c in kernels if c > m)
    comm_s = 0.0
    if tp > shards and work.tokens > 0 and host.link is not None and host.link.gb_s > 0:
        comm_s = 2 * cost.layers * allreduce_seconds(work.tokens * cost.hidden * HOST_ACT_BYTES, tp, host.link)
    return StepTime(memory_s, compute_s, comm_s, (eff.fixed_us + eff.seq_us * work.logits) * 1e-6,
                    serial=True)


def step_time(cost: StageCost, gpu: Gpu, work: Work, *, math_precision: str = "fp16", tp: int = 1,
              eff: Efficiency = DEFAULT_EFFICIENCY, shards: int = 1) -> StepTime:
    """One step of one rank: on a GPU `gpu_step_time`; on this host (a `HostRow`) the CPU engine's step, the
    process running `shards` ranks' shards one after another (serving.launch single)."""
    if isinstance(gpu, HostRow):
        return host_step_time(cost, gpu, work, math_precision=math_precision, tp=tp, eff=eff, shards=shards)
    if eff.kernels and kernel_step.available(cost, gpu, tp):
        return kernel_step.kernel_step_time(cost, gpu, work, math_precision=math_precision, tp=tp, eff=eff)
    return gpu_step_time(cost, gpu, work, math_precision=math_precision, tp=tp, eff=eff)
