"""Pre-quantized Hugging Face int4 formats: AutoAWQ (GEMM) and AutoGPTQ.

Both store asymmetric per-group int4, `w = (q - z) · s` with q, z in 0..15,
packed eight to an int32 (the layouts TensorRT-LLM's importer reads:
tensorrt_llm/models/llama/convert.py, load_weights_from_gptq):

- AutoAWQ GEMM: `qweight (in, out/8)`, `qzeros (in/g, out/8)`, `scales (in/g, out)`;
  8 output columns per int32, column 8c + j in nibble `AWQ_ORDER[j]`.
- GPTQ: `qweight (in/8, out)` packed along the input in natural order (nibble k
  is input row 8r + k), `qzeros (in/g, out/8)` along the output in natural
  order and stored minus one ("v1"), `scales (in/g, out)`, `g_idx (in,)`.

The packers exist so tests can build such checkpoints locally from any
model; the unpackers feed the import. Everything here is (out, in) once
unpacked, like the rest of the package.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble position of output column j within its int32
NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (in int64) -> the int32 with the same bits."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def _pack_last(u: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """(..., 8n) values 0..15 -> (..., n) int32; element j of each 8 goes to nibble order[j]."""
    u = u.to(torch.int64).reshape(*u.shape[:-1], u.shape[-1] // 8, 8)
    pos = torch.tensor(order if order is not None else range(8), dtype=torch.int64)
    return _to_int32((u << (4 * pos)).sum(dim=-1))


def _unpack_last(p: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """Inverse of `_pack_last`: (..., n) int32 -> (..., 8n) int64 values 0..15."""
    nib = (p.to(torch.int64)[..., None] >> NIBBLE_SHIFTS) & 0xF   # nibble i at index i
    if order is not None:
        nib = nib[..., list(order)]                                 # column j <- nibble order[j]
    return nib.reshape(*p.shape[:-1], p.shape[-1] * 8)


def asym_quantize_per_group(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit RTN as AutoAWQ/GPTQ produce it: (q (out, in) 0..15,
    zeros (out, in/g) 0..15, scales (out, in/g) float32), w ≈ (q - z) · s."""
    out, inp = w.shape
    wg = w.float().reshape(out, inp // group_size, group_size)
    mn, mx = wg.amin(-1), wg.amax(-1)
    scales = ((mx - mn).clamp(min=1e-5) / 15.0)
    zeros = torch.clamp(-torch.round(mn / scales), 0, 15)
    q = torch.clamp(torch.round(wg / scales[..., None]) + zeros[..., None], 0, 15)
    return q.reshape(out, inp).to(torch.int64), zeros.to(torch.int64), scales


def dequantize_asym(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = q.shape
    g = q.float().reshape(out, inp // group_size, group_size)
    return ((g - zeros.float()[..., None]) * scales.float()[..., None]).reshape(out, inp)


# -- AutoAWQ GEMM ------------------------------------------------------------------

def pack_awq_gemm(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """(out, in) q, (out, in/g) zeros and scales -> AutoAWQ GEMM tensors."""
    return {"qweight": _pack_last(q.t(), AWQ_ORDER), "qzeros": _pack_last(zeros.t(), AWQ_ORDER),
            "scales": scales.t().contiguous().to(torch.float16)}


def unpack_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor,
                    scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors -> (q (out, in), zeros (out, in/g), scales (out, in/g) float32)."""
    return (_unpack_last(qweight, AWQ_ORDER).t().contiguous(), _unpack_last(qzeros, AWQ_ORDER).t().contiguous(),
            scales.float().t().contiguous())


# -- GPTQ ----------------------------------------------------------------------------

def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """(out, in) q, (out, in/g) zeros and scales -> GPTQ v1 tensors (zeros stored minus one)."""
    inp = q.shape[1]
    return {"qweight": _pack_last(q.t().reshape(inp // 8, 8, -1).transpose(1, 2), None).squeeze(-1),
            "qzeros": _pack_last((zeros - 1).t() & 0xF, None),
            "scales": scales.t().contiguous().to(torch.float16),
            "g_idx": torch.arange(inp, dtype=torch.int32) // group_size}


def gptq_act_order(g_idx: torch.Tensor | None, group_size: int) -> bool:
    """True when g_idx is not the trivial i // g (act-order / desc_act checkpoints)."""
    if g_idx is None:
        return False
    return not torch.equal(g_idx.to(torch.int64), torch.arange(g_idx.numel(), dtype=torch.int64) // group_size)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ v1 tensors -> (q (out, in), zeros (out, in/g), scales (out, in/g) float32).

    Raises ValueError for act-order (a permuted g_idx): TensorRT-LLM's layouts
    have no place for the permutation (load_weights_from_gptq)."""
    if gptq_act_order(g_idx, group_size):
        raise ValueError("GPTQ act-order (desc_act) g_idx cannot be expressed in the TensorRT-LLM layout")
    rows, out = qweight.shape
    q = _unpack_last(qweight.t().contiguous(), None)          # (out, in): nibble k of row r is input 8r + k
    # v1 stores z - 1; the +1 is applied without wrapping (a stored 15 means 16),
    # as GPTQ's own kernels and TensorRT-LLM's importer, `(8 - (z + 1)) · s`, do.
    zeros = _unpack_last(qzeros, None) + 1
    return q.reshape(out, rows * 8), zeros.t().contiguous(), scales.float().t().contiguous()


# -- to TensorRT-LLM ------------------------------------------------------------------

def to_signed_with_zero(q: torch.Tensor, zeros: torch.Tensor,
                        scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric (q, z, s) -> (q - 8 as int8 in [-8, 7], scales, zero) with
    `w = (q - 8) · s + zero` and `zero = (8 - z) · s`: TensorRT-LLM's kernel
    convention (tensorrt_llm/quantization/functional.py), exact for every q and z."""
    return (q - 8).to(torch.int8), scales.float(), (8 - zeros.float()) * scales.float()
