"""Error-compensating rounding onto a fixed per-group int4 grid (GPTQ's update rule).

Round-to-nearest treats every weight alone. Rounding the input channels one at
a time and spreading each channel's rounding error over the channels not yet
rounded, weighted by the calibration inputs' second moments `C = E[x xᵀ]`,
lowers the same objective AWQ searches with, `tr(ΔW C ΔWᵀ)`. The per-group
scales (AWQ's clipped ranges) are fixed beforehand, so the result is still a
plain awq tensor (quant/formats.py AWQ row): only which integer each weight gets changes.
llmcompressor recipes chain its AWQ and GPTQ modifiers the same way.

The update is the lazy-batch form of Frantar et al. (2022): within a block of
columns the rank-1 updates are applied immediately, to the rest of the matrix
once per block. Channels are taken in decreasing order of their input energy
`C_ii` ("static act-order"): the channels whose error matters most are rounded
first, while the most channels are left to absorb it. The groups stay the
contiguous ones the layout stores, and their scales are fixed beforehand, so
the order leaves no trace in the checkpoint (GPTQ's dynamic act-order, which
TensorRT-LLM cannot express, regroups the channels; TensorRT-LLM
tensorrt_llm/models/llama/convert.py, load_weights_from_gptq).
"""

from __future__ import annotations

import torch

DAMP = 0.01   # fraction of the mean diagonal added to C, so its Cholesky factor exists
BLOCK = 128   # columns per lazy-update block


def act_order(cov: torch.Tensor) -> torch.Tensor:
    """Input channels by decreasing second moment C_ii (ties keep their index order)."""
    return torch.sort(torch.diagonal(cov).float(), descending=True, stable=True).indices


def upper_inverse_factor(cov: torch.Tensor, order: torch.Tensor | None = None, damp: float = DAMP) -> torch.Tensor:
    """Upper Cholesky factor U of (C + λI)⁻¹, float32, with C's channels in `order`;
    computed once per input and shared by the linears that read it. Channels the
    calibration never excited (zero variance) get a unit diagonal: they neither
    take nor pass on error."""
    h = cov.float()
    h = h[order][:, order] if order is not None else h.clone()
    dead = torch.diagonal(h) <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h.diagonal()[dead] = 1.0
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    try:  # float32 halves the time of the two factorizations, which dominate for wide inputs
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError:  # ill-conditioned in float32: redo in float64
        h = h.double()
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def gptq_round(w: torch.Tensor, scales: torch.Tensor, u: torch.Tensor, group_size: int,
               *, order: torch.Tensor | None = None, bits: int = 4, block: int = BLOCK) -> torch.Tensor:
    """int8 (out, in) integers in [-2^(b-1), 2^(b-1)-1] for `w` (out, in) on the grid
    `scales` (out, in/g), chosen channel by channel in `order` (default: index
    order) to minimise tr(ΔW C ΔWᵀ); `u` is `upper_inverse_factor(C, order)`."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # Transposed, so each input channel is one contiguous row; rows in processing order.
    work = w.float().t()
    step = scales.float().t().repeat_interleave(group_size, dim=0)
    if order is not None:
        work, step = work[order], step[order]
    work, step = work.contiguous(), step.contiguous()
    in_f = work.shape[0]
    q = torch.empty(work.shape, dtype=torch.int8)
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        errs = torch.empty((b1 - b0, work.shape[1]))
        for j in range(b0, b1):
            row = work[j]
            qj = torch.clamp(torch.round(row / step[j]), lo, hi)
            q[j] = qj.to(torch.int8)
            err = (row - qj * step[j]) / u[j, j]
            work[j + 1:b1] -= u[j, j + 1:b1, None] * err[None, :]
            errs[j - b0] = err
        if b1 < in_f:
            work[b1:] -= u[b0:b1, b1:].t() @ errs
    if order is not None:
        q = q[torch.argsort(order)]
    return q.t().contiguous()
