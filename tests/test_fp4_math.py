"""NVFP4, MXFP4 and FP8 block-scale math against ModelOpt 0.47's own output, transformers' MXFP4 reader,
and hand-computed values of the GPU kernels' formulas.

The goldens in tests/data/fp4_golden were written by tools/fp4_golden.py with nvidia-modelopt 0.47.0
(NVFP4QTensor, MXFP4QTensor, FP8QTensor); ModelOpt itself is not imported here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from toolchain.quant import fp4, fp8_block
from toolchain.quant.fp8 import FP8_DTYPE

GOLDEN = Path(__file__).parent / "data" / "fp4_golden"


@pytest.fixture(scope="module")
def nvfp4_golden() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "nvfp4.safetensors"))


@pytest.fixture(scope="module")
def mxfp4_golden() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "mxfp4.safetensors"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --- goldens -------------------------------------------------------------------------------------


def test_golden_provenance_names_modelopt_047_and_every_nvfp4_case(nvfp4_golden):
    prov = json.loads((GOLDEN / "fp4_golden.json").read_text())
    assert prov["producer"]["nvidia-modelopt"] == "0.47.0"
    assert {f"{case}.packed" for case in prov["nvfp4_cases"]} <= set(nvfp4_golden)
    assert sum(p.stat().st_size for p in GOLDEN.iterdir()) < 200_000


@pytest.mark.parametrize("case", ["crafted", "wide", "bf16"])
def test_nvfp4_packing_byte_identical_to_modelopt(nvfp4_golden, case):
    prov = json.loads((GOLDEN / "fp4_golden.json").read_text())["nvfp4_cases"][case]
    w, golden_gs = nvfp4_golden[f"{case}.weight"], nvfp4_golden[f"{case}.global_scale"]
    packed, block_scale, gs = fp4.quantize_nvfp4(w, golden_gs if prov["global_scale_given"] else None)
    assert gs.dtype == torch.float32 and gs.shape == () and gs.item() == golden_gs.item()
    assert packed.dtype == torch.uint8 and torch.equal(packed, nvfp4_golden[f"{case}.packed"])
    assert block_scale.dtype == FP8_DTYPE
    assert torch.equal(_bytes(block_scale), _bytes(nvfp4_golden[f"{case}.block_scale"]))
    assert torch.equal(fp4.dequantize_nvfp4(packed, block_scale, gs), nvfp4_golden[f"{case}.dequantized"])


def test_nvfp4_golden_covers_the_clamps_and_the_zero_block(nvfp4_golden):
    """The crafted case (global scale 0.5) reaches both ends of ModelOpt's [2**-9, 448] clamp and the 1.0 of
    an all-zero block; the golden would not catch a missing clamp otherwise."""
    scales = nvfp4_golden["crafted.block_scale"].float()
    assert scales[0, 0] == 2.0 and scales[1, 0] == 1.0 and scales[1, 1] == 448.0 and scales[2, 0] == 2.0 ** -9
    _, ours, _ = fp4.quantize_nvfp4(nvfp4_golden["crafted.weight"], torch.tensor(0.5))
    assert torch.equal(ours.float(), scales)


@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_mxfp4_dequantization_equals_modelopt(mxfp4_golden, proj):
    blocks, scales = mxfp4_golden[f"{proj}_blocks"], mxfp4_golden[f"{proj}_scales"]
    golden = mxfp4_golden[f"{proj}.dequantized"]
    assert torch.equal(fp4.dequantize_mxfp4(blocks, scales, torch.float32), golden)
    assert torch.equal(fp4.dequantize_mxfp4(blocks, scales, torch.bfloat16), golden.to(torch.bfloat16))


def test_mxfp4_dequantization_equals_transformers_gpt_oss_reader(mxfp4_golden):
    """transformers' own gpt-oss dequantization (bf16, transposed to GptOssExperts' [E, in, out])."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = mxfp4_golden["gate_up_proj_blocks"], mxfp4_golden["gate_up_proj_scales"]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(fp4.dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def test_mxfp4_quantization_equals_modelopt(mxfp4_golden):
    blocks, scales = fp4.quantize_mxfp4(mxfp4_golden["quant.weight"])
    assert blocks.shape == (2, 8, 2, 16) and scales.shape == (2, 8, 2)
    assert torch.equal(blocks, mxfp4_golden["quant.blocks"])
    assert torch.equal(scales, mxfp4_golden["quant.scales"])
    assert scales[0, 0, 0] == 0  # the all-zero block: 2^-127


def test_fp8_block_quantization_equals_modelopt_with_partial_edge_tiles():
    golden = load_file(str(GOLDEN / "fp8_block.safetensors"))
    q, scale = fp8_block.quantize_fp8_block(golden["fp8.weight"])
    assert scale.shape == (2, 2) and torch.equal(scale, golden["fp8.scale"])
    assert torch.equal(_bytes(q), _bytes(golden["fp8.quantized"]))


