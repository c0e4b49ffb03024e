"""Activation-aware weight quantization (AWQ) to per-group int4, ModelOpt layout.

Rounding error matters most in the input channels where activations are
large. AWQ scales those weight columns up before quantizing (`W_s = W·diag(s)`)
and the activation down by the same factor at run time, which the awq
format stores as `prequant_scaling_factor = 1/s` (TensorRT-LLM
tensorrt_llm/quantization/layers.py, WeightOnlyGroupwiseQuantLinear; ModelOpt keeps
it separate rather than folding it into the previous norm). Then, per group,
it clips the quantization range when a slightly smaller amax lowers the
output error.

Rounding: `nearest` is classic AWQ; `gptq` keeps the scales and clipped
ranges found here and only picks the integers with error compensation
(toolchain.quant.gptq), which lowers the same objective further.

Both searches score a candidate by the output error on calibration data,
`E‖ΔW x‖² = tr(ΔW C ΔWᵀ)` with `C = E[x xᵀ]` the input's second-moment matrix,
so only `C` (in × in) and the per-channel mean |x| are kept from calibration,
never the activations themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolchain.quant.gptq import act_order, gptq_round, upper_inverse_factor
from toolchain.quant.int_quant import fake_quant_per_group, group_amax, quantize_per_group
from toolchain.quant.recipe import ROUNDINGS

N_GRID = 20        # scale exponents 0, 0.05, ..., 1 (the original AWQ grid)
SEARCH_ROWS = 2048  # output rows the scale search scores candidates on (a fixed, seeded sample)
MAX_SHRINK = 0.5   # clipping tries amax x 1.0, 0.95, ..., 0.55


@dataclass
class AwqLinear:
    weight: torch.Tensor                   # int8 (out, in), values in [-8, 7], not yet packed
    weights_scaling_factor: torch.Tensor   # float32 (out, in/g)
    prequant_scaling_factor: torch.Tensor  # float32 (in,), shared by linears with one input


@dataclass
class AwqSearch:
    scales: torch.Tensor        # s (in,)
    exponent: float             # the chosen alpha
    duo: bool                   # whether the weight magnitude entered s
    loss: float                 # output error of the chosen scales (before clipping)
    rtn_loss: float             # output error of plain round-to-nearest


def output_error(dw: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """tr(ΔW C ΔWᵀ): the mean squared output change over the calibration tokens, computed
    in `cov`'s dtype (the searches pass float32: this product is their whole cost, and
    float32 ranks the candidates the same) and summed in float64."""
    d = dw.to(cov.dtype)
    return ((d @ cov) * d).sum(dtype=torch.float64)


def search_scales(weights: list[torch.Tensor], x_absmean: torch.Tensor, cov: torch.Tensor, group_size: int,
                  n_grid: int = N_GRID, rows: int = SEARCH_ROWS) -> AwqSearch:
    """Grid search over s = mean|x|^α (and, "duo", mean|x|^α / mean|ŵ|^(1-α),
    ŵ the weight relative to its group max) for linears sharing one input.

    α = 0 without duo is s = 1, plain round-to-nearest, so the chosen scales are
    never worse than RTN on the calibration data (on the scored rows).

    Each candidate costs a GEMM of ΔW with C, O(out·in²). Every output row adds
    its own term to the error, so above `rows` rows the candidates are scored on
    a fixed random sample of them: an unbiased estimate of the same objective
    whose ranking is stable at a few thousand rows, and 14x cheaper on a
    Llama-3-8B gate/up block (28672 rows)."""
    w = torch.cat([t.float() for t in weights], dim=0)
    rel = w.abs() / group_amax(w, group_size).clamp(min=1e-12).repeat_interleave(group_size, dim=1)
    w_mean = rel.mean(dim=0).clamp(min=1e-8)  # from every row: the scales themselves see the whole weight
    if w.shape[0] > rows:
        pick = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))[:rows]
        w = w[pick.sort().values]
    x_mean = x_absmean.float().clamp(min=1e-8)
    best: AwqSearch | None = None
    cov = cov.float()
    rtn = float(output_error(fake_quant_per_group(w, group_size) - w, cov))
    for i in range(n_grid + 1):
        alpha = i / n_grid
        for duo in (False, True):
            s = x_mean.pow(alpha)
            if duo:
                s = s / w_mean.pow(1.0 - alpha)
            s = s / torch.sqrt(s.max() * s.min())  # keep the scales centred around 1
            dq = fake_quant_per_group(w * s, group_size) / s
            loss = float(output_error(dq - w, cov))
            if best is None or loss < best.loss:
                best = AwqSearch(s, alpha, duo, loss, rtn)
    if best is None:
        raise ValueError(f"n_grid must be >= 0, got {n_grid}")
    return best


def search_clip(w_scaled: torch.Tensor, cov_scaled: torch.Tensor, group_size: int,
                n_grid: int = N_GRID, max_shrink: float = MAX_SHRINK) -> torch.Tensor:
    """(out, in/g) clipped amax per group minimising that group's output error
    (cross-group terms are left out, as in the original AWQ)."""
    out, inp = w_scaled.shape
    groups = inp // group_size
    wg = w_scaled.float().reshape(out, groups, group_size)
    blocks = torch.stack([cov_scaled[g * group_size:(g + 1) * group_size, g * group_size:(g + 1) * group_size]
                          for g in range(groups)]).double()
    org = wg.abs().amax(dim=-1)
    best_amax, best_err = org.clone(), None
    for i in range(int(max_shrink * n_grid)):
        amax = org * (1.0 - i / n_grid)
        dq = fake_quant_per_group(w_scaled, group_size, amax=amax).reshape(out, groups, group_size) - wg
        d = dq.double()
        err = torch.einsum("ogi,gij,ogj->og", d, blocks, d)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_amax = torch.where(better, amax, best_amax)
    return best_amax


def quantize_awq(weights: list[torch.Tensor], x_absmean: torch.Tensor, cov: torch.Tensor, group_size: int,
                 *, search: bool = True, clip: bool = True,
                 rounding: str = "nearest") -> tuple[list[AwqLinear], AwqSearch | None]:
    """AWQ for linears sharing one input. `search=False, clip=False` is plain
    per-group round-to-nearest in the same layout (prequant = ones), the
    baseline AWQ is measured against; `rounding="gptq"` picks the integers
    with error compensation on the same scales."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    inp = weights[0].shape[1]
    found = search_scales(weights, x_absmean, cov, group_size) if search else None
    s = found.scales if found is not None else torch.ones(inp)
    return _quantize_scaled(weights, s, cov, group_size, clip, rounding), found


