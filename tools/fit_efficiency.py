"""Fit the performance model's efficiency table to AIConfigurator's measured points (run by hand).

    PYTHONPATH=. python -m tools.fit_efficiency            # fit, print every point's error, write the table
    PYTHONPATH=. python -m tools.fit_efficiency --check    # print the errors of the committed table only

Reads toolchain/plan/data/silicon_points.json, fits one measured-kernel row (`kernel_rows`: what serving adds to
AIConfigurator's kernel times, PARAMS) per measured card to its training points (calibration.held_out says which
configurations are held out, and why), prints each point's measured and predicted TTFT, TPOT and throughput, the
MAPE on the training and the held-out points, and writes toolchain/plan/data/efficiency.json (the rows, the
split, the date, the held-out error), which plan/perf/efficiency.py loads; the roofline's rows (`rows`, for what
the kernel database lacks) are carried as they are. Each card's row is its own runs' (the H100's TensorRT-LLM
1.0.0rc3, the H200's and B200's a later release; `kernel_row_releases`): serving costs are the software's. The fit minimises the mean absolute log error of TPOT plus half that of TTFT
(TPOT decides throughput; measured TTFT carries more noise: queueing of a closed loop's bunched arrivals)
with a Nelder-Mead search, each parameter kept in its range by a transform. No NVIDIA published figure is
read here: those check the result (tests/test_perf_calibration.py) and are never fitted to.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys
from collections import defaultdict

from toolchain import gpus
from toolchain.plan import calibration as cal
from toolchain.plan import perf
from toolchain.plan.fit import nelder_mead

KERNELS = cal.DATA / "kernel_efficiency.json"

TTFT_WEIGHT = 0.5
RESTARTS = 3
PARAMS = ("kernel_scale", "attention_scale", "allreduce_us", "fixed_us", "seq_us", "ttft_ms")
"""What the measured-kernel step's row fits: the rest of a row (bandwidth, compute, link, latency) serves the
roofline alone, whose rows (`rows`, fitted 2026-12-03 before the kernel layer) are kept as they are. The
all-reduce keeps its measured time (link_scale 1.0) plus a fitted cost per call (`allreduce_us`): a scale fitted
to the H100's runs (8B at TP8, small messages) doubled the large collectives of a 70B or 405B step as well."""
FRACTIONS: set[str] = set()
CAPS = {"fixed_us": 1000.0, "seq_us": 25.0}
"""Upper bounds of the host's costs. The step overlaps them with the kernels (perf/step.py StepTime.overlapped),
so runs whose kernels take longer leave them unpinned and a search may wander to any size below the kernels' time;
a millisecond per step and 25 us per sequence are beyond what the PyTorch backend's executor loop spends."""
PRIOR = ("fixed_us", "seq_us")
PRIOR_WEIGHT = 0.002
"""Weight of the host costs' distance (absolute log) from START in the objective: where the runs do not pin them
they stay near the starting guess instead of drifting to a bound, which matters where a plan extrapolates (a
large batch that the measured concurrencies, at most 128, never reached)."""
START = {"kernel_scale": 1.0, "link_scale": 1.0, "attention_scale": 1.0, "fixed_us": 300.0, "seq_us": 5.0,
         "ttft_ms": 50.0, "allreduce_us": 5.0}


def to_eff(x: list[float], base: perf.Efficiency = perf.DEFAULT_EFFICIENCY) -> perf.Efficiency:
    values: dict = {"kernels": True}
    for name, v in zip(PARAMS, x, strict=True):
        values[name] = 1 / (1 + math.exp(-v)) if name in FRACTIONS else min(math.exp(v), CAPS.get(name, math.inf))
    return dataclasses.replace(base, **values)


def from_eff(values: dict[str, float]) -> list[float]:
    return [math.log(values[n] / (1 - values[n])) if n in FRACTIONS else math.log(values[n]) for n in PARAMS]


def loss(points, eff: perf.Efficiency) -> float:
    total = 0.0
    for pt in points:
        ttft, tpot, _ = cal.predict_measured(pt, eff)
        total += abs(math.log(tpot / pt.tpot_ms)) + TTFT_WEIGHT * abs(math.log(ttft / pt.ttft_ms))
    prior = sum(abs(math.log(getattr(eff, n) / START[n])) for n in PRIOR)
    return total / len(points) + PRIOR_WEIGHT * prior


# Generations without end-to-end measurements, and the card whose kernel measurements scale Hopper's row to them.
DERIVED = {"Ampere": "A100 80GB", "Ada": "L40S"}
REFERENCE = "Hopper"


def derive_rows(rows: dict[str, dict[str, float]]) -> dict[str, str]:
    """Add a row for each generation of DERIVED: the fitted Hopper row with its bandwidth and compute fractions
    scaled by how that card's GEMMs reach its datasheet against how Hopper's do, in AIConfigurator's kernel
    measurements (data/kernel_efficiency.json); the fixed costs, link and all-reduce terms carry over (host and
    software, not the card). Returns what each derived row rests on."""
    kernels = json.loads(KERNELS.read_text())["cards"]
    hopper = [k for name, k in kernels.items() if gpus.lookup(name).arch == REFERENCE]
    ref = {f: sum(k[f] for k in hopper) / len(hopper) for f in ("bandwidth", "compute")}
    notes = {}
    for arch, card in DERIVED.items():
        scale = {f: kernels[card][f] / ref[f] for f in ref}
        row = dict(rows[REFERENCE])
        for f, ratio in scale.items():
            row[f] = round(min(1.0, row[f] * ratio), 4)
        rows[arch] = row
        notes[arch] = (f"{REFERENCE}'s row, bandwidth x {scale['bandwidth']:.3f} and compute x {scale['compute']:.3f}: "
                       f"{card}'s GEMM efficiencies over {REFERENCE}'s in AIConfigurator's kernel measurements")
        print(f"{arch}: {notes[arch]}: {row}")
    return notes


