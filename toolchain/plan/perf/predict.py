"""A spec's prediction: the replica it describes, its `Performance` at the workload and at the maximum, and
what `toolchain plan`, `bench` and `tune` read (`performance_dict`, `predict_spec`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from toolchain import gpus
from toolchain.errors import ToolchainError
from toolchain.gpus import Gpu
from toolchain.hostprofile import HostProfile, load_profile, missing_note
from toolchain.plan.model import DTYPE_BYTES, ModelInfo, kv_dtype, kv_dtype_bytes, load_model, weight_dtype
from toolchain.plan.perf.calibrated import IGNORE_ENV, calibrated_row
from toolchain.plan.perf.efficiency import FITTED, KERNEL_ROW_META, Efficiency, basis_of, efficiency_of, kernel_row
from toolchain.plan.perf.error_bars import error_bar, params_billions
from toolchain.plan.perf.host import CPU_PRECISION, host_efficiency, host_row
from toolchain.plan.perf.kernel_step import describe, measured_kernels, unmeasured
from toolchain.plan.perf.lora import lora_load
from toolchain.plan.perf.paths import TRTLLM_VERSION, path_of
from toolchain.plan.perf.schedule import Deployment, Workload, best_point, queued
from toolchain.plan.perf.step import StageCost, stage_cost
from toolchain.plan.plan import DraftModel, MemoryPlan, plan_memory
from toolchain.quant.view import Quantization, quantization_of
from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.targets import target_of

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
    error_bar: dict | None = None
    """A GPU prediction's error bar (perf/error_bars.py: pct, cells, nearest); None on a CPU target, which
    benchmarks/prediction.py checks closed loop instead."""

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
                "notes": self.notes, "error_bar": self.error_bar}


def unavailable(spec, device: Gpu | None, memory: MemoryPlan | None, profile: HostProfile | None = None) -> str | None:
    """Why no prediction is made for this spec, or None when one is."""
    if target_of(spec).predicts_from_host_profile:
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


def deployment(spec, model: ModelInfo, quant: Quantization, device: Gpu, draft: ModelInfo | None = None,
               eff: Efficiency | None = None, profile: HostProfile | None = None,
               release: str | None = None) -> tuple[Deployment, list[str]]:
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
    # The CPU engine runs attention split over tp with or without attention DP (llmapi/cpu_llm.py
    # _check_attention_dp), so only a GPU replica is costed as attention DP's ranks.
    adp = par.attention_dp and profile is None
    stages = tuple(stage_cost(p, tp=par.tp, pp_rank=r, pp=par.pp, quant=quant, dt_bytes=dt_bytes, kv_bytes=kv_bytes,
                              qkv_bias=model.qkv_bias, dense_bias=model.dense_bias, moe_tp=par.moe_tp,
                              moe_ep=par.moe_ep, attention_dp=adp) for r in range(par.pp))
    notes: list[str] = []
    if spec.lora.enabled:  # the adapters' GEMMs and reads on each stage's ranks (perf/lora.py)
        stages, note = with_lora(spec, p, stages, dt_bytes)
        notes += [note] if note else []
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
        draft_cost = stage_cost(dp, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=ddt, kv_bytes=ddt)
    elif mode_of(sp.mode).adds == DRAFT_ENGINE:
        notes.append("the draft model's config is not readable: its steps are not counted")
    if mode_of(sp.mode).adds != DRAFT_ENGINE and draft_len:
        notes.append(f"speculative.mode {sp.mode}: drafting networks counted only as the tokens they add to a step")
    dep = Deployment(device, stages, par.tp, math_precision, eff or efficiency_of(device), draft_cost,
                     draft_len, 1.0 + share * draft_len, shards)
    if eff is None and profile is None and measured_kernels(dep):
        dep = dataclasses.replace(dep, eff=efficiency_of(device, measured_kernels=True, release=release,
                                                         path=path_of(spec)))
    return dep, notes


def with_lora(spec, p, stages: tuple[StageCost, ...], dtype_bytes: int) -> tuple[tuple[StageCost, ...], str | None]:
    """The stages with the LoRA work of the spec's workload mix, and the note on what that assumes."""
    layout = spec.parallelism.layout
    out, note = [], None
    for stage, layers in zip(stages, layout.stage_layers(p.num_hidden_layers), strict=True):
        load, note = lora_load(spec, p, layers, spec.parallelism.tp, dtype_bytes)
        out.append(dataclasses.replace(stage, lora=load))
    return tuple(out), note


