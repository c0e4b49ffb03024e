"""The decode step's batched tables and leaner operations give exactly what the plain per-request forms give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine_cpu_util import PROMPTS, load_engine

from toolchain.engine.cpu import SamplingParams
from toolchain.engine.cpu.kv_cache import BlockTable
from toolchain.engine.cpu.model import _Group, rms_norm
from toolchain.engine.cpu.rope import apply_rotary
from toolchain.engine.cpu.sampling import Sampler
from toolchain.engine.cpu.step_tables import additive_mask, slot_matrix


def test_slot_matrix_is_each_requests_slots_padded_with_slot_0(tmp_path_factory, hf_llama):
    kv = load_engine(tmp_path_factory, hf_llama).kv
    tpb = kv.tokens_per_block
    tables = [[7, 2, 9], [3], [5, 11, 1, 4], [8, 6]]
    lengths = [2 * tpb + 2, 3, 4 * tpb - 1, tpb + 1]
    got = slot_matrix(tables, lengths, tpb)
    assert got.shape == (4, max(lengths))
    for b, (blocks, n) in enumerate(zip(tables, lengths, strict=True)):
        table = BlockTable()
        table.blocks = blocks
        assert got[b, :n].tolist() == kv.slots(table, 0, n).tolist()
        assert got[b, n:].tolist() == [0] * (max(lengths) - n)


def test_a_group_from_the_slot_matrix_equals_one_from_each_rows_slots():
    tpb = 4
    tables = [[1, 2, 3], [4, 5], [6]]
    rows = [(0, 1, 9, None, None), (1, 1, 5, None, None), (2, 1, 2, None, None)]  # decoding: one token each
    lengths = [r[2] + r[1] for r in rows]
    slots = slot_matrix(tables, lengths, tpb)
    fast = _Group(rows, slots)
    plain = _Group([(f, n, past, slots[b, :past + n], None) for b, (f, n, past, _, _) in enumerate(rows)])
    assert fast.span == (0, 3)
    assert torch.equal(fast.slots, plain.slots) and torch.equal(fast.write, plain.write)
    assert torch.equal(fast.tokens, plain.tokens) and torch.equal(fast.mask(None), plain.mask(None))
    assert fast.write.tolist() == [slots[b, past].item() for b, (_, _, past, _, _) in enumerate(rows)]


def test_the_float_mask_gives_sdpa_the_same_result_as_the_boolean_one():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 1, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    mask = torch.rand(3, 1, 1, 9) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask), enable_gqa=True)
    assert torch.equal(want, got)


@pytest.mark.parametrize("shape", [(1, 64), (16, 96), (5, 3, 32), (16, 768), (2, 4096)])
def test_rms_norm_and_rotary_are_the_plain_expressions_bit_for_bit(shape, monkeypatch):
    from toolchain.engine.cpu import native
    torch.manual_seed(1)
    x, w = torch.randn(*shape) * 4, torch.randn(shape[-1])
    plain = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    if native.ops() is not None:  # the native norm sums the squares in its own order (test_engine_cpu_native.py)
        torch.testing.assert_close(rms_norm(x, w, 1e-5), plain, rtol=2e-6, atol=2e-6)
    monkeypatch.setitem(native._loaded, "ops", None)  # torch's path: bit for bit
    assert torch.equal(rms_norm(x, w, 1e-5), plain)
    heads = torch.randn(7, 4, 32)
    cos, sin = torch.randn(7, 1, 32), torch.randn(7, 1, 32)
    half = torch.cat((-heads[..., 16:], heads[..., :16]), dim=-1)
    assert torch.equal(apply_rotary(heads, cos, sin), heads * cos + half * sin)


def test_greedy_picks_from_the_batched_argmax_equal_the_samplers_own(tmp_path_factory, hf_llama, monkeypatch):
    engine = load_engine(tmp_path_factory, hf_llama)
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, top_k=1, temperature=0.5),
              SamplingParams(max_new_tokens=6, repetition_penalty=1.3), SamplingParams(max_new_tokens=6, end_id=2,
                                                                                     min_tokens=3)]
    assert [Sampler(p).picks_argmax(0) for p in params] == [True, False, False, False]

    def run():
        seqs = [engine.start(p, q) for p, q in zip(PROMPTS, params, strict=True)]
        for s in seqs:
            engine.add(s)
        while not all(s.finished for s in seqs):
            engine.step([(s, s.pending) for s in seqs if not s.finished])
        for s in seqs:
            engine.release(s)
        return [s.output for s in seqs]

    batched = run()
    monkeypatch.setattr(Sampler, "picks_argmax", lambda self, generated: False)
    assert run() == batched


@pytest.mark.parametrize("rows", [(0,), (1,), (2,), (3,), (17,), (), (2, 5)])
@pytest.mark.parametrize("out_f, in_f", [(80, 48), (640, 512)])
def test_matmul_is_x_times_the_stored_weight_transposed(rows, out_f, in_f):
    from toolchain.engine.cpu.linear import Linear, matmul
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(*rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    y = matmul(x, w)
    assert y.shape == (*rows, out_f) and y.is_contiguous()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(Linear(w, b)(x), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert torch.equal(Linear(w, b)(x, add_bias=False), Linear(w).product(x))  # the bias left out, nothing else


@pytest.mark.parametrize("rows", [1, 2, 3, 11, 12, 17])
def test_the_product_on_columns_is_matmuls_product_transposed(rows):
    from toolchain.engine.cpu.linear import Linear, as_columns, gemm_columns, matmul
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(160, 96, generator=g), torch.randn(160, generator=g)
    cols = as_columns(x)
    assert cols.shape == (96, max(rows, 2)) and cols.stride(0) == 1  # one row runs as two, as in matmul
    y = Linear(w).columns(cols)
    assert torch.equal(y.t()[:rows], matmul(x, w))
    assert torch.equal(Linear(w, b).columns(cols), y + b[:, None])
    assert torch.equal(Linear(w, b).columns(cols, add_bias=False), y)
    # The layout the fast GEMM reads: as rows below 12 columns, as they are from 12 on; the values unchanged.
    c = torch.randn(96, max(rows, 2), generator=g)
    laid = gemm_columns(c)
    assert torch.equal(laid, c) and laid.stride(0) == (1 if c.shape[1] < 12 else c.shape[1])


@pytest.mark.parametrize("rows", [(1,), (3,), (4,), (17,), (64,), (2, 5)])
def test_from_four_rows_a_float_linear_of_a_mib_runs_onednn_on_its_blocked_weight(rows):
    from toolchain.engine.cpu.linear import BLOCKED_FROM_ROWS, BLOCKED_MIN_BYTES, Linear, matmul, on_columns
    from toolchain.engine.cpu.qlinear import Int8WeightOnly
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(*rows, 512, generator=g), torch.randn(640, 512, generator=g), torch.randn(640, generator=g)
    assert w.numel() * 4 >= BLOCKED_MIN_BYTES
    lin = Linear(w, b)
    assert lin.blocked_weight is not None and lin.blocked_weight.is_mkldnn
    assert Int8WeightOnly(w).blocked_weight is None  # a quantized kernel keeps its own weight only
    assert Linear(w[:128]).blocked_weight is None  # 256 KiB: stays on matmul at any rows
    n = x.reshape(-1, 512).shape[0]
    y = lin(x, add_bias=False)
    assert y.shape == (*rows, 640) and y.is_contiguous()
    if n < BLOCKED_FROM_ROWS:
        assert torch.equal(y, matmul(x, w)) and on_columns(n, lin)
    else:  # oneDNN's sums: another order than matmul's, the same products
        torch.testing.assert_close(y, matmul(x, w), rtol=1e-4, atol=1e-4)
        assert not on_columns(n, lin) and on_columns(n, Linear(w[:128]))
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert torch.equal(lin(x), y + b)
    assert not on_columns(1, lin, Int8WeightOnly(w))


def test_the_output_projection_mlp_and_lm_head_on_columns_give_the_row_paths_logits_bit_for_bit(
        tmp_path_factory, hf_llama, monkeypatch):
    import toolchain.engine.cpu.model as model
    from toolchain.engine.cpu.model import Chunk
    engine = load_engine(tmp_path_factory, hf_llama)

    def logits():  # one and two decoding requests: the rows the columns path takes
        seqs = [engine.start(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS[:2]]
        for s in seqs:
            engine.add(s)
        try:
            engine.step([(s, s.pending) for s in seqs])
            return [engine.model.forward([Chunk(s.table, [5]) for s in seqs[:b]], engine.kv) for b in (1, 2)]
        finally:
            for s in seqs:
                engine.release(s)

    logits()  # the prompts' blocks cached: both runs below reuse them alike (a reused prompt's last token decodes)
    columns = logits()
    assert not columns[0][0].is_contiguous()  # the LM head's transposed view: the columns path ran
    monkeypatch.setattr(model, "on_columns", lambda rows, *modules: False)
    rows = logits()
    assert rows[0][0].is_contiguous()
    for a, b in zip(columns, rows, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
