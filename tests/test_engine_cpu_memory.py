"""The CPU engine's optional weight copies never take the memory its KV pool needs: a float32 weight's oneDNN-blocked
copy (engine/cpu/linear.py) is made only within what the host has beyond the pool's reserve."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_hf_llama
from test_engine_cpu_util import engine_dir

from toolchain.engine.cpu.config import read_engine_config
from toolchain.engine.cpu.kv_cache import KvCacheConfig, kv_bytes_per_token, pool_reserve_bytes
from toolchain.engine.cpu.linear import BLOCKED_MIN_BYTES, Linear, blocked_budget, matmul
from toolchain.engine.cpu.weights import load_stages


def test_blocked_copies_stay_within_their_budget():
    g = torch.Generator().manual_seed(3)
    first, second = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)  # 1 MiB each
    assert first.numel() * 4 == BLOCKED_MIN_BYTES
    with blocked_budget(BLOCKED_MIN_BYTES * 3 // 2) as budget:
        kept, refused = Linear(first), Linear(second)
    assert kept.blocked_weight is not None and refused.blocked_weight is None
    assert (budget.refused, budget.refused_bytes, budget.left) == (1, BLOCKED_MIN_BYTES, BLOCKED_MIN_BYTES // 2)
    # Without its copy a weight runs the plain GEMM at every row count: exactly matmul's values.
    x = torch.randn(8, 512, generator=g)
    assert torch.equal(refused(x), matmul(x, second))
    assert Linear(second).blocked_weight is not None  # outside a budget nothing limits the copies
    with blocked_budget(-5) as budget:  # less than nothing available: no copy, no error
        assert Linear(first).blocked_weight is None and budget.left == 0


@pytest.fixture(scope="module")
def mib_head_engine(tmp_path_factory):
    """A tiny Llama whose LM head (4096 x 64 float32) is exactly the size that gets a blocked copy."""
    hf = make_hf_llama(tmp_path_factory.mktemp("hf-mib-head"), vocab_size=4096)
    return engine_dir(tmp_path_factory, hf)


def test_a_rank_leaves_its_kv_reserve_before_any_copy(mib_head_engine, caplog):
    _, dims, _ = read_engine_config(mib_head_engine)
    shard = load_stages(mib_head_engine, dims)[0][0]
    assert shard.lm_head.blocked_weight is not None  # the default reserve leaves plenty on this host
    with caplog.at_level(logging.WARNING, logger="toolchain.engine.cpu.weights"):
        starved = load_stages(mib_head_engine, dims, kv_reserve=1 << 60)[0][0]
    assert starved.lm_head.blocked_weight is None
    assert "rank0.safetensors: 1 weight(s) (0.0 GiB) keep the plain matmul" in caplog.text
    x = torch.randn(6, 64)  # from four rows the two differ only in the order of their sums
    torch.testing.assert_close(starved.lm_head(x), shard.lm_head(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(starved.lm_head(x), matmul(x, shard.lm_head.weight))


def test_the_reserve_is_the_capped_pool_over_its_share(mib_head_engine):
    _, dims, _ = read_engine_config(mib_head_engine)
    config = KvCacheConfig(max_tokens=1000, free_memory_fraction=0.5)
    assert pool_reserve_bytes(dims, config) == 2000 * kv_bytes_per_token(dims)
    assert pool_reserve_bytes(dims, KvCacheConfig()) == 0  # uncapped: the pool takes its share of what is left


def held_bytes(obj, seen: dict | None = None) -> int:
    """The bytes of every tensor a loaded shard keeps, each storage once, the optional blocked copies left out."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if not obj.is_mkldnn:  # a blocked copy (linear.blocked): optional, made only where memory allows
            seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            held_bytes(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            held_bytes(item, seen)
    elif type(obj).__module__.startswith("toolchain.engine.cpu") and hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            held_bytes(value, seen)
    return sum(seen.values())


def planned_weights(tmp_path, hf, **sections) -> int:
    import yaml

    from toolchain.checks.preflight import build_context
    from toolchain.spec import load_spec

    spec = {"name": "held", "target": "cpu", "model": {"checkpoint": str(hf), "dtype": "auto"},
            "limits": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256},
            **sections}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return build_context(load_spec(path), "plan").memory.ranks[0].weights_bytes


@pytest.mark.parametrize("method", ["none", "fp8"])
def test_the_plan_states_the_weights_the_engine_holds(tmp_path, method):
    """A bfloat16 checkpoint: the engine holds float32 (and FP8 a widened float32 copy beside its e4m3 weight)."""
    from toolchain.checkpoint.convert import convert_checkpoint
    from toolchain.quant.view import Quantization

    hf = make_hf_llama(tmp_path / "hf", dtype=torch.bfloat16)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    recipe = Quantization(method=method, search=False) if method != "none" else None
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, 250, (48,), generator=g) for _ in range(2)] if recipe else None
    convert_checkpoint(hf, ckpt, tp=1, pp=1, dtype="bfloat16", target="cpu", quantization=recipe,
                       calibration=calibration)
    import json
    (ckpt / "config.json").write_text(json.dumps({"pretrained_config": json.loads((ckpt / "config.json").read_text()),
                                                  "build_config": {"max_batch_size": 2, "max_input_len": 60,
                                                                   "max_seq_len": 80, "max_num_tokens": 128}}))
    _, dims, _ = read_engine_config(ckpt)
    shard = load_stages(ckpt, dims)[0][0]
    sections = {"quantization": {"method": method}} if method != "none" else {}
    assert planned_weights(tmp_path, hf, **sections) == held_bytes(shard)


def test_each_format_rows_cpu_widened_is_what_its_kernel_holds():
    """A row's `cpu_widened` (what the plan adds) against the kernel built from its stored tensors: a float32
    (out, in) weight kept beside the stored one, or none."""
    from toolchain.engine.cpu.qlinear import KERNELS, build_linear, stored_tensors
    from toolchain.quant import formats

    out_f, in_f = 64, 256
    g = torch.Generator().manual_seed(5)
    make = {"float": lambda s: torch.rand(s, generator=g) + 0.5, "int8": lambda s: torch.randint(-8, 8, s, generator=g,
            dtype=torch.int8), "uint8": lambda s: torch.randint(0, 120, s, generator=g, dtype=torch.uint8),
            "fp8": lambda s: (torch.rand(s, generator=g) + 0.5).to(torch.float8_e4m3fn)}
    rows = {row.cpu_kernel: row for row in formats.ALL if row.cpu_kernel in KERNELS}
    assert {k for k, row in rows.items() if row.cpu_widened} == {"fp8", "nvfp4", "fp8_block"}
    for kernel, row in rows.items():
        wanted = stored_tensors("m", out_f, in_f, False, kernel, group=row.group_size or 128)
        lin = build_linear({n: make[kind](shape) for n, (shape, kind) in wanted.items()}, "m", False, kernel,
                           group=row.group_size or 128)
        wide = [t for t in vars(lin).values() if isinstance(t, torch.Tensor) and not t.is_mkldnn
                and t.dtype == torch.float32 and t.shape == (out_f, in_f)]
        assert bool(wide) == row.cpu_widened, kernel