# --- E2M1 and packing ----------------------------------------------------------------------------


def test_e2m1_rounds_ties_to_the_even_code_and_saturates_at_6():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, 0.2, 0.26, 4.9, 5.1])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.0, 0.5, 4.0, 6.0]
    assert fp4.e2m1_values(fp4.e2m1_codes(x)).tolist() == expected
    assert fp4.e2m1_values(fp4.e2m1_codes(-x)).tolist() == [-v for v in expected]
    assert fp4.e2m1_codes(torch.tensor([-0.1, 0.1, -3.0])).tolist() == [8, 0, 13]


def test_every_e2m1_value_is_its_own_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = fp4.e2m1_values(codes)
    back = fp4.e2m1_codes(values)
    expected = codes.clone()
    expected[8] = 0  # -0.0 is not < 0: it comes back as +0, as in ModelOpt's _cast_fp4
    assert torch.equal(back, expected)


def test_nibble_packing_puts_the_even_element_low():
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = fp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]
    assert torch.equal(fp4.unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="even"):
        fp4.pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


# --- NVFP4 properties ----------------------------------------------------------------------------


def test_nvfp4_global_scale_is_amax_over_2688():
    assert fp4.nvfp4_global_scale(torch.tensor([-5376.0, 1.0])).item() == 2.0
    assert fp4.nvfp4_global_scale(0.0).item() == 1.0


def test_nvfp4_requantizing_its_dequantization_is_the_identity():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-2, 1, 24)[:, None]
    packed, scale, gs = fp4.quantize_nvfp4(w)
    again = fp4.quantize_nvfp4(fp4.dequantize_nvfp4(packed, scale, gs), gs)
    assert torch.equal(_bytes(again[1]), _bytes(scale))
    # The same values; a -0 (a small negative that rounded to zero) comes back as +0.
    values = [fp4.e2m1_values(fp4.unpack_nibbles(p)) for p in (packed, again[0])]
    assert torch.equal(values[0], values[1])


