"""The CPU engine's native kernels (toolchain/engine/cpu/csrc) against the torch operations they replace, their
refusals, the engine's tokens with and without them, and the fallback where they cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_engine_cpu_util import PROMPTS, load_engine

from toolchain.engine.cpu import SamplingParams, native
from toolchain.engine.cpu.step_tables import slot_matrix


@pytest.fixture(scope="module")
def ops():
    got = native.ops()
    assert got is not None, ("the native CPU kernels did not build on this host (a C++ compiler and Python headers "
                             "are needed); see the warning logged above")
    return got


def _torch_path(monkeypatch, engine=None):
    monkeypatch.setitem(native._loaded, "ops", None)
    if engine is not None:
        monkeypatch.setattr(engine.model, "kernels", None)


def _pool_case(seed, batch, heads, kv_heads, head_size, lengths, tpb=8):
    """Random pools of shuffled blocks, each request's slot matrix row, and a strided q (a slice of a fused QKV
    output, as the engine hands it)."""
    g = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // tpb) for n in lengths]
    order = torch.randperm(sum(blocks_each) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in blocks_each:
        tables.append(order[at:at + n])
        at += n
    slots_total = (sum(blocks_each) + 3) * tpb
    k_pool = torch.randn(slots_total, kv_heads, head_size, generator=g)
    v_pool = torch.randn(slots_total, kv_heads, head_size, generator=g)
    slots = slot_matrix(tables, lengths, tpb)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_size, generator=g)
    q = qkv[:, : heads * head_size].view(batch, heads, head_size)
    return q, k_pool, v_pool, slots, torch.tensor(lengths, dtype=torch.int64)


def _reference(q, k_pool, v_pool, slots, lengths, scale, window):
    """Per request: its keys gathered, then SDPA (what model._attend's torch path computes for a decode row)."""
    rows = []
    for b, n in enumerate(lengths.tolist()):
        first = max(0, n - window) if window else 0
        own = slots[b, first:n]
        keys, values = k_pool[own].transpose(0, 1)[None], v_pool[own].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[b][None, :, None], keys, values, scale=scale, enable_gqa=True)
        rows.append(o.reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("heads, kv_heads, head_size", [(4, 4, 16), (8, 2, 32), (12, 12, 64), (6, 3, 24), (4, 2, 20)])
@pytest.mark.parametrize("lengths", [[1], [5], [17, 1, 40], [33] * 16, [300, 7, 129, 64]])
@pytest.mark.parametrize("window", [0, 6])
def test_paged_decode_attention_equals_gather_then_sdpa(ops, heads, kv_heads, head_size, lengths, window):
    # [33] * 16 and the 300-token case pass the kernel's parallel threshold; the others run on one thread, and one
    # request splits its heads between the threads. Keys in blocks of eight with a tail; a head size of 20 takes the
    # one-key-at-a-time scores.
    q, k_pool, v_pool, slots, lens = _pool_case(len(lengths) + head_size, len(lengths), heads, kv_heads, head_size,
                                                lengths)
    scale = head_size ** -0.5
    got = ops.paged_decode_attention(q, k_pool, v_pool, slots, lens, scale, window)
    assert got.shape == (len(lengths), heads * head_size) and got.is_contiguous()
    torch.testing.assert_close(got, _reference(q, k_pool, v_pool, slots, lens, scale, window), rtol=1e-5, atol=1e-5)


def test_the_kernel_stores_the_new_keys_and_values_as_index_copy_does(ops):
    q, k_pool, v_pool, slots, lens = _pool_case(3, 3, 8, 2, 16, [9, 2, 20])
    write = slots[torch.arange(3), lens - 1].contiguous()  # each request's new token: its last slot
    new = torch.randn(3, 2 * 2 * 16)
    k_new, v_new = new[:, :32].view(3, 2, 16), new[:, 32:].view(3, 2, 16)  # strided views, as the engine's
    want_k, want_v = k_pool.clone().index_copy_(0, write, k_new), v_pool.clone().index_copy_(0, write, v_new)
    got = ops.paged_decode_attention(q, k_pool, v_pool, slots, lens, 0.25, 0, k_new, v_new, write)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert torch.equal(got, ops.paged_decode_attention(q, want_k, want_v, slots, lens, 0.25, 0))


def test_the_kernels_refuse_what_they_cannot_read(ops):
    q, k_pool, v_pool, slots, lens = _pool_case(4, 2, 4, 2, 16, [5, 9])
    bad = slots.clone()
    bad[1, 3] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match="slot .* is outside the pool"):
        ops.paged_decode_attention(q, k_pool, v_pool, bad, lens, 0.25, 0)
    with pytest.raises(RuntimeError, match="has 10 keys; its slot table holds 9"):
        ops.paged_decode_attention(q, k_pool, v_pool, slots, torch.tensor([5, 10]), 0.25, 0)
    with pytest.raises(RuntimeError, match="has 0 keys"):
        ops.paged_decode_attention(q, k_pool, v_pool, slots, torch.tensor([0, 9]), 0.25, 0)
    with pytest.raises(RuntimeError, match="pools must be contiguous float32"):
        ops.paged_decode_attention(q, k_pool.bfloat16(), v_pool.bfloat16(), slots, lens, 0.25, 0)
    with pytest.raises(RuntimeError, match="multiple of the pool's kv_heads"):
        ops.paged_decode_attention(q[:, :3], k_pool, v_pool, slots, lens, 0.25, 0)
    k_new = torch.zeros(2, 2, 16)
    with pytest.raises(RuntimeError, match="write slot .* is outside the pool"):
        ops.paged_decode_attention(q, k_pool, v_pool, slots, lens, 0.25, 0, k_new, k_new, torch.tensor([0, -1]))
    with pytest.raises(RuntimeError, match="write needs k_new and v_new"):
        ops.paged_decode_attention(q, k_pool, v_pool, slots, lens, 0.25, 0, None, None, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="rms_norm: float32"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6)