def _quantize_scaled(weights: list[torch.Tensor], s: torch.Tensor, cov: torch.Tensor, group_size: int, clip: bool,
                     rounding: str) -> list[AwqLinear]:
    """Linears sharing one input (second moments `cov`) quantized per group after scaling their columns by s."""
    cov_s = cov.double() / (s.double()[:, None] * s.double()[None, :])
    order = act_order(cov_s) if rounding == "gptq" else None
    u = upper_inverse_factor(cov_s, order) if rounding == "gptq" else None
    out = []
    for w in weights:
        ws = w.float() * s[None, :]
        amax = search_clip(ws, cov_s, group_size) if clip else None
        q, scales = quantize_per_group(ws, group_size, bits=4, amax=amax)
        if u is not None:  # rounding == "gptq"
            q = gptq_round(ws, scales, u, group_size, order=order)
        out.append(AwqLinear(q, scales, 1.0 / s))
    return out


def quantize_awq_experts(weights: list[list[torch.Tensor]], inputs: list[tuple[torch.Tensor, torch.Tensor]],
                         group_size: int, *, search: bool = True, clip: bool = True,
                         rounding: str = "nearest") -> tuple[list[list[AwqLinear]], AwqSearch | None]:
    """AWQ for a mixture-of-experts stack, whose experts share one prequant vector (TensorRT-LLM keeps a
    single (1, in) prequant_scaling_factor per stack: preprocess_perlayer_weights reads row 0 of the stored
    [experts, in], "MoE experts share the same scaling factor"). `weights[e]` are expert e's linears with one
    input (fc: w3 and w1), `inputs[e]` that input's (mean |x|, E[x xᵀ]). The scales are searched once for the
    stack on the pooled statistics, the experts' means (the second moment of the stack's input when each
    expert's input counts once per token; for fc every expert's input is the same), so the error summed over
    the experts is what they lower; clipping and rounding then use each expert's own statistics."""
    if len(weights) != len(inputs) or not weights:
        raise ValueError(f"one input per expert: {len(weights)} experts, {len(inputs)} inputs")
    inp = weights[0][0].shape[1]
    found = None
    if search:
        absmean = torch.stack([a.float() for a, _ in inputs]).mean(dim=0)
        cov = inputs[0][1] if all(c is inputs[0][1] for _, c in inputs) else \
            torch.stack([c.float() for _, c in inputs]).mean(dim=0)
        found = search_scales([w for ws in weights for w in ws], absmean, cov, group_size)
    s = found.scales if found is not None else torch.ones(inp)
    return [_quantize_scaled(ws, s, cov_e, group_size, clip, rounding)
            for ws, (_, cov_e) in zip(weights, inputs, strict=True)], found
