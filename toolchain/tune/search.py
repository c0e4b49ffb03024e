"""The search of `toolchain tune`: plan, check and predict every candidate, drop what does not fit or misses the
SLO, rank the rest, and find the Pareto front.

Fit and preflight are `toolchain plan`'s own: each candidate gets the checks' `Context` (the memory plan inside
it) and every check that plan runs; a candidate with a failed check is dropped under that check's id. The
prediction is plan's `performance` object (plan/perf/ `performance_dict`), made for one replica at its share of
the workload's concurrency, so the SLO is judged where a replica runs, and once more at full load: at the batch
its maximum throughput is reached (`batch_size_at_max`, at most `limits.max_batch_size`), since that throughput is
what the ranking reads and a server running it sees that batch. So `max_batch_size` is a real knob: a larger cap
raises the throughput until the per-token time at that batch breaks the SLO. Whatever that function predicts, the
ranking uses: GPUs from their table, target cpu from this host's cached profile (`toolchain probe-host`). Without
a profile a CPU candidate has no prediction and is ordered by `CPU_RULE`, and `--measure` decides.

`cross_check` adds a second opinion to the top of the ranking: AIConfigurator's estimate of each candidate
(plan/crosscheck.py), at the batch our ranked throughput is predicted at; a candidate it cannot estimate says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from toolchain.checks.preflight import FAIL, Context, build_context, run_checks
from toolchain.errors import ToolchainError
from toolchain.gpus import Gpu
from toolchain.plan import perf
from toolchain.plan.crosscheck import Estimate
from toolchain.plan.perf import performance_dict
from toolchain.slo import Threshold, predicted_value
from toolchain.tune.candidates import Candidate, derive, engine_threads, knob_variants, structures

# Structures whose runtime knobs pass two searches (pass one ranks the structures at the spec's limits).
KNOB_STRUCTURES = 8

CPU_RULE = ("until then ordered by the weight bytes of all ranks (smallest first: a CPU decode step "
            "reads every weight), then fewer ranks (one process, no all-reduce copies), then an unquantized KV "
            "cache (no dequantization per step); the limits stay the spec's; --measure decides")


@dataclass
class Evaluated:
    candidate: Candidate
    failed: list[str] = field(default_factory=list)
    """Ids of the checks that fail (the candidate is dropped)."""
    performance: dict = field(default_factory=dict)
    """`performance_dict` for one replica at its share of the workload's concurrency."""
    full_load: dict = field(default_factory=dict)
    """{concurrency, ttft_ms, tpot_ms} predicted at batch_size_at_max (the ranked throughput's batch)."""
    slo_misses: dict[str, dict] = field(default_factory=dict)
    """Threshold name -> {predicted, limit, concurrency} for each predicted threshold missed."""
    weight_bytes: int = 0
    """The weights of all ranks (the CPU ordering rule reads it)."""
    device: Gpu | None = None
    """The device the candidate was planned on (the cross-check names it)."""
    cross_check: dict = field(default_factory=dict)
    """A second opinion (`cross_check`): its figures and basis, or {"error": why there is none}."""

    @property
    def predicted(self) -> bool:
        return bool(self.performance.get("predicted"))

    @property
    def kept(self) -> bool:
        return not self.failed and not self.slo_misses

    def per_gpu(self) -> float:
        return float(self.performance.get("per_gpu_output_tokens_per_s") or 0.0) if self.predicted else 0.0

    def usd(self) -> float | None:
        return self.performance.get("usd_per_million_output_tokens") if self.predicted else None

    def tokens_per_user(self) -> float:
        """Output tokens/s one user sees at the ranked throughput's batch: 1 / TPOT there."""
        tpot = (self.full_load or self.performance).get("tpot_ms") if self.predicted else None
        return 1000.0 / tpot if tpot else 0.0

    def as_dict(self) -> dict:
        return {"label": self.candidate.label, "spec_name": self.candidate.spec.name, **self.candidate.knobs,
                "failed_checks": self.failed, "slo_misses": self.slo_misses, "performance": self.performance,
                "full_load": self.full_load, **({"cross_check": self.cross_check} if self.cross_check else {})}


def replica_concurrency(concurrency: int, replicas: int) -> int:
    """A replica's share of the workload's concurrency (requests spread evenly, the busiest replica)."""
    return max(1, math.ceil(concurrency / replicas))