def predict(spec, model: ModelInfo, quant: Quantization, device: Gpu, memory: MemoryPlan,
            draft: ModelInfo | None = None, eff: Efficiency | None = None, profile: HostProfile | None = None,
            concurrency: int | None = None, bench_run: bool = False, release: str | None = None,
            calibrated: bool = True) -> Performance:
    """TTFT and TPOT at `concurrency` (default validation.workload.concurrency), and the maximum output
    throughput, of a spec that fits; on this host's CPU engine with `profile`. TTFT is the steady state's (a
    service long running), or with `bench_run` the mean over a `toolchain bench` level, whose num_requests
    requests start with all C at once (Workload.requests; not with duration_s or an open loop). `release`: the
    TensorRT-LLM release predicted (a published table's; default the one deployed), whose measured serving costs
    the measured-kernel step takes (efficiency.kernel_row); `calibrated` False ignores the rows `toolchain calibrate`
    cached on this machine (the published check predicts the shipped model)."""
    # A GPU row the user calibrated from their own runs of this device, path and version comes first.
    own = (calibrated_row(device.name, path_of(spec), TRTLLM_VERSION)
           if calibrated and eff is None and profile is None else None)
    dep, notes = deployment(spec, model, quant, device, draft, own.eff if own else eff, profile, release)
    if own:
        notes.append(f"efficiencies calibrated from your runs ({own.file}; `toolchain calibrate --show`, "
                     f"{IGNORE_ENV}=1 ignores them)")
    wl, lim = spec.validation.workload, spec.limits
    run = bench_run and wl.duration_s is None and wl.mode == "concurrency"
    requests = wl.num_requests if run else 0
    # Under attention DP each rank schedules its own requests within its own limits and KV cache, so the
    # replica's are dp times one rank's (the GPU path; the CPU engine's host model runs the batch whole).
    dp = dep.stages[0].dp if profile is None else 1
    w = Workload(wl.input_tokens, wl.output_tokens, lim.max_num_tokens * dp, spec.build.chunked_context,
                 requests=requests)
    if w.isl > lim.max_input_len or w.isl + w.osl > lim.max_seq_len:
        notes.append(f"the workload's {w.isl} + {w.osl} tokens exceed limits.max_input_len {lim.max_input_len} or "
                     f"max_seq_len {lim.max_seq_len}: the engine would refuse such requests")
    if not w.chunked and w.isl > lim.max_num_tokens:
        notes.append(f"input_tokens {w.isl} > limits.max_num_tokens without build.chunked_context: "
                     "predicted as one context step, which the engine would refuse")
    tpb = spec.build.tokens_per_block
    seq = math.ceil((w.isl + w.osl + dep.draft_len) / tpb) * tpb
    limits = {"max_batch_size": lim.max_batch_size * dp, "kv_cache": memory.kv_tokens_capacity // seq * dp,
              "max_num_tokens": lim.max_num_tokens // (1 + dep.draft_len) * dp}
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
        basis = own.basis if own else gpu_basis(dep, device, eff, release, path_of(spec))
    bar = None  # a CPU target's prediction is checked closed loop on this host instead
    if own:  # the calibration's own error on the user's runs
        bar = {"pct": round(own.error_pct, 1), "cells": own.reports, "nearest": own.basis, "distance": 0.0}
    elif profile is None:
        bar = error_bar(device.name, quant.method, params_billions(model.params), spec.parallelism.tp, path_of(spec),
                        model.params.is_moe)
    return Performance(best.output_tokens_per_s, best.output_tokens_per_s / dep.gpus, best.concurrency, limit,
                       limited_by, c, at.ttft_s * 1e3, at.tpot_s * 1e3,
                       {"context": at.context_bound, "generation": at.generation_bound}, usd, basis,
                       {"input_tokens": w.isl, "output_tokens": w.osl, "concurrency": c},
                       dep.tokens_per_step, notes, at.output_tokens_per_s, bar)


def gpu_basis(dep: Deployment, device: Gpu, eff: Efficiency | None, release: str | None, path: str | None) -> str:
    """What a GPU prediction rests on: the measured kernels and the row of serving costs it took, or the roofline's
    fitted row and why the kernel database did not serve (extrapolated from it)."""
    if eff is not None:
        return "roofline x given efficiencies" if not eff.kernels else describe(dep, None) + " x given serving costs"
    if dep.eff.kernels:
        row = kernel_row(device, release, path)
        held = FITTED["holdout_mape"]
        error = f"held-out MAPE TPOT {held['tpot']:.0f}%, throughput {held['throughput']:.0f}%, TTFT {held['ttft']:.0f}%"
        meta = KERNEL_ROW_META[row[0]] if row else None
        stand_in = (f"; the {path} path has no measured runs here: the nearest release's {meta['path']} serving "
                    "costs stand in" if meta and path and meta["path"] != path else "")
        return f"{describe(dep, meta['runs'] if meta else None)}, {error}{stand_in}"
    why = unmeasured(dep)
    return basis_of(device) + (f"; extrapolated: {why}" if why else "")


def host_profile_of(spec) -> HostProfile | None:
    """This host's cached profile for the engine threads of a target predicted from it (the CPU targets,
    `Target.predicts_from_host_profile`; never measured here); None for a GPU target or when there is none."""
    if not target_of(spec).predicts_from_host_profile:
        return None
    return load_profile(spec.serving.engine_threads)


def performance_dict(spec, model: ModelInfo | None, quant: Quantization, device: Gpu | None,
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
    quant = quantization_of(spec.quantization, model.hf_config, hf_quant_config=model.hf_quant_config)
    draft = None
    sp = spec.speculative
    if mode_of(sp.mode).adds == DRAFT_ENGINE and sp.draft_model is not None:
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
