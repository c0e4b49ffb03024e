"""The CPU engine runs every quantized format as stored, and each agrees with
its own dequantized reference within the tolerance stated here:

| format | path | tolerance vs dequantized reference |
|---|---|---|
| int8/int4 weight-only, AWQ, int4 with zero (decode, <= 16 rows) | packed CPU kernels, bf16 activations | rel. 2e-2 of the output scale (bf16 input rounding) |
| same (prefill, > 16 rows) | dequantize + fp32 matmul | 1e-5 |
| SmoothQuant W8A8 | int8 x int8 -> int32 `torch._int_mm` | 1e-5 (integer arithmetic is exact) |
| FP8 | emulation (e4m3 rounding of activations and weights) | 1e-6 |
| KV cache int8 / fp8 | cache stores int8 / e4m3, read back with the layer's scale | logits within 5e-2 (int8) / 1e-1 (fp8) of the fp cache |
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolchain.engine.cpu import qlinear
from toolchain.quant import fp8 as fp8q
from toolchain.quant.int_quant import dequantize_per_group, pack_int4, quantize_per_channel, quantize_per_group
from toolchain.quant.prequantized import asym_quantize_per_group, to_signed_with_zero
from toolchain.quant.smoothquant import quantize_sq


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.fixture
def w():
    return torch.randn(192, 256, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_int8_weight_only(w, rows):
    lin = qlinear.Int8WeightOnly(w)
    assert lin.weight.dtype == torch.int8
    x = torch.randn(rows, 256)
    ref = F.linear(x, lin.dequantized())
    assert _rel(lin(x), ref) < 2e-2  # the kernel takes bf16 activations, at any row count
    q, s = quantize_per_channel(w, 8)
    assert torch.equal(lin.weight, q) and torch.equal(lin.scale, s)


@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
def test_int8_weight_only_from_eight_rows_runs_onednn_bf16_on_the_same_int8_values(rows):
    from toolchain.engine.cpu.linear import blocked_budget
    if not qlinear._bf16_matmul():
        pytest.skip("oneDNN has no native bfloat16 matmul on this CPU: the int8 kernel runs at every row count")
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(1024, 512, generator=g) * 0.05, torch.randn(rows, 512, generator=g).to(torch.bfloat16)
    lin = qlinear.Int8WeightOnly(w)
    assert lin.blocked_bf16 is not None and lin.blocked_bf16.is_mkldnn  # 1 MiB of bfloat16: the copy's threshold
    assert qlinear.Int8WeightOnly(w[:128]).blocked_bf16 is None  # 128 KiB: the int8 kernel at every row count
    int8 = torch.ops.aten._weight_int8pack_mm(x, lin.weight, lin._scale_bf16)
    y = lin.kernel(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 1024)
    if rows < qlinear.INT8_BLOCKED_FROM_ROWS:
        assert torch.equal(y, int8)
    else:  # the same products summed in oneDNN's order, rounded to bf16 before the scale: within an ulp or so
        assert not torch.equal(y, int8)
        torch.testing.assert_close(y.float(), int8.float(), rtol=2 ** -7, atol=2 ** -7 * int8.abs().max().item())
    with blocked_budget(0):  # no room for the copy: the int8 kernel, exactly
        starved = qlinear.Int8WeightOnly(w)
    assert starved.blocked_bf16 is None and torch.equal(starved.kernel(x), int8)


@pytest.mark.parametrize("rows", [1, 40, 300])
def test_int4_awq_layout(w, rows):
    q, s = quantize_per_group(w, 128)
    prequant = torch.rand(256) + 0.5
    lin = qlinear.Int4Grouped(pack_int4(q), s, 128, prequant=prequant)
    assert lin.weight.shape == (96, 256) and lin.weight.dtype == torch.int8
    x = torch.randn(rows, 256)
    ref = F.linear(x * prequant, dequantize_per_group(q, s, 128))
    assert _rel(lin(x), ref) < 2e-2


def test_int4_with_zero_point(w):
    qa, z, s = asym_quantize_per_group(w, 64)
    signed, scales, zero = to_signed_with_zero(qa, z, s)
    lin = qlinear.Int4Grouped(pack_int4(signed), scales, 64, zero=zero)
    x = torch.randn(3, 256)
    ref = F.linear(x, dequantize_per_group(signed, scales, 64, zero=zero))
    assert _rel(lin(x), ref) < 2e-2
    x = torch.randn(30, 256)
    assert _rel(lin(x), ref := F.linear(x, lin.dequantized())) < 2e-2 and ref.abs().max() > 0


def test_int4_per_channel_weight_only(w):
    lin = qlinear.Int4WeightOnly(w)
    x = torch.randn(2, 256)
    assert _rel(lin(x), F.linear(x, lin.dequantized())) < 2e-2
    assert (lin.dequantized() - w).abs().max() <= w.abs().amax(1).max() / 7 / 2 + 1e-6


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_smoothquant_int_mm(w, rows):
    amax = torch.rand(256) * 4 + 0.1
    (sq,) = quantize_sq([w], amax, 0.5)
    lin = qlinear.SmoothQuantW8A8(sq.weight, sq.weights_scaling_factor, sq.activation_scaling_factor,
                                  sq.prequant_scaling_factor)
    x = torch.randn(rows, 256)
    xq = lin.quantize_input(x).float() * sq.activation_scaling_factor
    ref = F.linear(xq, sq.weight.float() * sq.weights_scaling_factor[:, None])
    assert _rel(lin(x), ref) < 1e-5


def test_fp8_emulation(w):
    q, s = fp8q.quantize_fp8_weight(w)
    a = fp8q.fp8_scale(torch.tensor(3.0))
    lin = qlinear.Fp8PerTensor(q, s, a)
    x = torch.randn(4, 256)
    ref = F.linear(fp8q.fake_fp8(x, a), q.float() * s)
    assert _rel(lin(x), ref) < 1e-6
    assert _rel(lin(x), F.linear(x, w)) < 0.1


def _engine_for(hf, tmp_path, recipe, tp=1):
    import json
    import os

    from toolchain.checkpoint.convert import convert_checkpoint
    from toolchain.engine.cpu import CpuEngine

    tag = f"{recipe.method}-{recipe.kv_cache}-{tp}"
    ckpt, eng = tmp_path / f"ckpt-{tag}", tmp_path / f"eng-{tag}"
    ckpt.mkdir()
    eng.mkdir()
    g = torch.Generator().manual_seed(0)
    convert_checkpoint(hf, ckpt, tp=tp, pp=1, dtype="float32", target="cpu", quantization=recipe,
                       calibration=[torch.randint(0, 250, (48,), generator=g) for _ in range(4)])
    for f in ckpt.glob("rank*.safetensors"):
        os.link(f, eng / f.name)
    build = {"max_batch_size": 2, "max_input_len": 60, "max_seq_len": 80, "max_num_tokens": 128}
    (eng / "config.json").write_text(json.dumps({"pretrained_config": json.loads((ckpt / "config.json").read_text()),
                                                 "build_config": build}))
    return CpuEngine.load(eng)


@pytest.mark.parametrize("kind, tol", [("int8", 5e-2), ("fp8", 1e-1)])
def test_kv_cache_stored_quantized(hf_llama, tmp_path, kind, tol):
    from toolchain.quant.view import Quantization

    fp = _engine_for(hf_llama, tmp_path, Quantization())
    q = _engine_for(hf_llama, tmp_path, Quantization(kv_cache=kind), tp=2)
    assert q.kv.k.dtype == q.kv.v.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kind]
    ids = list(range(3, 43))
    ref, got = fp.forward_logits(ids), q.forward_logits(ids)
    assert _rel(got, ref) < tol
    # decode through the quantized cache gives the same tokens as a whole-prompt forward predicts
    from toolchain.engine.cpu import SamplingParams
    out = q.generate(ids[:20], SamplingParams(max_new_tokens=5, top_k=1))
    assert out[0] == int(q.forward_logits(ids[:20])[-1].argmax())


@pytest.mark.parametrize("method", ["int8_wo", "int4_wo", "smoothquant", "fp8"])
def test_whole_model_close_to_fp(hf_llama, tmp_path, method):
    from toolchain.quant.view import Quantization

    fp = _engine_for(hf_llama, tmp_path, Quantization())
    q = _engine_for(hf_llama, tmp_path, Quantization(method=method), tp=2)
    ids = list(range(3, 40))
    ref, got = fp.forward_logits(ids), q.forward_logits(ids)
    # random weights have no smooth structure: these bound gross errors, the per-linear tests the arithmetic
    assert _rel(got, ref) < {"int8_wo": 3e-2, "int4_wo": 0.5, "smoothquant": 0.25, "fp8": 0.25}[method]
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.7
