"""Achieved fractions of the datasheet in AIConfigurator's per-kernel measurements, per GPU (run by hand).

    pip download --no-deps aiconfigurator-core==0.12.0 -d /tmp/aic && unzip -o /tmp/aic/*.whl -d /tmp/aic/wheel
    python -m venv /tmp/aicv && /tmp/aicv/bin/pip install pandas pyarrow
    /tmp/aicv/bin/python tools/kernel_efficiency.py /tmp/aic/wheel/aiconfigurator_core/systems/data

For each card it reads the bf16 GEMMs TensorRT-LLM ran (systems/data/<system>/gemm/trtllm/<version>/
gemm_perf.parquet: m, n, k, latency in ms) and writes toolchain/plan/data/kernel_efficiency.json:
- bandwidth: the median over decode-like GEMMs (m <= 8 rows, a weight of at least 8192 x 8192) of the weight's
  bytes over the latency, as a share of the datasheet bandwidth (toolchain/gpus.py);
- compute: the median over large GEMMs (m, n, k >= 4096) of 2mnk over the latency, as a share of the dense
  bf16 peak.
tools/fit_efficiency.py scales the fitted Hopper row by these ratios for the generations without end-to-end
measurements (Ampere: a100_sxm, Ada: l40s). Needs pandas and pyarrow, which the project does not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

OUT = Path(__file__).resolve().parents[1] / "toolchain" / "plan" / "data" / "kernel_efficiency.json"
# AIConfigurator system -> the toolchain's GPU name, datasheet bandwidth GB/s and dense bf16 TFLOP/s (gpus.py)
CARDS = {"a100_sxm": ("A100 80GB", 2039.0, 312.0), "h100_sxm": ("H100 80GB", 3350.0, 989.4),
         "h200_sxm": ("H200 141GB", 4800.0, 989.4), "l40s": ("L40S", 864.0, 362.05),
         "b200_sxm": ("B200 180GB", 8000.0, 2250.0)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/kernel_efficiency.py PATH/aiconfigurator_core/systems/data", file=sys.stderr)
        return 2
    root = Path(argv[0])
    cards = {}
    for system, (name, bandwidth, peak) in CARDS.items():
        files = sorted(root.glob(f"{system}/gemm/trtllm/*/gemm_perf.parquet"))
        d = pd.concat(pd.read_parquet(f) for f in files)
        d = d[d.gemm_dtype == "bfloat16"]
        gemv = d[(d.m <= 8) & (d.n * d.k >= 8192 * 8192)]
        big = d[(d.m >= 4096) & (d.n >= 4096) & (d.k >= 4096)]
        gb_s = (gemv.n * gemv.k * 2 / (gemv.latency * 1e-3) / 1e9).median()
        tflops = (2 * big.m * big.n * big.k / (big.latency * 1e-3) / 1e12).median()
        cards[name] = {"system": system, "tensorrt_llm": sorted({f.parent.name for f in files}),
                       "bandwidth": round(gb_s / bandwidth, 4), "compute": round(tflops / peak, 4),
                       "gemv_kernels": int(len(gemv)), "gemm_kernels": int(len(big))}
        print(name, cards[name])
    doc = {"source": "aiconfigurator-core 0.12.0 (PyPI, Apache-2.0, NVIDIA): aiconfigurator_core/systems/data/"
                     "<system>/gemm/trtllm/<version>/gemm_perf.parquet, bf16 GEMMs",
           "bandwidth": "median achieved bytes/s of GEMMs with m <= 8 and n x k >= 8192^2 / datasheet bandwidth",
           "compute": "median achieved FLOP/s of GEMMs with m, n, k >= 4096 / dense bf16 peak",
           "made_by": "tools/kernel_efficiency.py (this repository)",
           "cards": cards}
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
