"""AWQ and SmoothQuant on synthetic activations with outlier channels (the
the AWQ and SmoothQuant papers' recipes): the searches must beat plain round-to-nearest."""

from __future__ import annotations

import torch

from toolchain.quant import awq, gptq, smoothquant
from toolchain.quant.int_quant import dequantize_per_channel, dequantize_per_group, fake_quant_per_group


def _outlier_problem(seed=0, n=2048, inp=256, out=192, factor=50.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inp, generator=g)
    w = torch.randn(out, inp, generator=g) * 0.05
    hot = torch.randperm(inp, generator=g)[:4]
    x[:, hot] *= factor          # function-preserving: big inputs, small matching weight columns
    w[:, hot] /= factor
    return x, w


def _stats(x):
    return x.abs().mean(0), (x.double().t() @ x.double()) / x.shape[0], x.abs().amax(0)


def test_awq_beats_round_to_nearest_on_outliers():
    x, w = _outlier_problem()
    absmean, cov, _ = _stats(x)
    (lin,), found = awq.quantize_awq([w], absmean, cov, 128)
    y = x @ w.t()
    w_awq = dequantize_per_group(lin.weight, lin.weights_scaling_factor, 128)
    y_awq = (x * lin.prequant_scaling_factor) @ w_awq.t()
    y_rtn = x @ fake_quant_per_group(w, 128).t()
    err_awq, err_rtn = (y_awq - y).pow(2).mean(), (y_rtn - y).pow(2).mean()
    assert err_awq < 0.5 * err_rtn, (float(err_awq), float(err_rtn))
    assert found.loss <= found.rtn_loss
    assert lin.weight.dtype == torch.int8 and lin.weights_scaling_factor.shape == (192, 2)
    assert lin.prequant_scaling_factor.shape == (256,)


def test_awq_shared_input_gets_one_prequant_and_search_off_is_rtn():
    x, w = _outlier_problem(seed=1)
    absmean, cov, _ = _stats(x)
    w2 = torch.randn(64, 256) * 0.05
    lins, _ = awq.quantize_awq([w, w2], absmean, cov, 64)
    assert torch.equal(lins[0].prequant_scaling_factor, lins[1].prequant_scaling_factor)
    base, found = awq.quantize_awq([w], absmean, cov, 64, search=False, clip=False)
    assert found is None and torch.equal(base[0].prequant_scaling_factor, torch.ones(256))
    assert torch.allclose(dequantize_per_group(base[0].weight, base[0].weights_scaling_factor, 64),
                          fake_quant_per_group(w, 64))


