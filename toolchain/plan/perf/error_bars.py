"""How far to trust a GPU prediction: the error the model makes on the measured cells nearest to it.

A cell is one point whose throughput is known and was never fitted to: each of NVIDIA's published trtllm-bench
maximum throughputs (release 0.17 on the engine path, 1.0 and release/1.2 on the PyTorch path, Blackwell FP4 and the
mixture-of-experts families included) and each of AIConfigurator's measured runs the fit holds out
(plan/calibration.py `held_out`), with the signed error of the current model's predicted output throughput.
`tools/error_cells.py` computes them into data/error_cells.json (one command; tests/test_error_bars.py fails when
the file no longer matches the model); this module only reads that file.

`error_bar(gpu, method, params_b, tp, path, moe=...)` groups the cells by configuration (GPU, format, model size,
dense or mixture of experts, TP, path; releases and ISL/OSL mixes pooled) and takes the nearest groups by
`distance` until at least MIN_CELLS cells are in hand. The bar is the median |error| of those cells, widened by WIDEN_PER_DISTANCE for each unit of distance
to the farthest group taken, since a configuration nobody measured can be off in ways its neighbours are not.
The weights below are a judgement, documented here, not a fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from statistics import median

from toolchain import gpus
from toolchain.archs.params import ArchParams
from toolchain.errors import ToolchainError
from toolchain.plan.memory import rank_weights
from toolchain.quant.view import Quantization

CELLS_FILE = Path(__file__).resolve().parents[1] / "data" / "error_cells.json"

MIN_CELLS = 3
"""A bar rests on at least this many cells; fewer in the nearest group and the next nearest join it."""
OTHER_GPU_SAME_GENERATION = 1.0
"""Distance for another card of the query card's architecture generation (gpus.Gpu.arch: H100 for H200)."""
OTHER_GENERATION = 2.0
"""Distance for a card of another generation (or a card not in the GPU table)."""
OTHER_METHOD = 1.0
"""Distance for another quantization format (fp8 cells for an int4 query)."""
SIZE_PER_E_FOLD = 1.0
"""Distance per factor e between the model sizes (|ln ratio| of the parameter counts): 8B to 70B is 2.2."""
SAME_SIZE = 0.01
"""Sizes within 1% (|ln ratio|) are the same model's: the cells hold the count rounded to 0.1 billion."""
TP_PER_DOUBLING = 0.5
"""Distance per doubling of TP (|log2 ratio|): TP1 to TP4 is 1."""
OTHER_PATH = 0.5
"""Distance for the other path (engine cells for a PyTorch-backend query): the same model and card on the other
runtime, whose step overheads differ."""
OTHER_KIND = 1.0
"""Distance between a mixture of experts and a dense model (when the query says which it is)."""
WIDEN_PER_DISTANCE = 0.25
"""The bar grows by this share of itself per unit of distance to the farthest group it rests on."""
MAX_DISTANCE = 4.0
"""Beyond this no cell says anything about the query: no bar."""


def params_billions(p: ArchParams) -> float:
    """The model's parameters in billions, every expert counted (a mixture of experts' total, not its active
    share): one rank's weights at one byte a value, unsharded (plan/memory.py rank_weights, tp 1, pp 1)."""
    return rank_weights(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=1).total / 1e9


@dataclass(frozen=True)
class Group:
    """The cells of one configuration: releases, ISL/OSL mixes and (measured) concurrencies pooled."""

    gpu: str
    method: str
    params_b: float
    moe: bool
    tp: int
    path: str
    errors: tuple[float, ...]
    sources: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.gpu} {self.method} {self.params_b:.3g}B{' MoE' if self.moe else ''} tp{self.tp} {self.path}"

    def counted(self) -> str:
        """'10 published cells', '4 published + 12 measured cells'."""
        kinds = [f"{self.sources.count(kind)} {kind}" for kind in sorted(set(self.sources), reverse=True)]
        return f"{' + '.join(kinds)} cell{'s' if len(self.errors) > 1 else ''}"


NEEDED = ("source", "gpu", "method", "params_b", "moe", "tp", "path", "error_pct")
"""The columns a bar reads (tools/error_cells.py writes more)."""


@cache
def cells() -> tuple[dict, ...]:
    """The rows of data/error_cells.json as dicts; none while the file is missing or lacks a column this module
    reads, so that tools/error_cells.py, which predicts through `perf.predict`, can always rewrite it
    (tests/test_error_bars.py fails on such a file)."""
    if not CELLS_FILE.exists():
        return ()
    doc = json.loads(CELLS_FILE.read_text())
    if not set(NEEDED) <= set(doc["columns"]):
        return ()
    return tuple(dict(zip(doc["columns"], row, strict=True)) for row in doc["rows"])


@cache
def groups() -> tuple[Group, ...]:
    return grouped(cells())


