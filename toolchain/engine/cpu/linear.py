"""Every matmul of the engine goes through `Linear`.

One small class so a quantized kernel (int8/int4 weight-only, SmoothQuant,
FP8) can replace the float path for a module without touching the model code:
`qlinear.make_linear` is the single place that decides which implementation a
checkpoint module gets, from the module's stored format (`ModelDims.linear_format`).
"""

from __future__ import annotations

import torch


class Linear:
    """y = x @ W.T + b with W stored (out, in) as in the checkpoint, in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor, *, add_bias: bool = True) -> torch.Tensor:
        # Row-parallel shards leave their bias out; it is added once after the partial sums.
        bias = self.bias if add_bias else None
        return torch.nn.functional.linear(x, self.weight, bias)

    # The matmul alone, as a benchmark's floor runs it (benchmarks/cpu_engine.py): the kernel this module calls,
    # on an input already in the kernel's dtype and width, no bias, nothing before or after.

    def kernel_input(self, rows: int) -> torch.Tensor:
        """A [rows, in] input as `kernel` reads it."""
        return torch.randn(rows, self.in_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

