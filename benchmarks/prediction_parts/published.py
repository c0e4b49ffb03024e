"""NVIDIA's published trtllm-bench maximum throughputs against the performance model (never fitted to).

Issue 39's set is the Hopper/Ampere Llama points of release 0.17 (engine path) and release 1.0 (PyTorch path)
together: `published_within_15pct_fraction` (target >= 0.9) and `published_median_abs_error_pct` (target <= 8)
over both, the same per table (`published_v017_*`, `published_v1_0_*`) and per path (`published_by_path`), and
`published_tp_order_kept`: whether the predictions rank the TPs of each group of points (same model, GPU, format,
ISL/OSL, path and release, different TP) in the published order. The Blackwell FP4 points of release/1.2 (per GPU)
and release 1.0 (totals of the replica) are reported apart (`blackwell_fp4_published_*`), and so are the
mixture-of-experts families (`moe_families_published_*`).

    python benchmarks/prediction_parts/published.py [--json PATH]

benchmarks/prediction.py reports the same keys (`published_keys`).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402
from toolchain.plan import calibration as cal  # noqa: E402

HOPPER_TABLES = {"published_v017": cal.PUBLISHED, "published_v1_0": cal.PUBLISHED_V1_0}
"""The issue's set: release 0.17's engine-path points and release 1.0's PyTorch-path points (Hopper, and 0.17's
A100 column)."""
BLACKWELL_TABLES = {"release_1_2_per_gpu": cal.PUBLISHED_BLACKWELL_FP4, "release_1_0_totals": cal.PUBLISHED_V1_0_BLACKWELL_FP4}
"""The Blackwell NVFP4 Llama points, reported apart: release/1.2's (per GPU) and release 1.0's (the replica's)."""
WITHIN = (15, 20)
"""The bands whose shares are reported, in percent."""


@dataclass(frozen=True)
class Checked:
    """A published point, what the model predicts for it (per GPU where the point is), and the signed error."""

    point: cal.Published
    predicted: float

    @property
    def error_pct(self) -> float:
        return (self.predicted - self.point.output_tokens_per_s) / self.point.output_tokens_per_s * 100

    @property
    def path(self) -> str:
        """How trtllm-bench ran the point: the file's `path`, else the target the check plans it on."""
        return cal.point_path(self.point)

    def as_dict(self) -> dict[str, Any]:
        pt = self.point
        return {"model": pt.model, "gpu": pt.gpu, "method": pt.method, "isl": pt.isl, "osl": pt.osl, "tp": pt.tp,
                "attention_dp": pt.attention_dp, "published": pt.output_tokens_per_s, "per_gpu": pt.per_gpu,
                "predicted": round(self.predicted, 1), "path": self.path, "release": pt.release,
                "error_pct": round(self.error_pct, 1)}


def checked(path: Path) -> list[Checked]:
    return [Checked(pt, pred) for pt, pred in cal.published_check(path)]


def summary(rows: list[Checked]) -> dict[str, Any]:
    """How many points, the median |error| in percent, and the shares within +-15% and +-20% as fractions."""
    errors = [abs(c.error_pct) for c in rows]
    return {"points": len(rows), "median_abs_error_pct": round(median(errors), 1),
            **{f"within_{pct}pct_fraction": round(sum(e <= pct for e in errors) / len(errors), 3) for pct in WITHIN}}


def tp_order(rows: list[Checked]) -> dict[str, Any]:
    """Each group of points that differ only in TP (same model, GPU, format, ISL/OSL, path and release): whether
    sorting them by the predicted throughput gives the TPs in the order sorting by the published one does. The
    fraction of groups kept, and each broken group with both orders."""
    groups: dict[tuple, list[Checked]] = defaultdict(list)
    for c in rows:
        pt = c.point
        groups[(pt.model, pt.gpu, pt.method, pt.isl, pt.osl, c.path, pt.release)].append(c)
    compared = {key: members for key, members in groups.items() if len({c.point.tp for c in members}) > 1}
    broken = []
    for (model, gpu, method, isl, osl, path, release), members in sorted(compared.items(), key=lambda kv: str(kv[0])):
        published = [c.point.tp for c in sorted(members, key=lambda c: c.point.output_tokens_per_s)]
        predicted = [c.point.tp for c in sorted(members, key=lambda c: c.predicted)]
        if published != predicted:
            broken.append({"model": model, "gpu": gpu, "method": method, "isl": isl, "osl": osl, "path": path,
                           "release": release, "tp_by_published": published, "tp_by_predicted": predicted})
    n = len(compared)
    return {"groups": n, "kept": n - len(broken), "fraction": round((n - len(broken)) / n, 3) if n else None,
            "broken": broken}


def prefixed(prefix: str, figures: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}_{key}": value for key, value in figures.items() if key != "points"}


def published_keys() -> dict[str, Any]:
    """Every published key (see the module's docstring); signed errors are predicted over published, in percent."""
    out: dict[str, Any] = {}
    hopper: list[Checked] = []
    for name, path in HOPPER_TABLES.items():
        rows = checked(path)
        hopper += rows
        out.update(prefixed(name, summary(rows)))
    out["published_v1_0_points"] = [c.as_dict() for c in hopper if c.point.release == "1.0"]
    out.update(prefixed("published", summary(hopper)))
    out["published_point_count"] = len(hopper)
    out["published_by_path"] = {path: summary([c for c in hopper if c.path == path]) for path in cal.PATHS}
    order = tp_order(hopper)
    out["published_tp_order_kept"] = order
    out["published_tp_order_kept_fraction"] = order["fraction"]
    blackwell = {name: checked(path) for name, path in BLACKWELL_TABLES.items()}
    together = [c for rows in blackwell.values() for c in rows]
    out.update(prefixed("blackwell_fp4_published", summary(together)))
    out["blackwell_fp4_published_by_table"] = {name: summary(rows) for name, rows in blackwell.items()}
    out["blackwell_fp4_published_points"] = [c.as_dict() for c in together]
    moe = checked(cal.PUBLISHED_MOE_FAMILIES)
    out.update(prefixed("moe_families_published", summary(moe)))
    out["moe_families_published_points"] = [c.as_dict() for c in moe]
    out["moe_families_published_by_model"] = {model: error_summary([c.error_pct for c in moe if c.point.model == model])
                                              for model in sorted({c.point.model for c in moe})}
    return out


def error_summary(errors: list[float]) -> dict[str, Any]:
    """One model's published points: how many, the median |error|, the worst signed error, how many within +-30%."""
    return {"points": len(errors), "median_abs_error_pct": round(median(abs(e) for e in errors), 1),
            "worst_error_pct": round(max(errors, key=abs), 1), "within_30_pct": sum(abs(e) <= 30 for e in errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the keys here")
    print_and_write(published_keys(), ap.parse_args().json)


if __name__ == "__main__":
    main()