def _correlated_problem(seed=4, n=4096, inp=256, out=96):
    """Inputs with strongly correlated channels: where error compensation pays."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(inp, inp, generator=g) / inp ** 0.5 + torch.eye(inp)
    x = torch.randn(n, inp, generator=g) @ mix
    w = torch.randn(out, inp, generator=g) * 0.05
    return x, w


def test_gptq_rounding_lowers_output_error_on_the_same_grid():
    x, w = _correlated_problem()
    absmean, cov, _ = _stats(x)
    (near,), _ = awq.quantize_awq([w], absmean, cov, 64, rounding="nearest")
    (comp,), _ = awq.quantize_awq([w], absmean, cov, 64, rounding="gptq")
    # same layout, same scales and prequant: only the integers differ
    assert torch.equal(near.weights_scaling_factor, comp.weights_scaling_factor)
    assert torch.equal(near.prequant_scaling_factor, comp.prequant_scaling_factor)
    assert comp.weight.dtype == torch.int8 and int(comp.weight.min()) >= -8 and int(comp.weight.max()) <= 7
    assert not torch.equal(near.weight, comp.weight)
    y = x @ w.t()

    def err(lin):
        wd = dequantize_per_group(lin.weight, lin.weights_scaling_factor, 64)
        return float(((x * lin.prequant_scaling_factor) @ wd.t() - y).pow(2).mean())
    assert err(comp) < 0.8 * err(near), (err(comp), err(near))


def test_gptq_rounding_is_nearest_when_inputs_are_uncorrelated():
    # Diagonal C: no channel can absorb another's error, so every integer is the nearest one.
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    cov = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(6)) + 0.5)
    from toolchain.quant.int_quant import quantize_per_group
    q, scales = quantize_per_group(w, 64)
    assert torch.equal(gptq.gptq_round(w, scales, gptq.upper_inverse_factor(cov), 64, block=48), q)
    order = gptq.act_order(cov)
    assert not torch.equal(order, torch.arange(128))
    assert torch.equal(gptq.gptq_round(w, scales, gptq.upper_inverse_factor(cov, order), 64, order=order), q)


def test_act_order_rounds_the_loudest_channels_first_and_maps_back():
    x, w = _correlated_problem(seed=8)
    x[:, 200] *= 30.0  # one loud channel
    _, cov, _ = _stats(x)
    order = gptq.act_order(cov)
    assert int(order[0]) == 200 and sorted(order.tolist()) == list(range(256))
    from toolchain.quant.int_quant import quantize_per_group
    _, scales = quantize_per_group(w, 64)
    q_ord = gptq.gptq_round(w, scales, gptq.upper_inverse_factor(cov, order), 64, order=order)
    q_nat = gptq.gptq_round(w, scales, gptq.upper_inverse_factor(cov), 64)

    def err(q):
        return float(awq.output_error(dequantize_per_group(q, scales, 64) - w, cov))
    # the loud channel, rounded first, keeps its nearest integer; the order changes the result for the better
    assert torch.equal(q_ord[:, 200], torch.clamp(torch.round(w[:, 200] / scales[:, 3]), -8, 7).to(torch.int8))
    assert err(q_ord) < err(q_nat)


def test_gptq_factor_tolerates_channels_calibration_never_saw():
    x, _ = _correlated_problem(seed=7, inp=64)
    x[:, 5] = 0.0
    _, cov, _ = _stats(x)
    u = gptq.upper_inverse_factor(cov)
    assert torch.isfinite(u).all() and float(u[5, 5]) > 0
    assert torch.count_nonzero(u[5, 6:]) == 0 and torch.count_nonzero(u[:5, 5]) == 0


def test_awq_rejects_an_unknown_rounding():
    import pytest
    with pytest.raises(ValueError, match="rounding"):
        awq.quantize_awq([torch.zeros(8, 64)], torch.ones(64), torch.eye(64), 64, rounding="stochastic")


def test_clip_search_never_widens_the_range():
    x, w = _outlier_problem(seed=2)
    _, cov, _ = _stats(x)
    amax = awq.search_clip(w, cov, 128)
    org = w.reshape(192, 2, 128).abs().amax(-1)
    assert bool((amax <= org + 1e-7).all()) and bool((amax >= 0.5 * org).all())


def test_smoothquant_recovers_static_w8a8_loss():
    x, w = _outlier_problem(seed=3)
    _, _, amax = _stats(x)
    y = x @ w.t()

    def run(lin):
        xq = smoothquant.quantize_activation(x, lin.prequant_scaling_factor, lin.activation_scaling_factor)
        wd = dequantize_per_channel(lin.weight, lin.weights_scaling_factor)
        return (xq.float() * lin.activation_scaling_factor) @ wd.t()

    (sq,) = smoothquant.quantize_sq([w], amax, alpha=0.5)
    (plain,) = smoothquant.quantize_sq([w], amax, alpha=None)
    err_sq, err_plain = (run(sq) - y).pow(2).mean(), (run(plain) - y).pow(2).mean()
    assert err_sq < 0.2 * err_plain, (float(err_sq), float(err_plain))
    assert sq.weight.dtype == torch.int8 and sq.weights_scaling_factor.shape == (192,)
    assert sq.activation_scaling_factor.shape == (1,) and sq.prequant_scaling_factor.shape == (256,)
    assert torch.equal(plain.prequant_scaling_factor, torch.ones(256))


def test_smoothing_factor_formula_and_shared_vectors():
    a = torch.tensor([4.0, 1.0, 0.0])
    w1 = torch.tensor([[1.0, 2.0, 1.0]])
    w2 = torch.tensor([[4.0, 0.5, 1.0]])
    s = smoothquant.smoothing_factors(a, [w1, w2], 0.5)
    expect = torch.tensor([(4.0 ** 0.5) / (4.0 ** 0.5), 1.0 / (2.0 ** 0.5), (1e-5 ** 0.5) / 1.0])
    assert torch.allclose(s, expect)
    lins = smoothquant.quantize_sq([w1, w2], a, 0.5)
    assert torch.equal(lins[0].prequant_scaling_factor, lins[1].prequant_scaling_factor)
    assert torch.equal(lins[0].activation_scaling_factor, lins[1].activation_scaling_factor)


def test_scale_search_on_a_row_sample_matches_the_full_search():
    x, w = _outlier_problem(seed=9, out=1200)
    absmean, cov, _ = _stats(x)
    full = awq.search_scales([w], absmean, cov, 128, rows=10**9)
    sampled = awq.search_scales([w], absmean, cov, 128, rows=256)
    again = awq.search_scales([w], absmean, cov, 128, rows=256)
    assert torch.equal(sampled.scales, again.scales)  # a fixed sample: conversions are reproducible

    def loss(found):
        s = found.scales
        return float(awq.output_error(fake_quant_per_group(w * s, 128) / s - w, cov))
    rtn = float(awq.output_error(fake_quant_per_group(w, 128) - w, cov))
    assert loss(sampled) <= loss(full) * 1.02 and loss(sampled) < 0.5 * rtn
