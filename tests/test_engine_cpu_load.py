"""Loading an engine directory: strict like trtllm-build (missing tensor or wrong
shape is an error naming it, extra tensors are ignored with a warning), and
every config problem is a ToolchainError."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, engine_dir  # noqa: F401

from toolchain.engine.cpu import CpuEngine
from toolchain.errors import ToolchainError


@pytest.fixture
def engine_copy(tmp_path_factory, hf_llama, tmp_path):
    """A private, writable copy of a tp 2 x pp 2 engine directory."""
    out = tmp_path / "engine"
    shutil.copytree(engine_dir(tmp_path_factory, hf_llama, 2, 2), out)
    for f in out.glob("rank*.safetensors"):  # break hard links before editing
        f.write_bytes(f.read_bytes())
    return out


def edit_rank(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def edit_config(engine, fn):
    cfg = json.loads((engine / "config.json").read_text())
    fn(cfg)
    (engine / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(engine_copy):
    edit_rank(engine_copy / "rank3.safetensors", lambda t: t.pop("transformer.layers.0.mlp.gate.weight"))
    with pytest.raises(ToolchainError, match=r"rank3\.safetensors lacks 1 required tensor.*layers\.0\.mlp\.gate\.weight"):
        CpuEngine.load(engine_copy)


def test_missing_lm_head_on_last_stage(engine_copy):
    edit_rank(engine_copy / "rank2.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ToolchainError, match="lm_head.weight"):
        CpuEngine.load(engine_copy)


def test_shape_mismatch(engine_copy):
    def shrink(t):
        t["transformer.layers.0.attention.dense.weight"] = t["transformer.layers.0.attention.dense.weight"][:, :16].contiguous()
    edit_rank(engine_copy / "rank1.safetensors", shrink)
    with pytest.raises(ToolchainError, match=r"rank1\.safetensors: shape mismatch.*attention\.dense\.weight"):
        CpuEngine.load(engine_copy)


def test_extra_tensor_is_ignored_with_warning(engine_copy, caplog):
    edit_rank(engine_copy / "rank0.safetensors", lambda t: t.update({"transformer.layers.0.bogus": torch.zeros(3)}))
    with caplog.at_level(logging.WARNING, logger="toolchain.engine.cpu.weights"):
        engine = CpuEngine.load(engine_copy)
    assert "transformer.layers.0.bogus" in caplog.text
    assert engine.forward_logits([1, 2, 3]).shape == (3, 250)


def test_differing_replica_is_caught(engine_copy):
    def bump(t):
        t["transformer.layers.0.post_layernorm.weight"] = t["transformer.layers.0.post_layernorm.weight"] + 1
    edit_rank(engine_copy / "rank3.safetensors", bump)  # stage 1's second TP rank
    with pytest.raises(ToolchainError, match=r"rank3\.safetensors: replicated tensor .*post_layernorm"):
        CpuEngine.load(engine_copy)


def test_missing_rank_file(engine_copy):
    (engine_copy / "rank3.safetensors").unlink()
    with pytest.raises(ToolchainError, match="rank3.safetensors"):
        CpuEngine.load(engine_copy)


def test_corrupt_rank_file(engine_copy):
    (engine_copy / "rank0.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ToolchainError, match="cannot read"):
        CpuEngine.load(engine_copy)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["pretrained_config"].update(architecture="GPTForCausalLM"), "architecture 'GPTForCausalLM'"),
    (lambda c: c["pretrained_config"].pop("hidden_size"), "no 'hidden_size'"),
    (lambda c: c["pretrained_config"]["mapping"].update(world_size=8), "mapping"),
    (lambda c: c["pretrained_config"].update(rotary_scaling={"type": "yarn", "factor": 2.0}), "'yarn'"),
    (lambda c: c["pretrained_config"].update(rotary_scaling={"type": "llama3", "factor": 8.0}), "lacks"),
    (lambda c: c["pretrained_config"].update(quantization={"quant_algo": "W4A8_AWQ"}), "quant_algo W4A8_AWQ"),
    (lambda c: c["pretrained_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c["build_config"].pop("max_seq_len"), "max_seq_len"),
    (lambda c: c.pop("build_config"), "build_config"),
    (lambda c: c.pop("pretrained_config"), "pretrained_config"),
])
def test_bad_config(engine_copy, edit, message):
    edit_config(engine_copy, edit)
    with pytest.raises(ToolchainError, match=message):
        CpuEngine.load(engine_copy)


def test_not_an_engine_dir(tmp_path):
    with pytest.raises(ToolchainError, match="no engine config"):
        CpuEngine.load(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ToolchainError, match="not valid JSON"):
        CpuEngine.load(tmp_path)


def test_config_exposes_both_sections(tmp_path_factory, hf_llama):
    engine = CpuEngine.load(engine_dir(tmp_path_factory, hf_llama, 2, 2))
    assert engine.config["pretrained_config"]["mapping"]["world_size"] == 4
    assert engine.config["build_config"]["max_batch_size"] == 8
    assert engine.vocab_size == 250
    with pytest.raises(ToolchainError, match="outside the vocabulary"):
        engine.forward_logits([1, 250])
    with pytest.raises(ToolchainError, match="empty prompt"):
        engine.forward_logits([])


_POOL_PROBE = """
import os, sys, time
import torch
import toolchain.engine.cpu.engine as engine_module
from toolchain.engine.cpu import CpuEngine

def threads():
    return len(os.listdir("/proc/self/task"))

read = engine_module.read_engine_config

def read_after_parallel_work(path):  # what a large model's load does (conversions, oneDNN reorders), on any model
    torch.ones(1 << 22).mul_(2)
    return read(path)

engine_module.read_engine_config = read_after_parallel_work
torch.set_num_threads(2)
before = threads()
CpuEngine.load(sys.argv[1], num_threads=2)
deadline = time.monotonic() + 5
while threads() > before and time.monotonic() < deadline:  # a finished thread's OpenMP workers exit on their own
    time.sleep(0.05)
after = threads()
torch.ones(1 << 22).mul_(2)  # parallel work on this thread: its own pool, which outlives the call
time.sleep(0.5)
print(before, after, threads())
"""


def test_loading_leaves_no_openmp_pool_in_the_callers_thread(tmp_path_factory, hf_llama):
    # A pool left in the serving process's long-lived main thread made libgomp stop spinning for the batcher's
    # thread too (two pools on two cores): each of its matmuls then waited for workers to wake (engine.py).
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", _POOL_PROBE, str(engine_dir(tmp_path_factory, hf_llama, 1, 1))],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                         env={k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, with_pool = map(int, out.stdout.split())
    assert after == before
    assert with_pool > before  # the probe sees a pool where one is left