def replica_spec(spec, replicas: int):
    """The spec with one replica's share of its workload, what each of `replicas` copies serves: the concurrency
    (`replica_concurrency`), in mode rate the request rate, and each sweep level (levels a share makes equal run
    once). The spec a candidate is predicted at and written as, so `toolchain plan` of the written spec predicts
    what the search ranked; the request counts stay (how long a level runs, not how hard)."""
    if replicas == 1:
        return spec
    wl = spec.validation.workload
    changes: dict = {"validation.workload.concurrency": replica_concurrency(wl.concurrency, replicas)}
    if wl.mode == "rate":
        changes["validation.workload.rate"] = wl.rate / replicas
    if wl.sweep:
        levels = [replica_concurrency(int(v), replicas) if wl.mode == "concurrency" else v / replicas
                  for v in wl.sweep]
        changes["validation.workload.sweep"] = list(dict.fromkeys(levels))
    return derive(spec, changes)


def slo_misses(perf: dict, thresholds: list[Threshold], output_tokens: int, concurrency: int) -> dict[str, dict]:
    out = {}
    for t in thresholds:
        if not t.upper:
            continue
        value = predicted_value(t, perf["ttft_ms"], perf["tpot_ms"], output_tokens)
        if value is not None and value > t.value:
            out[t.name] = {"predicted": round(value, 3), "limit": t.value, "concurrency": concurrency}
    return out


def unpredicted(thresholds: list[Threshold]) -> list[str]:
    """Thresholds the prediction cannot judge (rates, send lag, ...): listed, never used to drop."""
    return [t.name for t in thresholds if predicted_value(t, 0.0, 0.0, 1) is None]


def point_at(spec, ctx: Context, concurrency: int) -> dict:
    """TTFT and TPOT (ms) at `concurrency`: on a GPU with figures, perf's steady state of the spec's deployment and
    workload, as `predict` computes its own point (one point, not predict's whole sweep); on any other device
    `performance_dict` at that concurrency, whatever it predicts there."""
    if ctx.model is None or ctx.device is None or not ctx.device.has_performance:
        return performance_dict(derive(spec, {"validation.workload.concurrency": concurrency}), ctx.model,
                                ctx.quant, ctx.device, ctx.memory, ctx.draft)
    dep, _ = perf.deployment(spec, ctx.model, ctx.quant, ctx.device, ctx.draft)
    wl, lim = spec.validation.workload, spec.limits
    at = perf.steady_state(dep, perf.Workload(wl.input_tokens, wl.output_tokens, lim.max_num_tokens,
                                              spec.build.chunked_context), concurrency)
    return {"concurrency": concurrency, "ttft_ms": round(at.ttft_s * 1e3, 2), "tpot_ms": round(at.tpot_s * 1e3, 3)}


def evaluate(candidate: Candidate, thresholds: list[Threshold]) -> Evaluated:
    """Plan and check the candidate as `toolchain plan` would, then predict one replica at its share of the
    workload's concurrency and judge the SLO there: all of it on the replica's spec (`replica_spec`), the one
    written for it."""
    spec = replica_spec(candidate.spec, candidate.replicas)
    out = Evaluated(candidate)
    try:
        ctx = build_context(spec, "plan")
        results = run_checks(ctx)
    except ToolchainError as err:  # a config plan cannot read fails every candidate alike
        out.failed = [f"plan: {err}"]
        return out
    out.failed = [r.id for r in results if r.status == FAIL]
    out.device = ctx.device
    if ctx.memory is not None:
        out.weight_bytes = sum(r.weights_bytes for r in ctx.memory.ranks)
    if (ctx.memory is None or not ctx.memory.fits) and "memory.fits" not in out.failed and not out.failed:
        out.failed.append("memory.fits")
    if out.failed:
        return out
    wl = spec.validation.workload
    out.performance = performance_dict(spec, ctx.model, ctx.quant, ctx.device, ctx.memory, ctx.draft)
    if not out.predicted:
        return out
    out.slo_misses = slo_misses(out.performance, thresholds, wl.output_tokens, out.performance["concurrency"])
    batch = out.performance["batch_size_at_max"]
    full = out.performance
    if batch != out.performance["concurrency"]:
        full = point_at(spec, ctx, batch)
    out.full_load = {"concurrency": full["concurrency"], "ttft_ms": full["ttft_ms"], "tpot_ms": full["tpot_ms"]}
    if not out.slo_misses:
        out.slo_misses = slo_misses(full, thresholds, wl.output_tokens, full["concurrency"])
    return out


