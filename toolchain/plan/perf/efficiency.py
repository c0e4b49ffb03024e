"""The achieved fractions of each card's datasheet the model divides by: documented defaults, and the rows
fitted to measured runs (data/efficiency.json, made by tools/fit_efficiency.py), with the `basis` naming them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from toolchain.gpus import GPUS, Gpu


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
    kernel_scale: float = 1.0
    """Measured kernels (plan/perf/kernel_step.py): their time in serving over their time measured alone."""
    link_scale: float = 1.0
    """Measured kernels: an all-reduce's time in serving over its time measured alone (the shipped rows keep 1.0
    and fit `allreduce_us`; `toolchain calibrate` may scale both)."""
    allreduce_us: float = 0.0
    """Measured kernels: what serving adds to each all-reduce, in microseconds: the ranks wait for the slowest
    before the collective starts, which AIConfigurator's measurement of the collective alone leaves out. A fixed
    cost per call, not a scale: it weighs on a small model's many small messages (8B at TP8) and hardly on the
    large ones of a 70B or 405B step at high concurrency, where the measured collective's time holds."""
    attention_scale: float = 1.0
    """Measured kernels: attention's time in serving over its time measured alone, relative to kernel_scale (the
    serving kernels read a paged cache the collector's did not)."""
    kernels: bool = False
    """The row is the measured-kernel step's (KERNEL_ROWS): a step on it looks its kernels up where AIConfigurator's
    database has them (plan/perf/kernel_step.py); a roofline row never does."""


# The documented defaults, for what the fit does not reach (and the hand-computed tests' reference):
# bandwidth: the share of the datasheet bandwidth a step's bytes move at, what Databricks' "LLM Inference
#   Performance Engineering: Best Practices" (2023) calls model bandwidth utilization (MBU); a streaming copy gets
#   closest to the datasheet, a decode step's GEMVs and attention kernels less: 0.8.
# compute: the share of the dense peak the GEMMs and attention reach (model FLOPs utilization); large GEMMs get
#   near the peak, inference's skinny ones less: 0.7.
# link: the share of one direction of the link an all-reduce moves data at, which nccl-tests reports as "bus
#   bandwidth" (NVIDIA/nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for an all-reduce): 0.8.
DEFAULT_EFFICIENCY = Efficiency(bandwidth=0.80, compute=0.70, link=0.80)

FITTED_FILE = Path(__file__).resolve().parents[1] / "data" / "efficiency.json"
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


def _arch_of(name: str) -> str:
    return next(g.arch for g in GPUS if g.name == name)


for _arch in ("Ampere", "Ada", "Hopper", "Blackwell"):
    EFFICIENCY.setdefault(_arch, EFFICIENCY.get(CARRIED_FROM, DEFAULT_EFFICIENCY))
BASIS = "roofline x efficiencies fitted to AIConfigurator 0.12.0 silicon samples"
"""The start of every fitted prediction's `basis`; `basis_of` completes it for a card."""


KERNEL_ROW_META: dict[str, dict] = FITTED.get("kernel_row_meta", {})
"""Each measured-kernel row's runs: the cards (`cards`), the flow (`path`: engine or pytorch) and the TensorRT-LLM
release (`release`) they measured, and what they were (`runs`). The PyTorch rows are AIConfigurator's silicon
samples per card (the H100's on 1.0.0rc3; the H200's and B200's measured on 2025-10-29 without a recorded
version, the 1.1 line then current); the engine row is NVIDIA's 0.14 online-serving table (H100 and H200)."""
KERNEL_ROWS: dict[str, Efficiency] = {
    name: dataclasses.replace(EFFICIENCY[_arch_of(KERNEL_ROW_META[name]["cards"][0])], **row, kernels=True)
    for name, row in FITTED.get("kernel_rows", {}).items()}
"""The rows of the measured-kernel step (plan/perf/kernel_step.py): what serving adds to AIConfigurator's kernel
times (per step, per sequence, per request, and the kernels', attention's and all-reduces' time in serving over
alone), fitted per set of measured runs by tools/fit_efficiency.py."""
PREDICTED_RELEASE = "1.2"
"""The TensorRT-LLM release a plan predicts (the toolchain deploys 1.2.1); a published table names its own."""


def _release(version: str) -> float:
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major) + int("".join(c for c in minor if c.isdigit()) or 0) / 100


def kernel_row(gpu: Gpu, release: str | None = None, path: str | None = None) -> tuple[str, Efficiency] | None:
    """(the row's name, the row) a measured-kernel prediction on `gpu` takes for TensorRT-LLM `release`
    (PREDICTED_RELEASE by default) on `path`: what serving adds is the flow's, the software's and the host's more
    than the card's, so the row of the same path first, then of the nearest release, then of the card's own
    generation, then of the card itself; None when no row is fitted."""
    if not KERNEL_ROWS:
        return None
    want = _release(release or PREDICTED_RELEASE)

    def rank(name: str) -> tuple[bool, float, bool, bool]:
        meta = KERNEL_ROW_META[name]
        cards = meta["cards"]
        return (path is not None and meta["path"] != path, abs(_release(meta["release"]) - want),
                all(_arch_of(c) != gpu.arch for c in cards), gpu.name not in cards)

    name = min(sorted(KERNEL_ROWS), key=rank)
    return name, KERNEL_ROWS[name]


def measured_row(card: str, path: str) -> Efficiency:
    """The row fitted to `card`'s own runs on `path` (the fit's and its held-out check's)."""
    return next(KERNEL_ROWS[n] for n in sorted(KERNEL_ROWS)
                if card in KERNEL_ROW_META[n]["cards"] and KERNEL_ROW_META[n]["path"] == path)


def efficiency_of(gpu: Gpu, measured_kernels: bool = False, release: str | None = None,
                  path: str | None = None) -> Efficiency:
    """The card's row: the measured-kernel step's (`measured_kernels`, where a row is fitted; `kernel_row`) or
    the roofline's."""
    row = kernel_row(gpu, release, path) if measured_kernels else None
    if row is not None:
        return row[1]
    return EFFICIENCY.get(gpu.arch, DEFAULT_EFFICIENCY)


def basis_of(gpu: Gpu) -> str:
    """What a prediction on `gpu` rests on: the fit (the runs of its generation it was fitted to, with their
    TensorRT-LLM versions, and the held-out error), and whether this card itself, its generation, or neither was
    measured end to end."""
    held = FITTED.get("roofline_holdout_mape", FITTED["holdout_mape"])
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

