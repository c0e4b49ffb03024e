"""Extract the measured points the performance model is fitted to from AIConfigurator's silicon samples.

Run by hand, once per AIConfigurator release (the wheel is not a dependency and is never committed):

    pip download --no-deps aiconfigurator-core==0.12.0 -d /tmp/aic
    unzip -o /tmp/aic/aiconfigurator_core-0.12.0-*.whl -d /tmp/aic/wheel
    python -m tools.silicon_points /tmp/aic/wheel/aiconfigurator_core/systems/silicon_sample.csv

It keeps the TensorRT-LLM aggregated-serving rows of the dense Llama-3.1 models on the cards and formats the
toolchain models (bf16 and fp8; the fp4 rows have no quantization method here yet) and writes
toolchain/plan/data/silicon_points.json: one row per (configuration, concurrency) with the measured mean TTFT
and TPOT, and the provenance of the whole file. The figures are facts; nothing of the wheel's code is used.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "toolchain" / "plan" / "data" / "silicon_points.json"
WHEEL = "aiconfigurator-core 0.12.0 (PyPI, Apache-2.0, NVIDIA)"
MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-70B": "llama-3.1-70b"}
GPUS = {"h100_sxm": "H100 80GB", "h200_sxm": "H200 141GB", "b200_sxm": "B200 180GB"}
# The 8B rows leave precision and gemm_quant_mode empty: the checkpoint (meta-llama/Llama-3.1-8B-Instruct) is
# bf16 and nothing quantizes it, so they are the unquantized half-precision model.
PRECISIONS = {"": "none", "bf16": "none", "fp8": "fp8"}
COLUMNS = ["model", "gpu", "method", "tp", "isl", "osl", "concurrency", "ttft_ms", "tpot_ms", "backend_version",
           "measured", "id"]


def measured_on(source: str) -> str:
    """The `measured=` date of the silicon_data_source field, or "" when it names none."""
    for part in source.split(";"):
        key, _, value = part.strip().partition("=")
        if key == "measured":
            return value[:10]
    return ""


def extract(path: Path) -> list[list]:
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if (r["backend"] != "trtllm" or r["mode"] != "agg" or r["model_path"] not in MODELS
                    or r["system"] not in GPUS or r["precision"] not in PRECISIONS or r["pp_size"] != "1"):
                continue
            rows.append([MODELS[r["model_path"]], GPUS[r["system"]], PRECISIONS[r["precision"]], int(r["tp_size"]),
                         int(r["isl"]), int(r["osl"]), int(r["batch_size"]), round(float(r["silicon_ttft_ms"]), 3),
                         round(float(r["silicon_tpot_ms"]), 4), r["backend_version"] or "not recorded",
                         measured_on(r["silicon_data_source"]), r["id"]])
    rows.sort(key=lambda x: (x[0], x[1], x[2], x[3], x[4], x[5], x[6]))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tools.silicon_points PATH/TO/silicon_sample.csv", file=sys.stderr)
        return 2
    rows = extract(Path(argv[0]))
    doc = {
        "source": f"{WHEEL}: aiconfigurator_core/systems/silicon_sample.csv",
        "licence": "Apache-2.0 (the wheel's License-Expression)",
        "kept": ("backend trtllm, mode agg, pp 1; meta-llama/Llama-3.1-8B-Instruct (bf16) and "
                 "meta-llama/Llama-3.1-70B (fp8) on h100_sxm, h200_sxm and b200_sxm; batch_size is the "
                 "concurrency of the closed-loop run; ttft_ms and tpot_ms are the measured means"),
        "made_by": "python -m tools.silicon_points (this repository)",
        "columns": COLUMNS,
        "rows": rows,
    }
    text = json.dumps(doc, indent=None, separators=(",", ":"))
    # one row per line, so a diff shows which points changed
    text = text.replace(',"rows":[[', ',"rows":[\n[').replace("],[", "],\n[")
    OUT.write_text(text + "\n")
    print(f"wrote {len(rows)} points to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
