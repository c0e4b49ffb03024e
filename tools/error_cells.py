"""Write toolchain/plan/data/error_cells.json: the cells plan/perf/error_bars.py takes each prediction's error bar from.

One row per cell, with the signed error of the CURRENT model's predicted output throughput over the known one:
- every published point of plan/calibration.py's files (release 0.17, engine path; release 1.0's Hopper and Blackwell
  tables and release/1.2's Blackwell and mixture-of-experts files, PyTorch path), predicted by `published_check`;
- every measured point the fit holds out (`held_out`), its closed-loop throughput by `predict_measured`.

Re-run after any change to the performance model or its fitted rows (tests/test_error_bars.py fails until then):

    PYTHONPATH=. python -m tools.error_cells [--check]

Deterministic (the files in a fixed order, errors rounded to 0.1%) and a few seconds long.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from toolchain.plan import calibration as cal
from toolchain.plan.perf.error_bars import CELLS_FILE, MIN_CELLS, grouped, left_out_check, params_billions

COLUMNS = ["source", "release", "path", "gpu", "method", "model", "params_b", "moe", "tp", "isl", "osl", "concurrency",
           "error_pct"]
PUBLISHED_FILES = (cal.PUBLISHED, cal.PUBLISHED_V1_0, cal.PUBLISHED_V1_0_BLACKWELL_FP4, cal.PUBLISHED_BLACKWELL_FP4,
                   cal.PUBLISHED_MOE_FAMILIES)
UNTAGGED_RELEASE = "1.2"
"""The release of a file whose header names none: release/1.2's perf-overview.md (published_blackwell_fp4.json,
published_moe_families.json), except Llama 4 Scout's rows, which that file's `source` says come from the v1.0 table."""
MEASURED_PATH = "pytorch"
"""AIConfigurator's measured runs were served by trtllm-serve with LLM-API options (InferenceMAX's launch scripts,
plan/calibration.py `batch_waiting`): the PyTorch backend, trtllm-serve's default since 1.0."""


def error_pct(predicted: float, known: float) -> float:
    return round((predicted - known) / known * 100, 1)


def release_of(pt: cal.Published) -> str:
    if pt.release is not None:
        return pt.release
    return "1.0" if pt.model == "llama-4-scout" else UNTAGGED_RELEASE


def params_b(model: str) -> float:
    return round(params_billions(cal.model_info(model).params), 1)


def moe(model: str) -> bool:
    return cal.model_info(model).params.is_moe


def published_rows() -> list[list]:
    rows = []
    for path in PUBLISHED_FILES:
        for pt, predicted in cal.published_check(path):
            rows.append(["published", release_of(pt), cal.point_path(pt), pt.gpu, pt.method, pt.model, params_b(pt.model),
                         moe(pt.model), pt.tp, pt.isl, pt.osl, None, error_pct(predicted, pt.output_tokens_per_s)])
    return rows


def measured_rows() -> list[list]:
    rows = []
    for pt in cal.measured_points():
        if cal.held_out(pt):
            _, _, throughput = cal.predict_measured(pt)
            rows.append(["measured", pt.backend_version, MEASURED_PATH, pt.gpu, pt.method, pt.model,
                         params_b(pt.model), moe(pt.model), pt.tp, pt.isl, pt.osl, pt.concurrency, error_pct(throughput, pt.throughput)])
    return rows


def document(rows: list[list]) -> str:
    """The file's text: its header, how the bars hold on groups left out (error_bars.left_out_check), `rows`."""
    check = left_out_check(grouped(tuple(dict(zip(COLUMNS, row, strict=True)) for row in rows)))
    head = {
        "what": "one cell per point whose throughput is known and never fitted to, with the signed error of the "
                "current model's predicted output throughput over it in percent; plan/perf/error_bars.py groups them "
                "by configuration for each prediction's error bar",
        "published": "NVIDIA's trtllm-bench maximum throughputs: " + ", ".join(p.name for p in PUBLISHED_FILES)
                     + " (plan/calibration.py published_check; concurrency null: the maximum)",
        "measured": "AIConfigurator 0.12.0's measured runs the fit holds out (silicon_points.json, calibration.held_out),"
                    " closed-loop output throughput at the run's concurrency; release: the backend version recorded",
        "params_b": "parameters in billions from the model's config.json, every expert counted (error_bars.params_billions); moe: a mixture of experts",
        "made_by": "PYTHONPATH=. python -m tools.error_cells",
        "left_out": f"each configuration of at least {MIN_CELLS} cells left out in turn, the bar of the others covers "
                    f"its own median |error| for {check['covered']} of {check['groups']}",
        "left_out_missed": check["missed"],
        "columns": COLUMNS,
    }
    text = json.dumps(head, indent=1)[:-2]
    return text + ',\n "rows": [\n' + ",\n".join(json.dumps(r) for r in rows) + "]}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only say whether the committed file is current")
    ap.add_argument("--out", type=Path, default=CELLS_FILE)
    args = ap.parse_args(argv)
    rows = published_rows() + measured_rows()
    text = document(rows)
    if args.check:
        current = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'current' if current else 'stale: run python -m tools.error_cells'}")
        return 0 if current else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(rows)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
