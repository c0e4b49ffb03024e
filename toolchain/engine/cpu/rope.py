"""Rotary position embeddings, GPT-NeoX style (rotate_half), with the
`linear` and `llama3` frequency scalings TRT-LLM 1.x accepts.

The inverse frequencies are computed with the same float32 operations as
transformers, so cos/sin tables agree bit for bit with the HF reference.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_size: int, base: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    inv_freq = 1.0 / (base ** exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["type"] == "linear":
        # Position interpolation: positions are divided by the factor.
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by the factor, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary:
    """cos/sin tables grown on demand, indexed by absolute position."""

    def __init__(self, head_size: int, base: float, scaling: dict | None):
        self.inv_freq = inverse_frequencies(head_size, base, scaling)
        # One tuple, swapped in whole, so a concurrent reader never sees cos and sin of different lengths.
        self._tables = (torch.empty(0, head_size), torch.empty(0, head_size))

    def _grow(self, length: int) -> None:
        length = max(length, 2 * self._tables[0].shape[0], 256)
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._tables = (emb.cos(), emb.sin())

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [n, 1, head_size] for int64 `positions` [n]."""
        need = int(positions.max()) + 1
        if need > self._tables[0].shape[0]:
            self._grow(need)
        cos, sin = self._tables
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, head_size] by position (rotate_half pairs dim i with i + d/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
