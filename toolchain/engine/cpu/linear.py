"""Every matmul of the engine goes through `Linear`.

One small class so a quantized kernel (int8/int4 weight-only, SmoothQuant,
FP8) can replace the float path for a module without touching the model code:
`qlinear.make_linear` is the single place that decides which implementation a
checkpoint module gets, from the module's stored format (`ModelDims.linear_format`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

BLOCKED_FROM_ROWS = 4
"""From this many rows a float32 `Linear` runs on its oneDNN-blocked copy (`Linear.product`); below, `matmul`."""
BLOCKED_MIN_BYTES = 1 << 20
"""Weights smaller than this keep no blocked copy: oneDNN gains where a weight streams from memory, while one that
sits in cache gains nothing at a few rows and pays more per call inside a step (the embedded tiny Llama, 0.8 MB
weights, one 4-row forward: 4.5 ms with its linears on oneDNN against 3.5 ms without)."""


class BlockedBudget:
    """Bytes the blocked copies made under `blocked_budget` may still take, and what was refused."""

    def __init__(self, limit: int):
        self.left = limit
        self.refused = 0
        self.refused_bytes = 0

    def take(self, nbytes: int) -> bool:
        if nbytes > self.left:
            self.refused += 1
            self.refused_bytes += nbytes
            return False
        self.left -= nbytes
        return True


_BUDGET: contextvars.ContextVar[BlockedBudget | None] = contextvars.ContextVar("blocked_budget", default=None)


@contextlib.contextmanager
def blocked_budget(limit: int) -> Iterator[BlockedBudget]:
    """Within it, the blocked copies `Linear`s make take at most `limit` bytes in all: a weight whose copy would
    pass it keeps the plain GEMM at every row count. Outside it, nothing limits them (a module made by hand, the
    host probe's)."""
    budget = BlockedBudget(max(limit, 0))
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def blocked(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 or bfloat16 weight (out, in) reordered into oneDNN's blocked layout for its matmul (PyTorch's
    mkldnn._reorder_linear_weight, what its CPU inductor backend prepacks linears with); None where this build of
    torch has no oneDNN, the copy is under BLOCKED_MIN_BYTES, or it would pass the `blocked_budget`."""
    nbytes = weight.numel() * weight.element_size()
    if (not torch.backends.mkldnn.is_available() or weight.dtype not in (torch.float32, torch.bfloat16)
            or nbytes < BLOCKED_MIN_BYTES):
        return None
    budget = _BUDGET.get()
    if budget is not None and not budget.take(nbytes):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


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


def on_columns(rows: int, *modules: "Linear | None") -> bool:
    """Whether `rows` rows through these modules run best on columns (`Linear.columns`): every module a float32
    `Linear` (the quantized kernels of qlinear.py take rows) and too few rows for its oneDNN product, which takes
    rows and returns rows."""
    return all(type(m) is Linear and (m.blocked_weight is None or rows < BLOCKED_FROM_ROWS) for m in modules)


class Linear:
    """y = x @ W.T + b with W stored (out, in) as in the checkpoint, in float32.

    A weight of 1 MiB or more is held twice: as stored, for `matmul` at up to three rows, and blocked for oneDNN's
    matmul (`blocked`), which from four rows on reads it much faster than the plain GEMM does, where memory allows
    (`blocked_budget`: an engine's load leaves its KV pool room first). The benchmark
    model's layers (benchmarks/cpu_engine.py, 302 MB of weights), all in turn, 2 threads, ms:

    | rows | 1 | 2 | 3 | 4 | 5 | 8 | 16 | 64 | 256 |
    |---|---|---|---|---|---|---|---|---|---|
    | `matmul` | 12.3 | 12.0 | 14.0 | 16.5 | 20.8 | 38.3 | 31.0 | 65.6 | 213 |
    | oneDNN, blocked | 16.4 | 16.6 | 14.7 | 14.1 | 14.3 | 17.5 | 19.4 | 50.0 | 182 |

    At three rows the two are even (a whole forward of that model at three rows: 26.3 ms through oneDNN, 24.5
    without; at four 26.0 against 28.0, at five 24.0 against 32.0). A decode step of 16 requests took 33 ms
    against 57 (8 requests: 27 against 50; one request: the same). The second copy doubles those weights' memory;
    it is made at load, before the KV pool takes its share of what is left. The sums come in oneDNN's order: a
    row's values depend on whether it ran with fewer than four rows or more (below eight they already did, see
    `matmul`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        # float32 only: a quantized subclass keeps its stored tensors in `weight` and runs its own kernel
        self.blocked_weight = blocked(weight) if type(self) is Linear else None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor, *, add_bias: bool = True) -> torch.Tensor:
        return self.with_bias(self.product(x), add_bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x [..., in]: oneDNN on the blocked weight from BLOCKED_FROM_ROWS rows, else `matmul`."""
        flat = x.reshape(-1, x.shape[-1])
        if self.blocked_weight is None or flat.shape[0] < BLOCKED_FROM_ROWS:
            return matmul(x, self.weight)
        y = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.blocked_weight, None, "none", [], "")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def columns(self, cols: torch.Tensor, *, add_bias: bool = True) -> torch.Tensor:
        """The product on columns: cols [in, n] (`as_columns`) -> [out, n], bias included. The same products as
        `matmul` without turning the result into rows, for a caller whose next step reads columns too (the MLP's
        activation and down projection, the LM head's argmax). Below four rows, where the step runs this, the
        copies back into rows cost about 1.4 ms of a one-row step on the benchmark model (its GEMMs: 14.5 ms)."""
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
        return self.product(x)