def sort_key(by_cost: bool, base_limits: tuple[int, int, bool]):
    """Best first: predicted ones by cost per million tokens (with a price) or throughput per GPU; unpredicted
    ones after them by CPU_RULE. Ties go to the smaller max_batch_size and max_num_tokens (less memory held)."""
    def key(e: Evaluated):
        s = e.candidate.spec
        lim = s.limits
        own = (lim.max_batch_size, lim.max_num_tokens, s.build.chunked_context) == base_limits
        if e.predicted:
            usd = e.usd()
            primary = usd if by_cost and usd is not None else -e.per_gpu()
            return (0, round(primary, 6), lim.max_batch_size, lim.max_num_tokens)
        return (1, e.weight_bytes, s.parallelism.world_size, s.quantization.kv_cache != "none", 0 if own else 1,
                lim.max_batch_size, lim.max_num_tokens)
    return key


def pareto(kept: list[Evaluated]) -> list[Evaluated]:
    """Predicted candidates no other beats on both throughput per GPU and tokens/s per user, by per-GPU
    throughput, highest first."""
    pts = [e for e in kept if e.predicted]
    front = []
    for e in pts:
        a, b = e.per_gpu(), e.tokens_per_user()
        dominated = any(o.per_gpu() >= a and o.tokens_per_user() >= b and (o.per_gpu() > a or o.tokens_per_user() > b)
                        for o in pts)
        if not dominated:
            front.append(e)
    front.sort(key=lambda e: -e.per_gpu())
    # One point per (throughput, speed): candidates that differ only in knobs the model does not see.
    seen, unique = set(), []
    for e in front:
        point = (round(e.per_gpu(), 1), round(e.tokens_per_user(), 1))
        if point not in seen:
            seen.add(point)
            unique.append(e)
    return unique


def distinct(ranked: list[Evaluated]) -> list[Evaluated]:
    """The ranked candidates whose prediction differs from every better one's. Candidates that differ only in
    knobs the model does not see (chunked context, a token budget no step reaches, one 8-bit KV format for
    another) get the same figures: listing, writing or deploying each would spend the top K on one prediction.
    Unpredicted candidates are all kept (CPU_RULE orders them; nothing tells them apart)."""
    seen: set[tuple] = set()
    out = []
    for e in ranked:
        if e.predicted:
            p = e.performance
            point = (round(e.per_gpu(), 1), p["ttft_ms"], p["tpot_ms"], p["batch_size_at_max"])
            if point in seen:
                continue
            seen.add(point)
        out.append(e)
    return out


def refine_batches(evaluated: list[Evaluated], thresholds: list[Threshold]) -> list[Evaluated]:
    """Where the SLO binds between two grid batches of one candidate (the same knobs but max_batch_size: the
    smaller kept, the next one planned and checked clean but missing the SLO), the largest cap between them that
    meets the SLO, found by bisection; one candidate per such pair. The grid alone would leave a binding SLO's
    best cap at the power of two below it (64 where 94 still meets Llama-3-70B's 60 ms TPOT), and a larger cap raises
    the ranked throughput. Caps are whole numbers: trtllm-build's --max_batch_size and LLM(max_batch_size) take
    any positive int (upstream/facts trtllm_build.json, llmapi.json), so no granularity is kept."""
    groups: dict[tuple, dict[int, Evaluated]] = {}
    for e in evaluated:
        knobs = e.candidate.knobs
        key = tuple((k, v) for k, v in knobs.items() if k != "max_batch_size")
        groups.setdefault(key, {})[knobs["max_batch_size"]] = e
    out = []
    for by_batch in groups.values():
        for lo, hi in pairwise(sorted(by_batch)):
            low, high = by_batch[lo], by_batch[hi]
            if not (low.kept and low.predicted and not high.failed and high.slo_misses and hi - lo > 1):
                continue
            best = None
            while hi - lo > 1:
                mid = (lo + hi) // 2
                c = low.candidate
                try:
                    probe = evaluate(Candidate(derive(c.spec, {"limits.max_batch_size": mid}), c.replicas,
                                               c.gpu_count), thresholds)
                except ToolchainError:  # a cap the spec's validators refuse counts as a miss
                    probe = None
                if probe is not None and probe.kept:
                    lo, best = mid, probe
                else:
                    hi = mid
            if best is not None:
                out.append(best)
    return out


