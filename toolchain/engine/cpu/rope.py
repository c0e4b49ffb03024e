"""Rotary position embeddings, GPT-NeoX style (rotate_half), with the
`linear` and `llama3` frequency scalings TRT-LLM 1.x accepts, Phi-3's `longrope` and `yarn` (yarn.py).

The inverse frequencies are computed with the same float32 operations as
transformers, so cos/sin tables agree bit for bit with the HF reference.
"""

from __future__ import annotations

import math

import torch

from toolchain.engine.cpu import native
from toolchain.engine.cpu.yarn import attention_factor, yarn_frequencies


def longrope_frequencies(head_size: int, base: float, factors: list[float]) -> torch.Tensor:
    """1 / (factor_i * base^(2i/d)), in transformers' operation order (modeling_rope_utils.py,
    _compute_longrope_parameters)."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)


def longrope_scale(max_positions: int, original: int) -> float:
    """The cos/sin factor transformers applies with longrope and no attention_factor:
    sqrt(1 + ln(s) / ln(original)) for s = max_positions / original > 1, else 1."""
    s = max_positions / original
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


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
    """cos/sin tables grown on demand, indexed by absolute position.

    longrope (Phi-3) keeps two tables, short and long factors, both scaled by longrope_scale. Like
    transformers (modeling_rope_utils.py longrope_frequency_update: long factors when max(position) + 1
    exceeds original_max_position_embeddings), a token is rotated with the long table when its request
    is longer than original_max_position_embeddings after this step, the short one otherwise. Keys cached
    before a request crosses that length keep their short rotation, where transformers' Phi-3 generation
    drops its cache and recomputes every position with the long factors (Phi3ForCausalLM
    .prepare_inputs_for_generation); a request that starts past the length, or never reaches it, matches."""

    def __init__(self, head_size: int, base: float, scaling: dict | None):
        self.long_after: int | None = None
        self.scale = 1.0
        if scaling is not None and scaling["type"] == "longrope":
            self.inv_freq = longrope_frequencies(head_size, base, scaling["short_factor"])
            self.long_inv_freq = longrope_frequencies(head_size, base, scaling["long_factor"])
            self.long_after = int(scaling["original_max_position_embeddings"])
            self.scale = longrope_scale(int(scaling["max_position_embeddings"]), self.long_after)
        elif scaling is not None and scaling["type"] == "yarn":
            self.inv_freq, self.scale = yarn_frequencies(head_size, base, scaling), attention_factor(scaling)
        else:
            self.inv_freq = inverse_frequencies(head_size, base, scaling)
        # One tuple, swapped in whole, so a concurrent reader never sees cos and sin of different lengths;
        # (short cos, short sin, long cos, long sin) with longrope.
        self._tables: tuple[torch.Tensor, ...] = tuple(torch.empty(0, head_size) for _ in range(4))

    def _table(self, length: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.scale, emb.sin() * self.scale

    def _grow(self, length: int) -> None:
        length = max(length, 2 * self._tables[0].shape[0], 256)
        short = self._table(length, self.inv_freq)
        long_ = self._table(length, self.long_inv_freq) if self.long_after is not None else short
        self._tables = (*short, *long_)

    def tables(self, positions: torch.Tensor, lengths: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [n, 1, head_size] for int64 `positions` [n]; `lengths` [n], each token's
        request length after this step, picks longrope's table (default: its position + 1)."""
        need = int(positions.max()) + 1
        if need > self._tables[0].shape[0]:
            self._grow(need)
        cos, sin, long_cos, long_sin = self._tables
        cos, sin = cos[positions], sin[positions]
        if self.long_after is not None:
            long = ((positions + 1) if lengths is None else lengths) > self.long_after
            if bool(long.any()):
                pick = long[:, None]
                cos, sin = torch.where(pick, long_cos[positions], cos), torch.where(pick, long_sin[positions], sin)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, head_size] by position (rotate_half pairs dim i with i + d/2): x * cos + rotate_half(x) *
    sin, transformers' operations, with two temporaries instead of five (the values are the same bit for bit)."""
    # The same products and sums in one pass (csrc/layer_ops.cpp), for one table row per row of x.
    kernels = native.ops() if x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 3 else None
    if kernels is not None and x.stride(-1) == 1 and cos.numel() == sin.numel() == x.shape[0] * x.shape[-1]:
        return kernels.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    rotated[..., :half].neg_()
    return (x * cos).add_(rotated.mul_(sin))


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, head_size] by position, GPT-J style (position_embedding_type rope_gptj): dims 2i and
    2i + 1 form the pair frequency i turns, as transformers' complex form does (Llama 4's apply_rotary_emb:
    view_as_complex over (..., -1, 2) times freqs_cis). `cos`/`sin` are the tables above, [cos f; cos f]."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin
