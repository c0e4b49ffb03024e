"""Golden files for tests/test_fp4_math.py: nvidia-modelopt 0.47's own NVFP4, MXFP4 and FP8 block packing.

ModelOpt is no dependency of the project, so the tests cannot call it. This script runs it once, on small
seeded weights, and writes what it returned next to the inputs it was given:

- nvfp4.safetensors: per case `<case>.weight` (the input), `<case>.global_scale` (given, or ModelOpt's
  `get_weights_scaling_factor_2`), and ModelOpt's `<case>.packed` (uint8 [out, in/2]), `<case>.block_scale`
  (float8_e4m3fn [out, in/16]) and `<case>.dequantized` (float32). They come from `NVFP4QTensor.quantize`
  and `NVFP4QTensor.dequantize`. The cases are a crafted tensor with a global scale of 0.5 (E2M1 tie points,
  an all-zero block, a block beyond the 448 clamp, one below the 2**-9 clamp), wide-range random rows with
  the scale left to ModelOpt, and a bfloat16 tensor.
- mxfp4.safetensors: gpt-oss-shaped expert tensors (gate_up_proj [E, 2I, H/32, 16] blocks and [E, 2I, H/32]
  E8M0 scales, down_proj [E, H, I/32, 16] and [E, H, I/32]) with `MXFP4QTensor.dequantize` of each
  (float32 [E, rows, in]). Also `quant.weight`, a float tensor, with `MXFP4QTensor.quantize`'s blocks and
  scales reshaped to the gpt-oss layout.
- fp8_block.safetensors: `fp8.weight` ([129, 130], bf16 values, quantized as float32, so every edge tile is
  partial) with `FP8QTensor.quantize(..., block_sizes={-1: 128, -2: 128})`'s e4m3 weight and scale grid.
- fp4_golden.json: provenance, i.e. the ModelOpt and torch versions, the functions called, and the cases.

Run it with a Python that has nvidia-modelopt 0.47.0 (torch 2.13, numpy<2, plus requests and huggingface_hub,
which modelopt.torch imports):

    python3 -m venv /work/venvs/modelopt
    /work/venvs/modelopt/bin/pip install "torch==2.13.0" "numpy<2" "nvidia-modelopt==0.47.0" requests huggingface_hub
    /work/venvs/modelopt/bin/python tools/fp4_golden.py [--out tests/data/fp4_golden]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "fp4_golden"
SEED = 35


def _wide_rows(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Random rows whose magnitudes span 1e-3 to 1e2, so block scales span most of e4m3's range."""
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows)[:, None]


def _crafted_nvfp4(g: torch.Generator) -> torch.Tensor:
    """[4, 64] for a global scale of 0.5. A block whose amax is 6 gets block scale 6 / (6 * 0.5) = 2, so
    its values are divided by exactly 1: the E2M1 midpoints in it round as written."""
    w = torch.randn(4, 64, generator=g)
    w[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                              -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.1])
    w[0, 16:32] = torch.tensor([-6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0,
                                -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, 6.5, -0.0])
    w[1, :16] = 0.0  # all-zero block: scale 1.0
    w[1, 16:32] = torch.linspace(-2000.0, 2000.0, 16)  # block scale 2000/3 clamps to 448
    w[2, :16] = torch.linspace(-1e-4, 1e-4, 16)  # block scale clamps up to 2**-9
    w[3] *= 50.0
    return w


def nvfp4_cases(g: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    wide = _wide_rows(g, 32, 128)
    wide[5, 32:48] = 0.0
    return {
        "crafted": (_crafted_nvfp4(g), torch.tensor(0.5)),
        "wide": (wide, None),
        "bf16": (_wide_rows(g, 16, 64).to(torch.bfloat16), None),
    }


def nvfp4_golden(cases) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    out = {}
    for name, (w, global_scale) in cases.items():
        qt, block_scale, gs = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=global_scale)
        deq = qt.dequantize(dtype=torch.float32, scale=block_scale, double_scale=gs, block_sizes={-1: 16})
        out |= {f"{name}.weight": w, f"{name}.global_scale": gs.float().reshape(()),
                f"{name}.packed": qt._quantized_data, f"{name}.block_scale": block_scale,
                f"{name}.dequantized": deq}
    return out


def _gpt_oss_scales(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """E8M0 exponents around 2^0 as gpt-oss's checkpoints hold them, plus the extremes 0 and 254."""
    s = torch.randint(118, 131, shape, generator=g, dtype=torch.uint8)
    s.view(-1)[0], s.view(-1)[1] = 0, 254
    return s


def mxfp4_golden(g: torch.Generator) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    experts, hidden, inter = 2, 64, 32
    out = {}
    for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = _gpt_oss_scales(g, (experts, rows, cols // 32))
        deq = MXFP4QTensor(blocks.shape, torch.float32, blocks).dequantize(
            dtype=torch.float32, scale=scales, block_sizes={-1: 32})
        out |= {f"{proj}_blocks": blocks, f"{proj}_scales": scales,
                f"{proj}.dequantized": deq.reshape(experts, rows, cols)}

    w = torch.randn(2, 8, 64, generator=g) * torch.logspace(-4, 3, 8)[:, None]
    w[0, 0, :32] = 0.0  # all-zero block: scale 2^-127, stored as E8M0 0
    w[0, 1, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)  # scale 2^0: ties as written
    w[0, 1, 32:] = -w[0, 1, :32]
    qt, scales = MXFP4QTensor.quantize(w.clone(), 32)
    out |= {"quant.weight": w, "quant.blocks": qt._quantized_data.reshape(2, 8, 2, 16),
            "quant.scales": scales.reshape(2, 8, 2)}
    return out


def fp8_block_golden(g: torch.Generator) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor import FP8QTensor

    w = (torch.randn(129, 130, generator=g) * torch.logspace(-2, 1, 129)[:, None]).to(torch.bfloat16)
    qt, scale = FP8QTensor.quantize(w.float(), block_sizes={-1: 128, -2: 128})
    return {"fp8.weight": w, "fp8.quantized": qt._quantized_data.contiguous(), "fp8.scale": scale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    import modelopt

    g = torch.Generator().manual_seed(SEED)
    cases = nvfp4_cases(g)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(nvfp4_golden(cases), str(args.out / "nvfp4.safetensors"))
    save_file(mxfp4_golden(g), str(args.out / "mxfp4.safetensors"))
    save_file(fp8_block_golden(g), str(args.out / "fp8_block.safetensors"))
    provenance = {
        "producer": {"nvidia-modelopt": modelopt.__version__, "torch": torch.__version__},
        "script": "tools/fp4_golden.py", "seed": SEED,
        "functions": {
            "nvfp4": ["modelopt.torch.quantization.qtensor.NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=gs)",
                      "NVFP4QTensor.dequantize(dtype=float32, scale, double_scale, block_sizes={-1: 16})"],
            "mxfp4": ["modelopt.torch.quantization.qtensor.MXFP4QTensor.dequantize(dtype=float32, scale, "
                      "block_sizes={-1: 32})", "MXFP4QTensor.quantize(w, 32)"],
            "fp8_block": ["modelopt.torch.quantization.qtensor.FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})"],
        },
        "nvfp4_cases": {name: {"shape": list(w.shape), "dtype": str(w.dtype).removeprefix("torch."),
                               "global_scale_given": gs is not None} for name, (w, gs) in cases.items()},
    }
    (args.out / "fp4_golden.json").write_text(json.dumps(provenance, indent=2) + "\n")


if __name__ == "__main__":
    main()
