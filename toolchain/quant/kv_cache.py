"""KV-cache quantization scales (TensorRT-LLM tensorrt_llm/quantization/quantize_by_modelopt.py,
tensorrt_llm/models/llama/convert.py): one float32 scale per layer,
`attention.kv_cache_scaling_factor (1,)`, and the cache stores `x / scale`.

- INT8: `amax / 127`, amax the largest |q, k, v| projection output seen in calibration.
- FP8: `amax / 448` clamped to at least 1.0, as ModelOpt writes it: e4m3
  already spans ±448, so a small-valued cache is stored unscaled rather than
  stretched into the format's coarse top range.
"""

from __future__ import annotations

import torch

from toolchain.quant.fp8 import FP8_DTYPE, FP8_MAX

KINDS = ("int8", "fp8")


def kv_cache_scale(amax: float | torch.Tensor, kind: str) -> torch.Tensor:
    """(1,) float32 scale for one layer's cache."""
    a = float(torch.as_tensor(amax).max())
    if kind == "int8":
        return torch.tensor([a / 127.0 if a > 0 else 1.0], dtype=torch.float32)
    if kind == "fp8":
        return torch.tensor([max(a / FP8_MAX, 1.0)], dtype=torch.float32)
    raise ValueError(f"kv cache kind must be one of {KINDS}, got {kind!r}")


def storage_dtype(kind: str) -> torch.dtype:
    return {"int8": torch.int8, "fp8": FP8_DTYPE}[kind]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """What the cache stores; values beyond the calibrated range saturate."""
    y = x.float() / scale
    if kind == "int8":
        return torch.clamp(torch.round(y), -127, 127).to(torch.int8)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale
