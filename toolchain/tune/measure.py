"""`toolchain tune --measure`: deploy the top candidates for real, bench each, and pick by measured goodput.

Each candidate runs through the pipeline's `deploy` (convert, build, repository, a real server, the spec's
workload and SLO, stop), as `toolchain deploy` runs it. A quantized candidate (weights or KV cache) must also
keep its quality: `toolchain eval`'s perplexity on the held-out text, against the unquantized model's (evaluated
once per run and reused), may rise by at most --max-ppl-increase-pct; one that rises more is not chosen, so speed
is never bought with quality silently. The choice is the highest goodput (requests/s meeting the SLO) among the
rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from toolchain.errors import ToolchainError
from toolchain.pipeline import deploy
from toolchain.quant.view import Quantization
from toolchain.spec import DeploymentSpec
from toolchain.stopsignals import stop_on_signals
from toolchain.targets import target_of
from toolchain.tune.candidates import derive
from toolchain.workspace import Workspace

Progress = Callable[[str, str], None]


@dataclass
class Measured:
    label: str
    spec: DeploymentSpec
    goodput_req_per_s: float | None = None
    output_tokens_per_s: float | None = None
    slo_passed: bool | None = None
    perplexity: float | None = None
    ppl_increase_pct: float | None = None
    quality_ok: bool = True
    error: str | None = None
    report: str | None = None
    notes: list[str] = field(default_factory=list)
    predicted: dict | None = None
    """The bench report's `prediction` at the run's concurrency (ttft_ms, tpot_ms, output_tokens_per_s and the
    ratio predicted / measured), so the ranking's prediction is set beside the measurement."""

    @property
    def eligible(self) -> bool:
        return self.error is None and self.quality_ok and self.goodput_req_per_s is not None

    def as_dict(self) -> dict:
        return {"label": self.label, "spec_name": self.spec.name, "goodput_req_per_s": self.goodput_req_per_s,
                "output_tokens_per_s": self.output_tokens_per_s, "slo_passed": self.slo_passed,
                "perplexity": self.perplexity, "ppl_increase_pct": self.ppl_increase_pct,
                "quality_ok": self.quality_ok, "error": self.error, "report": self.report, "notes": self.notes,
                "predicted": self.predicted}


def measurable(spec: DeploymentSpec) -> str | None:
    """Why --measure cannot deploy this spec here, or None: it runs what `toolchain deploy` runs on this host."""
    if target_of(spec).gpu_launch is not None:
        return (f"--measure deploys on this host, and target {spec.target} runs on GPUs: deploy the written specs "
                "on the GPU host and bench them there")
    return None


class Quality:
    """Perplexity of a candidate and of the unquantized model it derives from (evaluated once)."""

    def __init__(self, user_spec: DeploymentSpec, workspace: Workspace, progress: Progress):
        self.user_spec, self.workspace, self.progress = user_spec, workspace, progress
        self._baseline: float | None = None

    def baseline_spec(self) -> DeploymentSpec:
        if not Quantization.of(self.user_spec.quantization).active:
            return self.user_spec
        return derive(self.user_spec, {"name": f"{self.user_spec.name}-unquantized", "quantization.method": "none",
                                       "quantization.kv_cache": "none"})

    def perplexity(self, spec: DeploymentSpec) -> float:
        from toolchain.eval.run import run_eval  # torch

        return float(run_eval(spec, self.workspace, echo=lambda m: self.progress("eval", m))["perplexity"])

    def baseline(self) -> float:
        if self._baseline is None:
            self.progress("eval", "unquantized baseline")
            self._baseline = self.perplexity(self.baseline_spec())
        return self._baseline


def quality_check(m: Measured, quality: Quality, max_ppl_increase_pct: float) -> None:
    """Evaluate a quantized candidate's perplexity against the unquantized model's; mark it not eligible when it
    rises by more than the bound (or the eval fails)."""
    try:
        m.perplexity = quality.perplexity(m.spec)
        m.ppl_increase_pct = round((m.perplexity / quality.baseline() - 1.0) * 100.0, 3)
    except ToolchainError as err:
        m.error = f"eval: {err}"
        return
    m.quality_ok = m.ppl_increase_pct <= max_ppl_increase_pct
    if not m.quality_ok:
        m.notes.append(f"perplexity +{m.ppl_increase_pct:.2f}% > {max_ppl_increase_pct}% over the unquantized "
                       "model: not deployed, not chosen")


def deploy_one(m: Measured, workspace: Workspace, out: Path, progress: Progress) -> None:
    try:
        with stop_on_signals():
            report = deploy(m.spec, workspace, out, progress)
    except ToolchainError as err:
        m.error = str(err)
        return
    m.goodput_req_per_s = report.get("goodput_req_per_s")
    m.output_tokens_per_s = report.get("output_tokens_per_s")
    m.slo_passed = (report.get("slo") or {}).get("passed")
    m.report = str(out / "report.json")
    pred = report.get("prediction") or {}
    if pred.get("predicted"):
        m.predicted = {k: pred.get(k) for k in ("concurrency", "ttft_ms", "tpot_ms", "output_tokens_per_s",
                                                "ratio", "basis")}


def measure(ranked: list[tuple[str, DeploymentSpec]], top: int, user_spec: DeploymentSpec, workspace: Workspace,
            max_ppl_increase_pct: float, progress: Progress, deploy_given: bool = True,
            max_evals: int | None = None) -> tuple[list[Measured], Measured | None]:
    """Walk the ranked (label, spec) list: a quantized one is evaluated first and passed over when its perplexity
    rises too much; the first `top` that keep their quality are deployed and benched (reports in the
    workspace's reports/<spec name>). The user's spec gives the unquantized baseline, and with `deploy_given`
    is deployed too as "as given", for the gain.
    At most `max_evals` (default 3 x top) candidates are looked at. Returns every measurement and the chosen one
    (the highest goodput; None when none ran)."""
    quality = Quality(user_spec, workspace, progress)
    results: list[Measured] = []
    deployed = 0
    for label, spec in ranked[:max_evals or 3 * top]:
        if deployed >= top:
            break
        m = Measured(label, spec)
        results.append(m)
        if Quantization.of(spec.quantization).active:
            progress("measure", f"{label}: quality ({spec.name})")
            quality_check(m, quality, max_ppl_increase_pct)
            if not m.quality_ok or m.error:
                continue
        progress("measure", f"{label}: deploy ({spec.name})")
        deploy_one(m, workspace, workspace.report_dir(spec), progress)
        deployed += 1
    if deploy_given:
        m = Measured("as given", user_spec)
        progress("measure", f"as given: deploy ({user_spec.name})")
        deploy_one(m, workspace, workspace.report_dir(user_spec), progress)
        results.append(m)
    eligible = [m for m in results if m.eligible]
    best = max(eligible, key=lambda m: m.goodput_req_per_s or 0.0) if eligible else None
    return results, best
