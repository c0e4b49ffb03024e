"""YaRN rotary frequencies (gpt-oss, DeepSeek-V3's latent attention: engine/cpu/mla.py), computed with transformers' own float32 operations
(modeling_rope_utils.py `_compute_yarn_parameters`) so the cos/sin tables agree with the HF reference bit for bit.

Frequencies below the correction range are interpolated (divided by `factor`), those above kept, and a linear
ramp blends the ones between; the range comes from beta_fast / beta_slow rotations over
original_max_position_embeddings, floored and ceiled unless `truncate` is false (gpt-oss sets it false;
transformers' default is true). cos and sin are then scaled by the attention factor: `attention_factor` when
given, else 0.1 ln(factor) + 1, or the ratio of the mscale / mscale_all_dim forms when both are set.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' yarn_get_mscale: 0.1 * mscale * ln(scale) + 1, 1 for scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict) -> float:
    factor = float(scaling["factor"])
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_frequencies(head_size: int, base: float, scaling: dict) -> torch.Tensor:
    """The inverse frequencies [head_size / 2] of a YaRN rotary scaling."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_size * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_size, 2).to(dtype=torch.float) / head_size)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep
