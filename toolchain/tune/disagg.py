"""Disaggregated candidates of `toolchain tune`: prefill and decode workers of their own (NVIDIA Dynamo with
TensorRT-LLM), predicted by plan/perf/disagg.py and ranked beside the aggregated ones by the same objective.

Proposed only where the spec's target runs under Dynamo (dynamo/checks.py: the LLM-API path on GPUs); on another
GPU target tune says once why not (a CPU target serves on one host, where there is nothing to split). Per GPU, on
the weight and KV formats of the best aggregated candidate (so a split and an aggregated deployment of one format
are compared; where none meets the SLO, the fastest that fits), the grid is small: each role's tp from the tps
tune tries (pp 1, within a node), worker ratios P:D of `RATIOS`, scaled by the largest whole factor the GPU
budget holds, and the decode workers' max_batch_size on tune's batch grid from the largest down to the first that
meets the SLO (the prediction already takes the best decode batch below the cap). Prefill workers take a whole
prompt per step (max_num_tokens at least limits.max_input_len). Each role is planned and checked as its own spec
(dynamo/roles.py role_spec) with every check `toolchain plan` runs; a failed one drops the candidate as
"<role>:<check id>". The written spec is a disaggregated Dynamo spec: `toolchain dynamo --manifests` of it writes
the DynamoGraphDeployment with each role's settings.
"""

from __future__ import annotations

from typing import Any

from toolchain import gpus
from toolchain.checks.preflight import FAIL, Context, build_context, run_checks
from toolchain.dynamo.checks import problems as dynamo_problems
from toolchain.dynamo.roles import role_of, role_spec, split_of, split_performance
from toolchain.errors import ToolchainError
from toolchain.plan.perf.disagg import Role, point
from toolchain.slo import Threshold
from toolchain.spec import DeploymentSpec
from toolchain.tune.candidates import BATCH_GRID, Candidate, derive
from toolchain.tune.search import Evaluated, SearchResult, pareto, search, slo_misses, sort_key

RATIOS = ((1, 1), (1, 2), (2, 1), (1, 3))
"""Prefill : decode workers tried (each scaled to fill the GPU budget)."""
TPS = (1, 2, 4, 8)


def why_not(spec: DeploymentSpec) -> str | None:
    """Why this spec's deployment cannot be split under Dynamo, or None."""
    try:
        found = dynamo_problems(derive(spec, {"dynamo.disaggregated": True, "parallelism.gpus": None}))
    except ToolchainError as err:
        found = [err.message]
    return f"disaggregated candidates not proposed: {found[0]}" if found else None


def layouts(gpu_count: int, per_node: int) -> list[tuple[int, int, int, int]]:
    """(P, tp_p, D, tp_d) over at most `gpu_count` GPUs: each role's tp within a node, a ratio of RATIOS times the
    largest factor that fits."""
    out = []
    tps = [t for t in TPS if t <= min(gpu_count, per_node)]
    for tp_p in tps:
        for tp_d in tps:
            for p, d in RATIOS:
                k = gpu_count // (p * tp_p + d * tp_d)
                if k >= 1:
                    out.append((p * k, tp_p, d * k, tp_d))
    return out


def candidates(base: DeploymentSpec, gpu_count: int) -> list[Candidate]:
    """The disaggregated specs of `base` (a per-GPU spec at the chosen formats), decode max_batch_size at the
    largest of the grid (`evaluate_roles` walks it down)."""
    lim = base.limits
    out = []
    for p, tp_p, d, tp_d in layouts(gpu_count, base.gpu.per_node):
        changes: dict[str, Any] = {
            "parallelism.tp": min(tp_p, tp_d), "parallelism.pp": 1, "parallelism.gpus": gpu_count,
            "parallelism.moe_tp": None, "parallelism.moe_ep": None, "parallelism.attention_dp": False,
            "dynamo.disaggregated": True, "dynamo.prefill_workers": p, "dynamo.decode_workers": d,
            "dynamo.prefill": {"tp": tp_p, "max_num_tokens": max(lim.max_num_tokens, lim.max_input_len)},
            "dynamo.decode": {"tp": tp_d, "max_batch_size": max(BATCH_GRID)}}
        out.append(Candidate(derive(base, changes), 1, (p * tp_p + d * tp_d)))
    return out


Planned = dict[str, tuple[Context, tuple[str, ...]]]
"""Role specs planned in one search, by their JSON: prefill roles repeat across ratios and decode batches."""


def _planned(spec: DeploymentSpec, cache: Planned) -> tuple[Context, tuple[str, ...]]:
    """A role spec's context and failed checks, planned once per search."""
    key = spec.model_dump_json()
    if key not in cache:
        ctx = build_context(spec, "plan")
        cache[key] = ctx, tuple(r.id for r in run_checks(ctx) if r.status == FAIL)
    return cache[key]