def test_nvfp4_error_is_within_one_unit_of_the_block_scale():
    """Away from the clamps, every value lies within [-6, 6] block steps and E2M1's widest gap is 2 (4 to 6)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 128, generator=g) * 3
    packed, scale, gs = fp4.quantize_nvfp4(w)
    step = (scale.float() * gs).repeat_interleave(16, dim=-1)
    err = (fp4.dequantize_nvfp4(packed, scale, gs) - w).abs()
    assert (err <= step * 1.0 + 1e-7).all()
    assert (err > 0).any()


def test_nvfp4_rejects_rows_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        fp4.quantize_nvfp4(torch.ones(2, 24))


# --- NVFP4 activations (cvt_warp_fp16_to_fp4) ----------------------------------------------------


def test_nvfp4_activation_matches_hand_computed_kernel_values():
    """input_scale 2**-9 gives SFScaleVal 512. Per block of 16 (the rest zero):
    vecMax 3:   SF = 512 * 3/6 = 256, outputScale 2;     q * 256 * 2**-9 = q / 2
    vecMax 5:   SF = 426.7 -> e4m3 416, outputScale 512/416; seen = q * 0.8125
    vecMax 100: SF saturates at 448, outputScale 512/448; seen = q * 0.875
    vecMax 0:   zeros; vecMax 1e-6: SF rounds to 0 in e4m3, so the block is zeros."""
    x = torch.zeros(5, 16)
    x[0, :4] = torch.tensor([3.0, 0.5, -1.0, 1.3])
    x[1, :4] = torch.tensor([5.0, 1.0, 2.0, -3.7])
    x[2, :3] = torch.tensor([100.0, 1.0, -50.0])
    x[4, :2] = torch.tensor([1e-6, -5e-7])
    seen = fp4.fake_quantize_nvfp4_activation(x.reshape(1, 80), torch.tensor(2.0 ** -9)).reshape(5, 16)
    assert seen[0, :4].tolist() == [3.0, 0.5, -1.0, 1.5]  # 2.6 -> 3
    assert seen[1, :4].tolist() == [6 * 0.8125, 1 * 0.8125, 2 * 0.8125, -4 * 0.8125]  # 6.15 -> 6, 2.46 -> 2, 4.55 -> 4
    assert seen[2, :3].tolist() == [6 * 0.875, 1 * 0.875, -6 * 0.875]  # 114 and 57 saturate to 6
    assert not seen[:, 4:].any() and not seen[3].any() and not seen[4].any()


def test_nvfp4_activation_with_a_calibrated_scale_stays_close():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    seen = fp4.fake_quantize_nvfp4_activation(x, fp4.nvfp4_global_scale(x.abs().max()))
    block_max = x.reshape(4, 4, 16).abs().amax(-1, keepdim=True)
    assert ((seen - x).reshape(4, 4, 16).abs() <= block_max / 6 * 1.07).all()


# --- MXFP4 properties ----------------------------------------------------------------------------


def test_mxfp4_round_trip_is_exact_on_e2m1_values_times_powers_of_two():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (3, 64), generator=g)
    codes[:, ::32] = 7  # every block reaches 6, so its scale is the power of two itself
    w = fp4.E2M1_VALUES[codes] * torch.tensor([2.0 ** -6, 1.0, 2.0 ** 5])[:, None]
    blocks, scales = fp4.quantize_mxfp4(w)
    assert scales.tolist() == [[121, 121], [127, 127], [132, 132]]
    assert torch.equal(fp4.dequantize_mxfp4(blocks, scales, torch.float32), w)


def test_mxfp4_rounds_ties_down_unlike_nvfp4():
    blocks, scales = fp4.quantize_mxfp4(torch.tensor([6.0, 0.25, 0.75, 1.75, 5.0] + [0.0] * 27))
    assert scales.tolist() == [127]
    values = fp4.dequantize_mxfp4(blocks, scales, torch.float32)
    assert values[:5].tolist() == [6.0, 0.0, 0.5, 1.5, 4.0]
    assert fp4.unpack_nibbles(blocks)[0, 5] == 8  # a zero is stored as -0, as ModelOpt's cast_fp4 does


def test_mxfp4_dequantize_rejects_mismatched_scales():
    with pytest.raises(ValueError, match="disagree"):
        fp4.dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


# --- FP8 block scales ----------------------------------------------------------------------------


def test_fp8_block_scale_grid_covers_partial_edge_tiles():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 300, generator=g)
    q, scale = fp8_block.quantize_fp8_block(w)
    assert q.shape == (200, 300) and q.dtype == FP8_DTYPE
    assert scale.shape == fp8_block.scale_grid_shape(200, 300) == (2, 3)
    assert scale[1, 2] == w[128:, 256:].abs().max() / 448  # the corner tile is 72 x 44
    assert scale[0, 1] == w[:128, 128:256].abs().max() / 448


def test_fp8_block_error_bound_and_zero_tile():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(130, 260, generator=g) * torch.logspace(-3, 1, 130)[:, None]
    w[:128, 128:256] = 0.0
    q, scale = fp8_block.quantize_fp8_block(w)
    assert scale[0, 1] == 1.0 and not q[:128, 128:256].float().any()
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :260]
    err = (fp8_block.dequantize_fp8_block(q, scale) - w).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of a normal value, 2^-10 of the scale below 2^-6.
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, full * 2.0 ** -10)).all()


def test_fp8_block_is_exact_on_e4m3_values_with_power_of_two_tile_scales():
    g = torch.Generator().manual_seed(7)
    base = (torch.randn(140, 150, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE).float()
    base[0, 0] = base[0, 140] = base[130, 0] = base[130, 140] = 448.0  # each tile's amax is 448
    tile_scale = torch.tensor([[2.0 ** -8, 2.0 ** -3], [1.0, 4.0]])
    w = base * tile_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:140, :150]
    q, scale = fp8_block.quantize_fp8_block(w)
    assert torch.equal(scale, tile_scale)
    assert torch.equal(fp8_block.dequantize_fp8_block(q, scale), w)
    with pytest.raises(ValueError, match="expected \\(2, 2\\)"):
        fp8_block.dequantize_fp8_block(q, scale[:1])


def test_fp8_activation_per_1x128_as_scale_1x128_kernel():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 300, generator=g).to(torch.bfloat16)
    x[1, 128:256] = 0.0
    q, scale = fp8_block.quantize_fp8_per_1x128(x)
    assert q.shape == (3, 300) and scale.shape == (3, 3)
    amax = x[2, 256:].float().abs().max()
    assert scale[2, 2] == 1.0 / (448.0 / amax)  # the kernel stores 1 / (448 / amax), not amax / 448
    assert scale[1, 1] == 1.0 and not q[1, 128:256].float().any()
    assert q.float().abs().amax(dim=-1).eq(448.0).all()  # each token's largest value maps to 448
    seen = fp8_block.fake_quantize_fp8_per_1x128(x)
    assert torch.equal(seen, fp8_block.dequantize_fp8_per_1x128(q, scale))
    step = scale.repeat_interleave(128, -1)[:, :300]
    assert ((seen - x.float()).abs() <= x.float().abs() * 2.0 ** -4 + step * 2.0 ** -10).all()