def grouped(rows: tuple[dict, ...]) -> tuple[Group, ...]:
    """Cells (dicts with NEEDED's keys) pooled by configuration, in a fixed order."""
    by: dict[tuple, list[dict]] = {}
    for c in rows:
        by.setdefault((c["gpu"], c["method"], c["params_b"], c["moe"], c["tp"], c["path"]), []).append(c)
    return tuple(Group(gpu, method, params_b, moe, tp, path, tuple(c["error_pct"] for c in members),
                       tuple(c["source"] for c in members))
                 for (gpu, method, params_b, moe, tp, path), members in sorted(by.items()))


def _arch(gpu: str) -> str | None:
    try:
        return gpus.lookup(gpu).arch
    except ToolchainError:
        return None


def distance(group: Group, gpu: str, method: str, params_b: float, tp: int, path: str,
             moe: bool | None = None) -> tuple[float, list[str]]:
    """How far a group's configuration is from the query, and what differs, in words."""
    d, differs = 0.0, []
    if group.gpu != gpu:
        arch = _arch(gpu)
        if arch is not None and _arch(group.gpu) == arch:
            d += OTHER_GPU_SAME_GENERATION
            differs.append(f"other GPU of the same generation, {arch}")
        else:
            d += OTHER_GENERATION
            differs.append(f"another generation: {_arch(group.gpu)} for {gpu}'s {arch or 'unknown'}")
    if group.method != method:
        d += OTHER_METHOD
        differs.append(f"{group.method} for {method}")
    if abs(math.log(group.params_b / params_b)) > SAME_SIZE:
        d += SIZE_PER_E_FOLD * abs(math.log(group.params_b / params_b))
        differs.append(f"{group.params_b:.3g}B for {params_b:.3g}B")
    if moe is not None and group.moe != moe:
        d += OTHER_KIND
        differs.append("a mixture of experts for a dense model" if group.moe else "a dense model for a mixture of experts")
    if group.tp != tp:
        d += TP_PER_DOUBLING * abs(math.log2(group.tp / tp))
        differs.append(f"tp{group.tp} for tp{tp}")
    if group.path != path:
        d += OTHER_PATH
        differs.append(f"{group.path} path for {path}")
    return d, differs


def error_bar(gpu: str, method: str, params_b: float, tp: int, path: str, moe: bool | None = None,
              among: tuple[Group, ...] | None = None) -> dict | None:
    """{"pct": the median |error| in percent of the nearest cells (widened with their distance), "cells": how
    many, "nearest": what matched and how far, "distance"}; None when no cell is within MAX_DISTANCE. `moe`: whether
    the model is a mixture of experts (None: not considered); `among`: these groups instead of the file's."""
    pool = groups() if among is None else among
    ranked = sorted(((*distance(g, gpu, method, params_b, tp, path, moe), g) for g in pool),
                    key=lambda r: (r[0], r[2].label))
    taken: list[tuple[float, list[str], Group]] = []
    for row in ranked:
        if row[0] > MAX_DISTANCE or sum(len(g.errors) for _, _, g in taken) >= MIN_CELLS:
            break
        taken.append(row)
    if not taken:
        return None
    far = max(d for d, _, _ in taken)
    errors = [abs(e) for _, _, g in taken for e in g.errors]
    pct = median(errors) * (1 + WIDEN_PER_DISTANCE * far)
    if far == 0:
        nearest = f"{taken[0][2].label}: {taken[0][2].counted()}"
    else:
        parts = [f"{g.label}, {g.counted()}" + (f" ({'; '.join(differs)})" if differs else "")
                 for _, differs, g in taken]
        nearest = f"nearest: {' and '.join(parts)}; widened x{1 + WIDEN_PER_DISTANCE * far:.2f}"
    return {"pct": round(pct, 1), "cells": len(errors), "nearest": nearest, "distance": round(far, 2)}


def bar_text(bar: dict | None) -> str:
    """'±12%', as plan and tune print a bar beside a predicted throughput; '-' without one."""
    return f"±{bar['pct']:.0f}%" if bar else "-"


def left_out_check(pool: tuple[Group, ...]) -> dict:
    """How well the bars hold on configurations they did not see: each group of at least MIN_CELLS cells left out
    in turn, whether the bar the other groups give its configuration covers the group's own median |error|."""
    checked = [g for g in pool if len(g.errors) >= MIN_CELLS]
    missed = []
    for g in checked:
        bar = error_bar(g.gpu, g.method, g.params_b, g.tp, g.path, g.moe, among=tuple(x for x in pool if x is not g))
        own = median(abs(e) for e in g.errors)
        if bar is None or own > bar["pct"]:
            against = "no bar" if bar is None else f"+-{bar['pct']}%"
            missed.append(f"{g.label}: {own:.1f}% against {against}")
    return {"groups": len(checked), "covered": len(checked) - len(missed), "missed": missed}
