"""Every matmul of the engine goes through `Linear`.

One small class so a quantized kernel (int8/int4 weight-only, SmoothQuant,
FP8) can replace the float path for a module without touching the model code:
`qlinear.make_linear` is the single place that decides which implementation a
checkpoint module gets, from the module's stored format (`ModelDims.linear_format`).
"""

from __future__ import annotations

import torch


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for x [..., in] and weight (out, in) as the checkpoint stores it.

    Computed as (weight @ x.T).T, not F.linear: in torch 2.13's CPU build F.linear at a decode step's
    few rows reads the weight at a third to a half of the memory bandwidth the plain GEMM reaches. On
    the 124M-parameter benchmark model (benchmarks/cpu_engine.py), all its weights in turn, out of
    cache, 2 threads: 1 row 35 ms against 16, 2 rows 62 against 15, 5 rows 49 against 27, 16 rows 55
    against 42, 256 rows 416 against 360. One row runs as two, the row repeated: the one-column product
    takes the slow path too. The sums are the same products in another order, so values differ from
    F.linear's in the last bits (greedy tokens of every shipped CPU spec are unchanged); like F.linear's,
    a row's values may depend on how many rows run with it below 8 rows."""
    if x.dim() != 2:
        return matmul(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    if x.shape[0] == 1:
        return torch.mm(weight, torch.cat((x, x)).t()).t()[:1].contiguous()
    return torch.mm(weight, x.t()).t().contiguous()


def as_columns(x: torch.Tensor) -> torch.Tensor:
    """Rows x [n, in] as the columns [in, n'] `Linear.columns` takes, a view; one row as two columns (see `matmul`)."""
    return (torch.cat((x, x)) if x.shape[0] == 1 else x).t()


def gemm_columns(c: torch.Tensor) -> torch.Tensor:
    """Columns c [in, n] laid out as torch.mm(weight, c) reads them fastest in torch 2.13's CPU build: below 12
    columns as the transpose of rows ([n, in] in memory, what `as_columns` gives), else as they are. Twelve of the
    benchmark model's down projections (768 x 2048) in turn, 2 threads, contiguous c against c as rows: 2 columns
    11.4 against 4.1 ms, 8 13.0 against 8.4, 10 14.2 against 10.2, from 12 to 20 within 3% either way."""
    return c if c.shape[1] >= 12 or c.stride(0) == 1 else c.t().contiguous().t()


def takes_columns(*modules: "Linear | None") -> bool:
    """Every module a float32 `Linear`, which computes on columns without transposing (`Linear.columns`); the
    quantized kernels of qlinear.py take rows."""
    return all(type(m) is Linear for m in modules)


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
        return self.with_bias(matmul(x, self.weight), add_bias)

    def columns(self, cols: torch.Tensor, *, add_bias: bool = True) -> torch.Tensor:
        """The product on columns: cols [in, n] (`as_columns`) -> [out, n], bias included. The same products as
        `matmul` without turning the result into rows, for a caller whose next step reads columns too (the MLP's
        activation and down projection, the LM head's argmax): the copy a transpose costs is most of a small
        step's time outside the GEMMs (at 16 rows on the benchmark model, 3 of 13 ms)."""
        y = torch.mm(self.weight, cols)
        return y + self.bias[:, None] if (add_bias and self.bias is not None) else y

    def with_bias(self, y: torch.Tensor, add_bias: bool) -> torch.Tensor:
        """y plus the bias where there is one and `add_bias`: row-parallel shards leave theirs out, to be added once
        after the partial sums."""
        return y + self.bias if (add_bias and self.bias is not None) else y

    # The matmul alone, as a benchmark's floor runs it (benchmarks/cpu_engine.py): the kernel this module calls,
    # on an input already in the kernel's dtype and width, no bias, nothing before or after.

    def kernel_input(self, rows: int) -> torch.Tensor:
        """A [rows, in] input as `kernel` reads it."""
        return torch.randn(rows, self.in_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight)

