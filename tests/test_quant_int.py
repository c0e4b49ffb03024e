"""Round-to-nearest int8/int4, the ModelOpt int4 packing, FP8 and KV scales: bit-exact checks
against small loop-written references of the format rules (TensorRT-LLM tensorrt_llm/quantization/layers.py, models/llama/convert.py)."""

from __future__ import annotations

import pytest
import torch

from toolchain.quant import fp8, int_quant, kv_cache


def _ref_pack(q: torch.Tensor) -> torch.Tensor:
    """Loop reference of pack_int4_in_uint8: byte[j, k] = row 2j low nibble, row 2j+1 high nibble."""
    out = torch.zeros(q.shape[0] // 2, q.shape[1], dtype=torch.uint8)
    for j in range(q.shape[0] // 2):
        for k in range(q.shape[1]):
            lo, hi = int(q[2 * j, k]) & 0xF, int(q[2 * j + 1, k]) & 0xF
            out[j, k] = lo | (hi << 4)
    return out.view(torch.int8)


def test_pack_int4_matches_loop_reference_and_round_trips():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (10, 7), generator=g, dtype=torch.int8)
    packed = int_quant.pack_int4(q)
    assert packed.dtype == torch.int8 and packed.shape == (5, 7)
    assert torch.equal(packed, _ref_pack(q))
    assert torch.equal(int_quant.unpack_int4(packed), q)


def test_pack_int4_known_bytes():
    q = torch.tensor([[1, -1], [2, -8]], dtype=torch.int8)  # rows 0 and 1 share a byte per column
    packed = int_quant.pack_int4(q).view(torch.uint8)
    assert packed.tolist() == [[0x21, 0x8F]]


def test_pack_int4_rejects_odd_rows_and_out_of_range():
    with pytest.raises(ValueError, match="even"):
        int_quant.pack_int4(torch.zeros(3, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        int_quant.pack_int4(torch.full((2, 2), 9, dtype=torch.int8))


def test_per_channel_int8_scale_and_values():
    w = torch.tensor([[0.5, -1.27, 0.0], [0.0, 0.0, 0.0], [2.54, 1.0, -0.01]])
    q, s = int_quant.quantize_per_channel(w, bits=8)
    assert torch.allclose(s, torch.tensor([1.27 / 127, 1.0, 2.54 / 127]))  # all-zero row: scale 1
    assert q.dtype == torch.int8 and q[0].tolist() == [50, -127, 0] and q[1].tolist() == [0, 0, 0]
    assert q[2].tolist() == [127, 50, 0]
    assert (int_quant.dequantize_per_channel(q, s) - w).abs().max() <= s.max() / 2 + 1e-7


def test_per_group_int4_error_bound_and_clipping():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 256, generator=g)
    q, s = int_quant.quantize_per_group(w, 128, bits=4)
    assert s.shape == (8, 2) and int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.allclose(s, w.reshape(8, 2, 128).abs().amax(-1) / 7)
    err = (int_quant.dequantize_per_group(q, s, 128) - w).abs()
    assert float(err.max()) <= float(s.max()) / 2 + 1e-6
    clipped = int_quant.group_amax(w, 128) * 0.5
    qc, sc = int_quant.quantize_per_group(w, 128, amax=clipped)
    assert torch.allclose(sc, clipped / 7) and int(qc.min()) == -8 and int(qc.max()) == 7  # saturates


def test_per_group_needs_divisible_input():
    with pytest.raises(ValueError, match="group_size"):
        int_quant.quantize_per_group(torch.ones(2, 100), 64)


def test_fp8_per_tensor_and_shared_scale():
    w = torch.tensor([[1.0, -448.0 * 2], [0.001, 3.0]])
    q, s = fp8.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and torch.allclose(s, torch.tensor([2.0]))
    assert float(fp8.from_fp8(q, s).abs().max()) == 896.0
    ws = [torch.full((2, 2), 1.0), torch.full((2, 2), 4.48)]
    qs, shared = fp8.quantize_fp8_shared(ws)
    assert torch.allclose(shared, torch.tensor([4.48 / 448])) and all(t.dtype == torch.float8_e4m3fn for t in qs)
    assert float(fp8.from_fp8(qs[1], shared).max()) == pytest.approx(4.48, rel=1e-2)
    assert torch.equal(fp8.fp8_scale(0.0), torch.tensor([1.0]))


def test_kv_cache_scales():
    assert torch.allclose(kv_cache.kv_cache_scale(12.7, "int8"), torch.tensor([0.1]))
    assert torch.equal(kv_cache.kv_cache_scale(12.7, "fp8"), torch.tensor([1.0]))       # clamped at 1 (TensorRT-LLM models/llama/convert.py)
    assert torch.allclose(kv_cache.kv_cache_scale(896.0, "fp8"), torch.tensor([2.0]))
    x = torch.tensor([0.05, -12.7, 30.0])
    s = kv_cache.kv_cache_scale(12.7, "int8")
    q = kv_cache.quantize_kv(x, s, "int8")
    assert q.dtype == torch.int8 and q.tolist() == [0, -127, 127]
    with pytest.raises(ValueError):
        kv_cache.kv_cache_scale(1.0, "int4")
