"""Learn a device row from the user's own runs: `toolchain calibrate REPORT...` (cli/calibrate.py).

Each report (plan/reports.py reads the three formats) is completed from the command's flags or a spec, planned
with the same machinery as `toolchain plan` (calibration.spec_for, the memory plan, perf.predict), and the
shipped efficiency row of its GPU, path and TensorRT-LLM version (plan/perf/calibrated.py shipped_row) is
refitted to what was measured: a throughput-only run as a maximum-throughput point, as NVIDIA's published
trtllm-bench points are predicted (calibration.predict_published, trtllm-bench's own limits where the report
does not record them), a run at a concurrency as that steady state (TTFT over the run's waves, as `toolchain
bench` predicts it). The fit minimises the weighted mean absolute log error (tools/fit_efficiency.py's
objective: TTFT weighs half) by Nelder-Mead (plan/fit.py), over only as many multipliers on the shipped row as
the reports identify (`parameters_for`), each named by Efficiency field, never by position, so fields the kernel
layer adds keep their shipped values. The row and its provenance are written by plan/perf/calibrated.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolchain import gpus
from toolchain.errors import ToolchainError
from toolchain.plan import calibration as cal
from toolchain.plan import perf
from toolchain.plan.fit import nelder_mead
from toolchain.gpus import Gpu
from toolchain.plan.model import ModelInfo, load_model
from toolchain.plan.perf.calibrated import normal_version, shipped_row
from toolchain.plan.perf.paths import TRTLLM_VERSION, path_of
from toolchain.plan.plan import MemoryPlan, plan_memory
from toolchain.plan.reports import (AIPERF, TOOLCHAIN_BENCH, TRTLLM_BENCH, Facts, Point, Report, gpu_named,
                                    model_named)
from toolchain.quant.view import Quantization, quantization_of
from toolchain.spec import DeploymentSpec, load_spec
from toolchain.targets import target_of

FLAGS = {"gpu": "--gpu", "tp": "--tp", "pp": "--pp", "method": "--quantization", "kv_cache": "--kv-cache",
         "path": "--path", "version": "--version", "model": "--model"}
"""The facts a report may lack, and the flag that gives each."""
SERVE_LIMITS = (2048, cal.MAX_NUM_TOKENS, 0.9)
"""(max_batch_size, max_num_tokens, KV fraction) of a run at a concurrency whose report and spec do not say:
trtllm-serve's defaults (tensorrt_llm/commands/serve.py: --max_batch_size and --max_num_tokens default to
BuildConfig's, 2048 and 8192, toolchain/upstream/facts/llmapi.json trtllm_serve and trtllm_build.json; KvCacheConfig
free_gpu_memory_fraction 0.9, llmapi.json kv_cache_config)."""
TTFT_WEIGHT = 0.5
"""As tools/fit_efficiency.py: a measured TTFT carries more noise (the queue of a closed loop's bunched start)."""
PRIOR = 0.01
"""Weight of the squared log-multipliers in the objective: a direction the reports do not pin stays at the
shipped row instead of wandering along a flat valley."""
GROUPS: dict[str, tuple[str, ...]] = {
    "memory": ("bandwidth",),
    "compute": ("compute",),
    "overhead": ("fixed_us", "seq_us"),
    "ttft": ("ttft_ms",),
    "comm": ("link", "latency"),
    "kernels": ("kernel_scale",),
    "allreduce": ("link_scale", "allreduce_us"),
}
"""Multipliers the fit may free, in the order more data frees them, and the Efficiency fields each scales."""
SPEED = "speed"
"""The single multiplier of one or two reports: every time of the row scaled alike (the fractions up, the fixed
costs down), which one throughput pins without saying which part of the step is off."""
FRACTIONS = ("bandwidth", "compute", "link")
COSTS = ("fixed_us", "latency", "seq_us", "ttft_ms", "kernel_scale", "link_scale", "allreduce_us")


# ------------------------------------------------------------------------------------- completing the facts


def _canonical(name: str, value):
    if value is None:
        return None
    if name == "gpu":
        return gpu_named(str(value)) or str(value)
    if name == "version":
        return normal_version(str(value))
    if name == "model":
        path = Path(str(value))
        return str(path.resolve()) if (path / "config.json").is_file() else model_named(str(value)) or str(value)
    return value


def spec_facts(spec) -> Facts:
    """What a spec (--spec) says of the deployment a report measured."""
    if target_of(spec).predicts_from_host_profile:
        raise ToolchainError(f"spec {spec.name} has a CPU target ({spec.target}); calibrate learns GPU rows",
                             "the CPU engine is predicted from this host's profile: run `toolchain probe-host`")
    lim = spec.limits
    return Facts(gpu=spec.gpu.name, tp=spec.parallelism.tp, pp=spec.parallelism.pp, method=spec.quantization.method,
                 kv_cache=spec.quantization.kv_cache, path=path_of(spec), version=TRTLLM_VERSION,
                 model=str(Path(spec.model.checkpoint).resolve()), dtype=spec.model.dtype,
                 max_batch_size=lim.max_batch_size, max_num_tokens=lim.max_num_tokens,
                 kv_fraction=spec.serving.kv_cache_free_gpu_mem_fraction)


def given_facts(flags: Facts, spec=None) -> tuple[Facts, dict[str, str]]:
    """The flags over the spec's facts, and what gave each ("--tp", "--spec"); a flag that contradicts the
    spec is refused."""
    source = {name: flag for name, flag in FLAGS.items() if getattr(flags, name) is not None}
    if spec is None:
        return flags, source
    out = spec_facts(spec)
    for name, flag in FLAGS.items():
        mine, theirs = _canonical(name, getattr(flags, name)), _canonical(name, getattr(out, name))
        if mine is not None and theirs is not None and mine != theirs:
            raise ToolchainError(f"{flag} {getattr(flags, name)} contradicts the spec's {theirs}",
                                 "drop the flag or pass the spec the runs used")
        if mine is not None:
            setattr(out, name, getattr(flags, name))
        else:
            source[name] = "--spec"
    return out, source


FACT_NAMES = {"gpu": "GPU", "tp": "tensor-parallel size", "pp": "pipeline stages", "method": "weight format",
              "kv_cache": "KV-cache precision", "path": "path (engine or pytorch)", "version": "TensorRT-LLM version",
              "model": "model"}
FORMAT_NAMES = {TRTLLM_BENCH: "trtllm-bench", AIPERF: "AIPerf", TOOLCHAIN_BENCH: "toolchain bench"}


def complete(report: Report, given: Facts, source: dict[str, str] | None = None) -> Facts:
    """The report's facts, the given ones where it says nothing; a one-line error for a fact neither has or
    that they contradict (`source` names what gave each given fact). The model flag stands over the name a
    report gives (a name, not shapes)."""
    source = source or FLAGS
    out = Facts()
    for f in dataclasses.fields(Facts):
        mine, theirs = getattr(report.facts, f.name), getattr(given, f.name)
        flag = FLAGS.get(f.name)
        if flag and f.name != "model" and mine is not None and theirs is not None \
                and _canonical(f.name, mine) != _canonical(f.name, theirs):
            spec = source.get(f.name) == "--spec"
            raise ToolchainError(f"{report.file.name} says {flag.lstrip('-')} {mine}, "
                                 f"{'the spec' if spec else flag} says {theirs}",
                                 "pass the spec of the deployment the report measured" if spec else
                                 "drop the flag or pass the report of the deployment it describes")
        value = theirs if f.name == "model" and theirs is not None else mine if mine is not None else theirs
        setattr(out, f.name, value)
    if out.version is None and report.format == TOOLCHAIN_BENCH:
        out.version = TRTLLM_VERSION  # this toolchain's GPU targets run the TensorRT-LLM it pins (versions.py)
    if out.pp is None and out.tp is not None:
        out.pp = 1
    for name, flag in FLAGS.items():
        if getattr(out, name) is None:
            raise ToolchainError(f"{report.file.name}: {FORMAT_NAMES[report.format]} reports do not record the "
                                 f"{FACT_NAMES[name]}",
                                 f"pass {flag}, or --spec build/x.yaml")
    out.gpu, out.version, out.model = (_canonical(n, getattr(out, n)) for n in ("gpu", "version", "model"))
    gpus.lookup(str(out.gpu))  # an unknown name: the table's one-line error
    if out.path not in ("engine", "pytorch"):
        raise ToolchainError(f"path {out.path!r} is not one calibrate learns", "pass --path engine or --path pytorch")
    if not (Path(str(out.model)) / "config.json").is_file() and not (cal.MODELS / str(out.model) / "config.json").is_file():
        raise ToolchainError(f"model {out.model!r} is neither a config directory nor one of "
                             f"{', '.join(sorted(p.name for p in cal.MODELS.iterdir()))}",
                             "pass --model with a Hugging Face config directory or one of those names")
    return out


# -------------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """One measured point, planned once; `predict(eff)` reruns only the performance model."""

    report: Report
    point: Point
    facts: Facts
    spec: DeploymentSpec
    info: ModelInfo
    quant: Quantization
    device: Gpu
    memory: MemoryPlan

    @property
    def measured(self) -> dict[str, float]:
        p = self.point
        out = {"throughput": p.output_tokens_per_s}
        if p.concurrency is not None:  # a queued-at-once run's TTFT and TPOT are its queue's, not fitted
            out.update({k: v for k, v in (("ttft", p.ttft_ms), ("tpot", p.tpot_ms)) if v})
        return out

    def predict(self, eff: perf.Efficiency) -> dict[str, float]:
        p = self.point
        if p.concurrency is None:
            got = perf.predict(self.spec, self.info, self.quant, self.device, self.memory, eff=eff)
            return {"throughput": got.max_output_tokens_per_s}
        got = perf.predict(self.spec, self.info, self.quant, self.device, self.memory, eff=eff,
                           concurrency=p.concurrency, bench_run=True)
        return {"throughput": got.output_tokens_per_s, "ttft": got.ttft_ms, "tpot": got.tpot_ms}


def _limits(report: Report, facts: Facts, point: Point) -> tuple[int, int, float, str | None]:
    """(max_batch_size, max_num_tokens, KV fraction, a note on where they come from)."""
    if facts.max_batch_size and facts.max_num_tokens:
        return facts.max_batch_size, facts.max_num_tokens, facts.kv_fraction or SERVE_LIMITS[2], None
    if report.format == TRTLLM_BENCH and point.concurrency is None:
        pub = cal.Published(str(facts.model), str(facts.gpu), str(facts.method), int(facts.tp or 1), point.isl,
                            point.osl, point.output_tokens_per_s, path=facts.path)
        batch, tokens = cal.published_limits(pub)
        return batch, tokens, facts.kv_fraction or cal.BENCH_KV_FRACTION, (
            f"{report.file.name}: max_batch_size {batch} and max_num_tokens {tokens} from trtllm-bench's own "
            "heuristic (the report does not record them)")
    return (*SERVE_LIMITS[:2], facts.kv_fraction or SERVE_LIMITS[2],
            f"{report.file.name}: trtllm-serve's default limits ({SERVE_LIMITS[0]} sequences, {SERVE_LIMITS[1]} "
            "tokens) assumed (pass --spec to give the deployment's)")


def case_of(report: Report, facts: Facts, point: Point, spec_path: Path | None, notes: list[str]) -> Case:
    """Plan one point as `toolchain plan` would: the spec itself with the run's workload (--spec), or
    calibration.spec_for of the facts."""
    if report.expert_parallel and spec_path is None:
        raise ToolchainError(f"{report.file.name}: the run split its experts over GPUs",
                             "pass --spec with the deployment's parallelism section")
    workload = {"input_tokens": point.isl, "output_tokens": point.osl, "concurrency": point.concurrency or 1,
                **({"num_requests": point.requests} if point.requests else {})}
    if spec_path is not None:
        sets = [f"validation.workload.{k}={v}" for k, v in workload.items()]
        if point.concurrency is None and facts.max_batch_size and facts.max_num_tokens:
            sets += [f"limits.max_batch_size={facts.max_batch_size}", f"limits.max_num_tokens={facts.max_num_tokens}"]
        spec = load_spec(spec_path, sets)
    else:
        batch, tokens, fraction, note = _limits(report, facts, point)
        if note and note not in notes:
            notes.append(note)
        spec = cal.spec_for(str(facts.model), str(facts.gpu), str(facts.method), int(facts.tp or 1), point.isl,
                            point.osl, max_batch_size=batch, max_num_tokens=tokens, kv_fraction=fraction,
                            dtype=facts.dtype or "auto", target="trtllm" if facts.path == "engine" else "llmapi",
                            pp=int(facts.pp or 1), kv_cache=facts.kv_cache, concurrency=point.concurrency or 1,
                            num_requests=point.requests)
    info = load_model(spec.model.checkpoint)
    quant = quantization_of(spec.quantization, info.hf_config, hf_quant_config=info.hf_quant_config)
    device = gpus.resolve(spec)
    assert device is not None
    memory = plan_memory(spec, info, quant, device, suggest=False)
    if not memory.fits:
        raise ToolchainError(f"{report.file.name}: {Path(str(facts.model)).name} {facts.method} tp{facts.tp} "
                             f"pp{facts.pp} does not fit {facts.gpu} by the memory plan, so it has no prediction "
                             "to fit", "check the report's GPU, parallelism and precision flags")
    return Case(report, point, facts, spec, info, quant, device, memory)


# ------------------------------------------------------------------------------------------------ the fit


def parameters_for(cases: list[Case], kernels: bool = False) -> tuple[tuple[str, ...], str]:
    """The multipliers the reports identify, and why: one (`SPEED`) for up to five measured values (one or two
    reports); then one per three values, in GROUPS' order, TTFT's only when a TTFT was measured and the
    interconnect's only when a run spans GPUs. A measured-kernel row (`kernels`) frees its kernels' time in serving
    over alone where a roofline row frees its bandwidth and compute fractions."""
    n = sum(len(c.measured) for c in cases)
    available = ["kernels", "overhead"] if kernels else ["memory", "compute", "overhead"]
    if any("ttft" in c.measured for c in cases):
        available.append("ttft")
    if any((c.facts.tp or 1) * (c.facts.pp or 1) > 1 for c in cases):
        available.append("allreduce" if kernels else "comm")
    k = min(len(available), n // 3)
    if k <= 1:
        return (SPEED,), f"{n} measured value(s): one multiplier on every time of the row"
    return tuple(available[:k]), f"{n} measured values: {k} multipliers (one per three values)"


def apply(base: perf.Efficiency, params: tuple[str, ...], x: list[float]) -> perf.Efficiency:
    """The base row with each parameter's multiplier exp(x) on its fields (by name); fractions stay <= 1."""
    values: dict[str, Any] = {}
    for name, v in zip(params, x, strict=True):
        m = math.exp(v)
        for f in FRACTIONS + COSTS if name == SPEED else GROUPS[name]:
            now = values.get(f, getattr(base, f))
            if f in FRACTIONS:
                values[f] = min(1.0, now * m)
            else:
                values[f] = now / m if name == SPEED else now * m
    return dataclasses.replace(base, **values)


def fitted_fields(params: tuple[str, ...]) -> list[str]:
    return sorted({f for p in params for f in (FRACTIONS + COSTS if p == SPEED else GROUPS[p])})


WEIGHTS = {"throughput": 1.0, "tpot": 1.0, "ttft": TTFT_WEIGHT}


def objective(cases: list[Case], eff: perf.Efficiency) -> float:
    total = weight = 0.0
    for c in cases:
        got = c.predict(eff)
        for k, v in c.measured.items():
            if not got[k] > 0:
                return math.inf
            total += WEIGHTS[k] * abs(math.log(got[k] / v))
            weight += WEIGHTS[k]
    return total / weight


def fit(cases: list[Case], base: perf.Efficiency, params: tuple[str, ...], x0: list[float] | None = None,
        rounds: int = 2, iterations: int = 120) -> list[float]:
    def f(x: list[float]) -> float:
        return objective(cases, apply(base, params, x)) + PRIOR * sum(v * v for v in x) / len(x)

    x = list(x0 or [0.0] * len(params))
    for _ in range(rounds):  # a simplex can stall; restarting from its best point is the usual cure
        x = nelder_mead(f, x, step=0.3, iterations=iterations, tol=1e-4)
    if not math.isfinite(f(x)):
        raise ToolchainError("the fit found no row that predicts every report",
                             "check each report's flags: a point the model cannot run has no error to minimise")
    return x


def errors_pct(cases: list[Case], eff: perf.Efficiency) -> list[float]:
    return [abs(c.predict(eff)[k] / v - 1) * 100 for c in cases for k, v in c.measured.items()]


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


# ------------------------------------------------------------------------------------------------- the run


@dataclass
class Calibration:
    """A fitted row with everything `calibrate` prints and writes."""

    doc: dict
    """The cache file's content (plan/perf/calibrated.py save_row)."""
    base: perf.Efficiency
    eff: perf.Efficiency
    cases: list[Case]


def calibrate(reports: list[Report], flags: Facts, spec_path: Path | None = None, today: str | None = None,
              leave_one_out: bool = True) -> Calibration:
    """Fit the row of the reports' (GPU, path, version); all of them must share it."""
    seen: dict[str, Path] = {}
    for r in reports:
        if r.sha256 in seen:
            raise ToolchainError(f"{r.file} is the same run as {seen[r.sha256]}", "pass each report once")
        seen[r.sha256] = r.file
    spec = load_spec(spec_path) if spec_path is not None else None
    given, source = given_facts(flags, spec)
    notes: list[str] = [n for r in reports for n in (f"{r.file.name}: {x}" for x in r.notes)]
    if spec is not None:
        notes += [f"{r.file.name}: its spec hash differs from --spec's" for r in reports
                  if r.spec_hash and r.spec_hash != spec.spec_hash()]
    cases: list[Case] = []
    for report in reports:
        facts = complete(report, given, source)
        cases += [case_of(report, facts, point, spec_path, notes) for point in report.points]
    keys = {(c.facts.gpu, c.facts.path, c.facts.version) for c in cases}
    if len(keys) > 1:
        raise ToolchainError("the reports span " + "; ".join(f"{g} {p} {v}" for g, p, v in sorted(keys)),
                             "calibrate one GPU, path and TensorRT-LLM version at a time")
    gpu, path, version = keys.pop()
    if any(c.point.concurrency is None and c.point.ttft_ms for c in cases):
        notes.append("TTFT and TPOT of maximum-throughput runs (every request queued at once) are the queue's: "
                     "only their throughput is fitted")
    device = gpus.lookup(str(gpu))
    base = shipped_row(device, str(path), str(version))
    params, why = parameters_for(cases, base.kernels)
    x = fit(cases, base, params)
    eff = apply(base, params, x)
    before, after = errors_pct(cases, base), errors_pct(cases, eff)
    loo = None
    if leave_one_out and len(reports) >= 3:
        held: list[float] = []
        for report in reports:
            rest = [c for c in cases if c.report is not report]
            mine = [c for c in cases if c.report is report]
            held += errors_pct(mine, apply(base, params, fit(rest, base, params, x, rounds=1, iterations=40)))
        loo = round(mean(held), 2)
    if version != TRTLLM_VERSION:
        notes.append(f"plans read rows of TensorRT-LLM {TRTLLM_VERSION} (the release this toolchain deploys); this "
                     f"row is of {version}: pass --version {TRTLLM_VERSION} to file runs under it if they stand for it")
    names = [f.name for f in dataclasses.fields(perf.Efficiency)]
    doc = {
        "gpu": gpu, "path": path, "trtllm_version": version,
        "date": today or datetime.date.today().isoformat(),
        "row": {n: round(float(getattr(eff, n)), 6) for n in names},
        "shipped": {n: round(float(getattr(base, n)), 6) for n in names},
        "fitted": {"parameters": list(params), "fields": fitted_fields(params), "why": why,
                   "multipliers": {p: round(math.exp(v), 4) for p, v in zip(params, x, strict=True)}},
        "objective": f"mean absolute log error (throughput and TPOT 1, TTFT {TTFT_WEIGHT}) + {PRIOR} x the mean "
                     "squared log-multiplier, Nelder-Mead from the shipped row",
        "error_pct": {"before": round(mean(before), 2), "after": round(mean(after), 2), "leave_one_out": loo,
                      "values": len(after)},
        "reports": [{"path": str(r.file.resolve()), "sha256": r.sha256, "format": r.format, "points": len(r.points)}
                    for r in reports],
        "points": [{"report": c.report.file.name, "label": c.point.label, "isl": c.point.isl, "osl": c.point.osl,
                    "concurrency": c.point.concurrency, "tp": c.facts.tp, "pp": c.facts.pp,
                    "model": Path(str(c.facts.model)).name, "measured": c.measured,
                    "before": {k: round(v, 3) for k, v in c.predict(base).items() if k in c.measured},
                    "after": {k: round(v, 3) for k, v in c.predict(eff).items() if k in c.measured}}
                   for c in cases],
        "notes": notes,
    }
    return Calibration(doc, base, eff, cases)
