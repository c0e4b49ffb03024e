"""AutoAWQ (GEMM) and GPTQ packing: loop references written from the format
facts (AutoAWQ GEMM and AutoGPTQ packing; TensorRT-LLM models/llama/convert.py), round trips, and the zero-point conversion."""

from __future__ import annotations

import pytest
import torch

from toolchain.quant import prequantized as pq
from toolchain.quant.int_quant import dequantize_per_group


def _u32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _ref_awq_pack(q_in_out: torch.Tensor) -> torch.Tensor:
    """(rows, 8n) -> (rows, n): nibble i of int32 c holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    interleave = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = q_in_out.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols // 8):
            v = 0
            for i in range(8):
                v |= int(q_in_out[r, 8 * c + interleave[i]]) << (4 * i)
            out[r, c] = _u32(v)
    return out


def _ref_gptq_qweight(q_out_in: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (in/8, out): nibble k of [r, o] is input row 8r + k."""
    out_f, in_f = q_out_in.shape
    res = torch.zeros(in_f // 8, out_f, dtype=torch.int32)
    for r in range(in_f // 8):
        for o in range(out_f):
            v = 0
            for k in range(8):
                v |= int(q_out_in[o, 8 * r + k]) << (4 * k)
            res[r, o] = _u32(v)
    return res


@pytest.fixture
def quantized():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, generator=g)
    return w, pq.asym_quantize_per_group(w, 64)


def test_awq_gemm_matches_reference_and_round_trips(quantized):
    _, (q, z, s) = quantized
    packed = pq.pack_awq_gemm(q, z, s)
    assert packed["qweight"].shape == (128, 2) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (2, 2) and packed["scales"].shape == (2, 16)
    assert torch.equal(packed["qweight"], _ref_awq_pack(q.t()))
    assert torch.equal(packed["qzeros"], _ref_awq_pack(z.t()))
    q2, z2, s2 = pq.unpack_awq_gemm(packed["qweight"], packed["qzeros"], packed["scales"])
    assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s.half().float())


def test_gptq_matches_reference_and_round_trips(quantized):
    _, (q, z, s) = quantized
    z = z.clamp(min=1)  # v1 stores z - 1: a zero point of 0 reads back as 16 (see below)
    packed = pq.pack_gptq(q, z, s, 64)
    assert packed["qweight"].shape == (16, 16) and packed["qzeros"].shape == (2, 2)
    assert torch.equal(packed["qweight"], _ref_gptq_qweight(q))
    q2, z2, s2 = pq.unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 64)
    assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s.half().float())


def test_gptq_v1_zero_is_stored_minus_one_without_wrap():
    q = torch.full((8, 64), 3, dtype=torch.int64)
    z = torch.zeros(8, 1, dtype=torch.int64)
    packed = pq.pack_gptq(q, z, torch.ones(8, 1), 64)
    _, z2, _ = pq.unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], None, 64)
    assert z2.unique().tolist() == [16]  # TensorRT-LLM's importer uses (8 - (z + 1)) * s the same way


def test_gptq_act_order_is_rejected(quantized):
    _, (q, z, s) = quantized
    packed = pq.pack_gptq(q, z, s, 64)
    perm = packed["g_idx"].flip(0)
    assert pq.gptq_act_order(perm, 64) and not pq.gptq_act_order(packed["g_idx"], 64)
    with pytest.raises(ValueError, match="act-order"):
        pq.unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], perm, 64)


def test_zero_point_conversion_is_exact(quantized):
    w, (q, z, s) = quantized
    signed, scales, zero = pq.to_signed_with_zero(q, z, s)
    assert signed.dtype == torch.int8 and int(signed.min()) >= -8 and int(signed.max()) <= 7
    ref = pq.dequantize_asym(q, z, s, 64)
    assert torch.allclose(dequantize_per_group(signed, scales, 64, zero=zero), ref, atol=1e-6)
    assert (ref - w).abs().max() <= s.max() / 2 + 1e-5