def arch_of(point: cal.Measured) -> str:
    return gpus.lookup(point.gpu).arch


def report(points, eff_of) -> None:
    print(f"{'config':48} {'C':>4} {'split':5} {'TTFT ms meas/pred':>19} {'TPOT ms meas/pred':>19} "
          f"{'tok/s meas/pred':>17}")
    for pt in points:
        ttft, tpot, tput = cal.predict_measured(pt, eff_of(pt))
        name = f"{pt.model} {pt.gpu} {pt.method} tp{pt.tp} {pt.isl}/{pt.osl}"
        print(f"{name:48} {pt.concurrency:>4} {'held' if cal.held_out(pt) else 'train':5} "
              f"{pt.ttft_ms:>9.1f}/{ttft:<9.1f} {pt.tpot_ms:>9.2f}/{tpot:<9.2f} {pt.throughput:>8.0f}/{tput:<8.0f}")
    for label, keep in (("train", lambda p: not cal.held_out(p)), ("held-out", cal.held_out)):
        part = [p for p in points if keep(p)]
        errors = cal.mape(part, eff_of)
        print(f"{label:9} {len(part):4} points: MAPE TTFT {errors['ttft']:.1f}%  TPOT {errors['tpot']:.1f}%  "
              f"throughput {errors['throughput']:.1f}%")


UNRECORDED_RELEASE = "1.1"
"""The release of AIConfigurator's runs that record none (H200 and B200, measured 2025-10-29): the 1.1 line was
TensorRT-LLM's current one then (1.0 shipped in September 2025, 1.2 later). An assumption the rows' meta states."""


def release_of(version: str) -> str:
    return UNRECORDED_RELEASE if version == "not recorded" else ".".join(version.split(".")[:2])


def groups(points) -> dict[str, list]:
    """The runs each row is fitted to: AIConfigurator's, per card (all of the PyTorch path)."""
    out: dict[str, list] = defaultdict(list)
    for pt in points:
        out[pt.gpu].append(pt)
    return out


def meta_of(name: str, points) -> dict:
    cards = sorted({p.gpu for p in points})
    runs = sorted({(p.model, p.method, p.backend_version, p.measured) for p in points})
    what = "; ".join(f"{m} {'bf16' if q == 'none' else q}, TensorRT-LLM "
                     + (v if v != "not recorded" else f"version not recorded, measured {when}")
                     for m, q, v, when in runs)
    return {"cards": cards, "path": "pytorch", "release": release_of(points[0].backend_version),
            "runs": f"{name}'s measured runs (AIConfigurator 0.12.0 silicon samples, the PyTorch path: {what})"}


def main(argv: list[str]) -> int:
    points = cal.measured_points()
    if "--check" in argv:
        report(points, lambda p: None)
        return 0
    rows: dict[str, dict[str, float]] = {}
    meta: dict[str, dict] = {}
    for name, members in sorted(groups(points).items()):
        train = [p for p in members if not cal.held_out(p)]
        base = perf.EFFICIENCY[gpus.lookup(members[0].gpu).arch]
        best = from_eff(START)
        for _ in range(RESTARTS):  # a simplex can stall; restarting from its best point is the usual cure
            best = nelder_mead(lambda x, train=train, base=base: loss(train, to_eff(x, base)), best)
        eff = to_eff(best, base)
        rows[name] = {n: round(getattr(eff, n), 4) for n in PARAMS}
        meta[name] = meta_of(name, members)
        print(f"{name}: {len(train)} training points, loss {loss(train, eff):.4f}: {rows[name]}")
    fitted = {name: dataclasses.replace(perf.EFFICIENCY[gpus.lookup(meta[name]["cards"][0]).arch], **row,
                                        kernels=True) for name, row in rows.items()}

    def row_of(p):
        return fitted[p.gpu]

    report(points, row_of)
    held = cal.mape((p for p in points if cal.held_out(p)), row_of)
    doc = dict(perf.FITTED)
    doc.pop("kernel_row_releases", None)
    doc.update({
        "split": (f"whole configurations (model, GPU, format, TP, ISL/OSL) held out: every {cal.HOLDOUT_EVERY}th "
                  "in sorted order (toolchain/plan/calibration.py held_out)"),
        "objective": f"mean absolute log error of TPOT + {TTFT_WEIGHT} x that of TTFT, Nelder-Mead",
        "kernel_rows_fitted": datetime.date.today().isoformat(),
        "made_by": "PYTHONPATH=. python -m tools.fit_efficiency",
        "holdout_mape": {k: round(v, 2) for k, v in held.items()},
        "kernel_rows": rows,
        "kernel_row_meta": meta,
    })
    cal.EFFICIENCY_FILE.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {cal.EFFICIENCY_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