def evaluate(candidate: Candidate, thresholds: list[Threshold], cache: Planned | None = None) -> Evaluated:
    """Plan and check each role as its own spec, then predict the split at the workload's concurrency and at the
    maximum, and judge the SLO at both (as search.evaluate does for an aggregated candidate)."""
    spec = candidate.spec
    out = Evaluated(candidate)
    roles: dict[str, Role] = {}
    for name, workers in (("prefill", spec.dynamo.prefill_workers), ("decode", spec.dynamo.decode_workers)):
        try:
            rspec = role_spec(spec, name)
            ctx, failed = _planned(rspec, {} if cache is None else cache)
        except ToolchainError as err:
            out.failed = [f"{name}: {err}"]
            return out
        out.device = ctx.device
        if ctx.memory is not None:
            out.weight_bytes += sum(r.weights_bytes for r in ctx.memory.ranks) * workers
        out.failed += [f"{name}:{f}" for f in failed]
        if not failed and (ctx.memory is None or not ctx.memory.fits):
            out.failed.append(f"{name}:memory.fits")
        if out.failed:
            return out
        if ctx.model is None or ctx.device is None or not ctx.device.has_performance:
            out.performance = {"predicted": False, "note": "no GPU figures to predict a disaggregated split"}
            return out
        assert ctx.memory is not None
        roles[name] = role_of(rspec, ctx.model, ctx.quant, ctx.device, ctx.memory, workers, ctx.draft)
    wl = spec.validation.workload
    split = split_of(spec, roles["prefill"], roles["decode"])
    assert out.device is not None
    try:
        out.performance = split_performance(spec, split, out.device)
    except ToolchainError as err:
        out.failed = [f"disagg: {err.message}"]
        return out
    out.slo_misses = slo_misses(out.performance, thresholds, wl.output_tokens, wl.concurrency)
    at = point(split, int(out.performance["batch_size_at_max"]))
    out.full_load = {"concurrency": at.concurrency, "ttft_ms": round(at.ttft_s * 1e3, 2),
                     "tpot_ms": round(at.tpot_s * 1e3, 3)}
    if not out.slo_misses:
        out.slo_misses = slo_misses(out.full_load, thresholds, wl.output_tokens, at.concurrency)
    return out


def evaluate_roles(candidate: Candidate, thresholds: list[Threshold], cache: Planned) -> list[Evaluated]:
    """The candidate at decode max_batch_size down the grid until one meets the SLO (all of them evaluated)."""
    out = []
    for batch in sorted(BATCH_GRID, reverse=True):
        c = Candidate(derive(candidate.spec, {"dynamo.decode.max_batch_size": batch}), candidate.replicas,
                      candidate.gpu_count)
        e = evaluate(c, thresholds, cache)
        out.append(e)
        if e.kept or any(not f.startswith("decode:") for f in e.failed) or not e.predicted and not e.failed:
            break  # met, or refused by something a smaller decode batch does not change
    return out


def on_gpus(spec: DeploymentSpec) -> bool:
    device = gpus.resolve(spec)
    return device is None or device.kind == "gpu"  # None: a GPU target whose card the spec does not name


def search_with_disagg(spec: DeploymentSpec, gpu_specs: list, gpu_count: int, thresholds: list[Threshold],
                       by_cost: bool) -> SearchResult:
    """search.search, then the disaggregated candidates of each GPU's spec ranked in with the aggregated ones."""
    result = search(spec, gpu_specs, gpu_count, thresholds, by_cost)
    if not any(on_gpus(g) for g in gpu_specs):  # one host's CPU engine: no KV transfer to split by
        return result
    reason = why_not(spec)
    if reason:
        result.notes.append(reason)
        return result
    added: list[Evaluated] = []
    planned: Planned = {}
    for gspec in gpu_specs:
        # the formats of the best aggregated candidate on this GPU; where none meets the SLO (a split may), of the
        # fastest that fits and misses only the SLO; where none fits, the spec's own
        ours = [e for e in [*result.ranked, *sorted(result.dropped, key=lambda e: -e.per_gpu())]
                if e.candidate.spec.gpu.name == gspec.gpu.name and e.predicted and not e.failed]
        q = ours[0].candidate.spec.quantization if ours else gspec.quantization
        base = derive(gspec, {"quantization.method": q.method, "quantization.kv_cache": q.kv_cache})
        for c in candidates(base, gpu_count):
            added += evaluate_roles(c, thresholds, planned)
    if not added:
        return result
    kept = [e for e in added if e.kept]
    result.ranked = sorted([*result.ranked, *kept],
                           key=sort_key(by_cost, (spec.limits.max_batch_size, spec.limits.max_num_tokens,
                                                  spec.build.chunked_context)))
    result.dropped += [e for e in added if not e.kept]
    result.front = pareto(result.ranked)
    return result