@dataclass
class SearchResult:
    ranked: list[Evaluated]
    """Kept candidates, best first."""
    dropped: list[Evaluated]
    refused: list[str]
    """Combinations the spec's validators refused (never planned)."""
    front: list[Evaluated]
    unpredicted_slo: list[str]
    by_cost: bool
    notes: list[str] = field(default_factory=list)
    slo: list[Threshold] = field(default_factory=list)
    """The thresholds candidates were judged against (the table states what judged them)."""

    @property
    def shown(self) -> list[Evaluated]:
        """The ranking with one candidate per prediction: what the table lists and --top writes and deploys."""
        return distinct(self.ranked)

    @property
    def searched(self) -> int:
        return len(self.ranked) + len(self.dropped)

    def drop_counts(self) -> dict[str, int]:
        """Why candidates were dropped: memory.fits when it failed, else the first failed check's id, or "slo"."""
        counts: dict[str, int] = {}
        for e in self.dropped:
            why = ("memory.fits" if "memory.fits" in e.failed else e.failed[0]) if e.failed else "slo"
            counts[why] = counts.get(why, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def closest(self) -> Evaluated | None:
        """Of the candidates that fit and pass the checks but miss the SLO, the one missing by the least: the
        smallest largest ratio of predicted value to limit."""
        missers = [e for e in self.dropped if not e.failed and e.slo_misses]
        if not missers:
            return None
        return min(missers, key=lambda e: max(m["predicted"] / m["limit"] for m in e.slo_misses.values()))


def search(spec, gpu_specs: list, gpu_count: int, thresholds: list[Threshold], by_cost: bool) -> SearchResult:
    """Both passes over each GPU's spec (`gpu_specs`: the user's spec with gpu.name and price set per GPU)."""
    evaluated: list[Evaluated] = []
    refused: list[str] = []
    base_limits = (spec.limits.max_batch_size, spec.limits.max_num_tokens, spec.build.chunked_context)
    key = sort_key(by_cost, base_limits)
    for gspec in gpu_specs:
        ctx = build_context(gspec, "plan")
        stored = ctx.quant.imported is not None or ctx.quant.modelopt  # a stored format is kept (FP8 blocks too)
        moe = ctx.model is not None and ctx.model.params.is_moe
        mtp = ctx.model is not None and bool(ctx.model.hf_config.get("num_nextn_predict_layers"))
        first, bad = structures(gspec, gpu_count, ctx.device, stored, moe, mtp)
        refused += bad
        one = [evaluate(c, thresholds) for c in first]
        evaluated += one
        # Pass two: the runtime knobs of the best structures that fit (the SLO may still be met by other knobs);
        # without a prediction nothing tells the knobs apart, so the spec's own stay.
        # Those meeting the SLO come first; one that misses it at full load may meet it under a smaller cap.
        fitting = sorted((e for e in one if not e.failed and e.predicted),
                         key=lambda e: (bool(e.slo_misses), key(e)))[:KNOB_STRUCTURES]
        seen = {e.candidate.label for e in evaluated}
        for e in fitting:
            variants, bad = knob_variants(e.candidate)
            refused += bad
            for c in variants:
                if c.label not in seen:
                    seen.add(c.label)
                    evaluated.append(evaluate(c, thresholds))
    evaluated += refine_batches(evaluated, thresholds)
    ranked = sorted((e for e in evaluated if e.kept), key=key)
    dropped = [e for e in evaluated if not e.kept]
    notes = []
    if any(not e.predicted for e in ranked):
        reason = next(e.performance.get("note") for e in ranked if not e.predicted)
        # perf's note for a CPU target without a profile ends in the command that makes one
        notes.append(f"{reason} to rank by prediction; {CPU_RULE}" if "probe-host" in str(reason)
                     else f"{reason}; {CPU_RULE}")
    else:
        _, left_out = engine_threads(spec)
        if left_out:
            notes.append(left_out)
    return SearchResult(ranked, dropped, refused, pareto(ranked), unpredicted(thresholds), by_cost, notes,
                        thresholds)


Estimator = Callable[[object, Gpu, int], Estimate]
"""(candidate spec, its device, batch size) -> a second opinion's estimate; raises ToolchainError when it has none."""


def cross_check(ranked: list[Evaluated], top: int, estimator: Estimator) -> None:
    """Set `cross_check` on the first `top` predicted candidates: the estimator's figures at the batch the ranked
    throughput is predicted at (`batch_size_at_max`, one replica), or why it gave none. A candidate it cannot
    estimate (a format or GPU it has no data for, a failed run) is said so in its row; the tune goes on."""
    for e in ranked[:top]:
        if not e.predicted or e.device is None:
            e.cross_check = {"error": "no prediction of ours to compare with"}
            continue
        if e.candidate.spec.dynamo.disaggregated:  # the estimator is aggregated serving's
            e.cross_check = {"error": "disaggregated: compared with AIConfigurator's disagg estimate in "
                                      "benchmarks/disagg_crosscheck.py, not here"}
            continue
        batch = int(e.performance["batch_size_at_max"])
        try:
            est = estimator(e.candidate.spec, e.device, batch)
        except ToolchainError as err:
            e.cross_check = {"error": err.message, "batch_size": batch}
            continue
        e.cross_check = {**est.as_dict(), "batch_size": batch}
