"""Llama 4's attention on the CPU engine: which layers rotate, the chunk mask of the rope layers, the weightless
q/k norm and the NoPE layers' temperature tuning, as transformers 5.25 computes them
(models/llama4/modeling_llama4.py Llama4TextAttention.forward; masking_utils.py chunked_overlay).

There is no upstream engine checkpoint of this family (archs/llama4.py): the keys read here are the ones this
toolchain's converter writes, under transformers' names. The layers' MLPs (dense or mixture, the sigmoid router
on the experts' input, the ungated shared expert) are read by config.py and run by moe.py.

Per layer i:
- `no_rope_layers[i]` 1 (the layer uses rope): q and k rotated by the interleaved rope (rope_gptj), then, with
  use_qk_norm, each head normalised by RMSNorm without a weight (Llama4TextL2Norm, eps norm_epsilon), and the
  query sees only keys of its own chunk, positions p // attention_chunk_size equal (with the causal mask);
- 0 (NoPE): no rotation, every earlier key, and with attn_temperature_tuning q scaled per absolute position by
  log1p(floor((p + 1) / floor_scale)) * attn_scale + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolchain.engine.cpu.rope import apply_rotary_interleaved
from toolchain.errors import ToolchainError

_REBUILD = "rebuild the engine with `toolchain build-engine --force`"


@dataclass(frozen=True)
class Llama4Attention:
    rope_layers: tuple[int, ...]
    """no_rope_layers as written: 1 where the layer rotates q and k."""
    chunk: int | None
    """attention_chunk_size of the rope layers; None: they attend in full."""
    qk_norm: bool
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float

    def uses_rope(self, layer: int) -> bool:
        return bool(self.rope_layers[layer])

    def chunk_of(self, layer: int) -> int | None:
        """The chunk a query of `layer` attends within (None: every earlier key)."""
        return self.chunk if self.uses_rope(layer) else None

    def position_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [n, heads, head_size] of one rank after Llama4TextAttention's position handling."""
        if self.uses_rope(layer):
            q, k = apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)
            if self.qk_norm:
                q, k = weightless_rms_norm(q, eps), weightless_rms_norm(k, eps)
        elif self.temperature_tuning:
            q = q * self.temperature(positions)[:, None, None]
        return q, k

    def temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """The NoPE layers' query scale per absolute position [n] (float32, as transformers computes it)."""
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def chunk_mask(q_pos: torch.Tensor, key: torch.Tensor, chunk: int) -> torch.Tensor:
    """Whether each query position sees each key position within its chunk (chunked_overlay; the caller adds the
    causal part). Padded query rows (position -1) fall in no key's chunk."""
    return torch.div(q_pos, chunk, rounding_mode="floor") == torch.div(key, chunk, rounding_mode="floor")


def _flag(cfg: dict, key: str, origin: str) -> bool:
    value = cfg.get(key)
    if not isinstance(value, bool):
        raise ToolchainError(f"{origin}: a Llama 4 config needs {key} true or false, got {value!r}", _REBUILD)
    return value


def _positive(cfg: dict, key: str, origin: str) -> float:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ToolchainError(f"{origin}: a Llama 4 config needs a positive {key}, got {value!r}", _REBUILD)
    return float(value)


def llama4_dims(attention_config: str | None, cfg: dict, origin: str) -> dict:
    """ModelDims' `llama4` for a config.json whose family's decoder says it carries Llama 4's attention keys
    (archs/common.py Decoder.attention_config); empty for others."""
    if attention_config != "llama4":
        return {}
    layers = cfg.get("num_hidden_layers")
    rope = cfg.get("no_rope_layers")
    if not isinstance(rope, list) or len(rope) != layers or any(r not in (0, 1) or isinstance(r, bool) for r in rope):
        raise ToolchainError(f"{origin}: a Llama 4 config needs no_rope_layers, 0 or 1 per layer, got {rope!r}",
                             _REBUILD)
    chunk = cfg.get("attention_chunk_size")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ToolchainError(f"{origin}: attention_chunk_size must be a positive integer or null, got {chunk!r}",
                             _REBUILD)
    return {"llama4": Llama4Attention(
        rope_layers=tuple(rope), chunk=chunk, qk_norm=_flag(cfg, "use_qk_norm", origin),
        temperature_tuning=_flag(cfg, "attn_temperature_tuning", origin),
        floor_scale=_positive(cfg, "floor_scale", origin), attn_scale=_positive(cfg, "attn_scale", origin))}
