"""Calibration statistics: what entered each linear (InputStats), a decoder layer's (LayerStats), and the tensors of a
checkpoint directory read one at a time (Weights). Shared by calibration.py (Llama-family layers) and
calibration_llama4.py (Llama 4's), which each run layers and fill these in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from toolchain.errors import ToolchainError


@dataclass
class InputStats:
    """What entered one linear (or the linears sharing its input) over all calibration tokens."""

    amax: torch.Tensor                   # (in,) max |x| per channel
    abssum: torch.Tensor                 # (in,) sum |x| per channel
    xtx: torch.Tensor | None             # (in, in) float64 sum of x xᵀ, when asked for
    tokens: int = 0

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.tokens, 1)

    @property
    def cov(self) -> torch.Tensor:
        """E[x xᵀ] (uncentered second moment)."""
        if self.xtx is None:
            raise RuntimeError("this layer's second moments were not collected or were already dropped "
                               "(StatsStream keeps only the current layer's)")
        return self.xtx / max(self.tokens, 1)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.amax = torch.maximum(self.amax, x.abs().amax(dim=0))
        self.abssum += x.abs().sum(dim=0)
        if self.xtx is not None:
            xd = x.double()
            self.xtx += xd.t() @ xd
        self.tokens += x.shape[0]


@dataclass
class LayerStats:
    inputs: dict[str, InputStats] = field(default_factory=dict)
    qkv_amax: float = 0.0   # largest |q, k, v projection output| (KV-cache scales, as ModelOpt calibrates them)
    expert_proj_amax: list[float] = field(default_factory=list)
    """Mixture of experts: per expert, the largest |input of its down projection| over every calibration token
    (each expert runs on every token for its statistics, whatever the router picks: `_expert_amax`)."""
    expert_proj: list[InputStats] = field(default_factory=list)
    """Mixture of experts, when second moments are collected (AWQ): per expert, the input statistics of its down
    projection over every calibration token, as `expert_proj_amax`."""


class Weights:
    """name -> tensor over a directory's safetensors files (headers only until asked)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ToolchainError(f"no *.safetensors in {directory}", "point model.checkpoint at the HF model")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def prefixed(self, prefix: str) -> dict[str, torch.Tensor]:
        return {n[len(prefix):]: self.get(n).float() for n in self._where if n.startswith(prefix)}


def finish_layer(layer, hooks: list, done: int, count: int, progress: Callable[[str], None] | None) -> None:
    """After a layer has run over every sample: its hooks removed and its weights freed before the next one loads."""
    for h in hooks:
        h.remove()
    layer.to("meta")
    if progress is not None:
        progress(f"calibrated layer {done}/{count}")