@pytest.mark.parametrize("shape", [(1, 64), (16, 768), (5, 3, 32), (2, 4099), (0, 16)])
def test_rms_norm_agrees_with_torchs_to_float32_rounding(ops, shape):
    torch.manual_seed(2)
    x, w = torch.randn(*shape) * 4, torch.randn(shape[-1])
    want = F.rms_norm(x, (shape[-1],), w, 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    strided = torch.randn(7, 4 * shape[-1])[:, : 3 * shape[-1]].view(7, 3, shape[-1])  # q_norm's per-head view
    torch.testing.assert_close(ops.rms_norm(strided, w, 1e-5), F.rms_norm(strided, (shape[-1],), w, 1e-5),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("cos_shape", ["rows, 1, d", "rows, d"])
def test_rotary_is_torchs_rotation_bit_for_bit(ops, cos_shape, monkeypatch):
    from toolchain.engine.cpu.rope import apply_rotary
    torch.manual_seed(3)
    qkv = torch.randn(9, (6 + 2 * 2) * 32) * 3
    qk = qkv[:, : 8 * 32].view(9, 8, 32)  # q and k heads side by side, a strided view of the QKV output
    shape = (9, 1, 32) if cos_shape == "rows, 1, d" else (9, 32)
    cos, sin = torch.randn(*shape), torch.randn(*shape)
    got = apply_rotary(qk, cos, sin)
    assert torch.equal(got, ops.rotary(qk, cos.reshape(9, 1, 32), sin.reshape(9, 1, 32)))
    _torch_path(monkeypatch)
    assert torch.equal(got, apply_rotary(qk, cos.reshape(9, 1, 32), sin.reshape(9, 1, 32)))


def _generate(engine, prompts, n=12, chunk=None):
    """Greedy tokens of all prompts decoded together; `chunk` feeds contexts that many tokens a step, so decode rows
    and context chunks share steps (the kernel's mixed-batch path)."""
    seqs = [engine.start(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    for s in seqs:
        engine.add(s)
    try:
        while not all(s.finished for s in seqs):
            engine.step([(s, min(s.pending, chunk) if chunk else s.pending) for s in seqs if not s.finished])
        return [list(s.output) for s in seqs]
    finally:
        for s in seqs:
            engine.release(s)


@pytest.mark.parametrize("fixture", ["hf_llama", "hf_mistral", "hf_qwen2", "hf_qwen3", "hf_llama32"])
def test_the_engines_greedy_tokens_are_the_same_with_and_without_the_kernels(tmp_path_factory, request, fixture,
                                                                            monkeypatch, ops):
    # GQA (llama, qwen2), an 8-token sliding window over 20-token prompts (mistral), per-head q/k norms (qwen3),
    # llama3 rope scaling (llama32); whole decode steps and steps mixing decode rows with context chunks.
    engine = load_engine(tmp_path_factory, request.getfixturevalue(fixture))
    assert engine.model.kernels is ops
    monkeypatch.setattr(engine.kv, "enable_block_reuse", False)  # every run computes its prompts afresh
    calls = []
    real = ops.paged_decode_attention

    class Counting:
        def paged_decode_attention(self, *args):
            calls.append(len(args))
            return real(*args)

    monkeypatch.setattr(engine.model, "kernels", Counting())
    native_tokens = [_generate(engine, PROMPTS), _generate(engine, PROMPTS, chunk=3)]
    assert 10 in calls and 7 in calls  # whole decode steps (the kernel stores the new keys) and mixed ones ran it
    _torch_path(monkeypatch, engine)
    assert [_generate(engine, PROMPTS), _generate(engine, PROMPTS, chunk=3)] == native_tokens


def test_without_a_compiler_the_engine_keeps_torchs_path_and_says_so(tmp_path, monkeypatch, caplog):
    # A real failed build: an empty cache and a compiler that exits 1.
    monkeypatch.setenv(native.DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.delitem(native._loaded, "ops", raising=False)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.ops() is None
        assert native.ops() is None  # asked again: decided once, said once
    said = [r.getMessage() for r in caplog.records if r.name == native.__name__]
    assert len(said) == 1 and said[0].startswith("CPU engine: native kernels unavailable (")
    assert "torch's path" in said[0] and "\n" not in said[0]


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    monkeypatch.delitem(native._loaded, "ops", raising=False)
    assert native.ops() is None


def test_a_process_that_finds_no_build_makes_one_past_a_stale_lock(tmp_path):
    # A fresh process (a library's operators register once per process) with an empty kernel directory holding only
    # the lock of a build killed long ago: it builds, marks the build whole and computes with it.
    import os
    import subprocess
    import sys
    import time
    where = tmp_path / native.build_key()
    where.mkdir()
    (where / "lock").touch()
    old = time.time() - 2 * native.STALE_LOCK_S
    os.utime(where / "lock", (old, old))
    code = ("import torch; from toolchain.engine.cpu import native; ops = native.ops(); "
            "x = torch.arange(8.0).view(2, 4); print(ops.rms_norm(x, torch.ones(4), 0.0).sum().item())")
    env = {**os.environ, native.DIR_VARIABLE: str(tmp_path)}
    env.pop(native.ENV_SWITCH, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    want = torch.nn.functional.rms_norm(torch.arange(8.0).view(2, 4), (4,), torch.ones(4), 0.0).sum().item()
    assert abs(float(done.stdout.strip()) - want) < 1e-5
    assert (where / "ready").exists() and (where / f"{native.LIBRARY}.so").exists() and not (where / "lock").exists()
