"""CPU-engine pieces the families need: sliding-window masks, the window
setting from runtime_defaults, q/k norms loaded strictly, Qwen naming."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, engine_dir  # noqa: F401

from toolchain.engine.cpu import CpuEngine
from toolchain.engine.cpu.model import _Group
from toolchain.errors import ToolchainError


@pytest.mark.parametrize("window", [None, 1, 2, 3, 10])
def test_attention_masks_match_definition(window):
    """One padded group of requests with different cached lengths and new-token counts."""
    rows = [(0, 6, 0), (6, 1, 5), (7, 3, 4), (10, 2, 7)]  # (first token, new tokens, cached before)
    group = _Group([(first, n, past, torch.arange(past + n), None) for first, n, past in rows])
    mask = group.mask(window)[:, 0]
    assert mask.shape == (4, 6, 9)
    for b, (_, n, past) in enumerate(rows):
        for i in range(group.q_len):
            if i >= n:  # padding: one key, so softmax stays finite; the row is dropped
                assert mask[b, i].tolist() == [True] + [False] * 8
                continue
            q = past + i
            for j in range(9):
                assert bool(mask[b, i, j]) == (j <= q and (window is None or q - j < window)), (b, i, j)
    assert group.tokens.tolist() == list(range(12))


def test_tree_rows_see_the_cache_and_their_ancestors_only():
    """A Medusa-style chunk: root, two children of the root, a grandchild under the second."""
    from toolchain.engine.cpu.model import tree_tables

    parents = [-1, 0, 0, 2]
    depth, anc = tree_tables(parents)
    assert depth.tolist() == [0, 1, 1, 2]
    past = 3
    group = _Group([(0, 4, past, torch.arange(past + 4), anc), (4, 2, 1, torch.arange(3), None)])
    mask = group.mask(None)[:, 0]
    sees = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 2, 3}}
    for i, own in sees.items():
        assert mask[0, i].tolist() == [True] * past + [j in own for j in range(4)], i
    assert mask[1, 1].tolist()[:3] == [True, True, True]  # the plain row keeps its causal mask
    with pytest.raises(ValueError, match="parents must come first"):
        tree_tables([-1, 2, 0])


@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory):
    from conftest import make_hf_model

    return make_hf_model("Qwen3ForCausalLM", tmp_path_factory.mktemp("q3"), seed=3, head_dim=32)


@pytest.fixture
def copy_of(tmp_path, tmp_path_factory):
    def make(hf, tp=2, pp=1):
        out = tmp_path / "engine"
        shutil.copytree(engine_dir(tmp_path_factory, hf, tp, pp, dtype="auto"), out)
        for f in out.glob("rank*.safetensors"):
            f.write_bytes(f.read_bytes())  # break hard links before editing
        return out
    return make


def edit_config(engine, fn):
    cfg = json.loads((engine / "config.json").read_text())
    fn(cfg["pretrained_config"])
    (engine / "config.json").write_text(json.dumps(cfg))


def test_missing_q_layernorm_is_named(copy_of, qwen3_hf):
    engine = copy_of(qwen3_hf)
    path = engine / "rank1.safetensors"
    tensors = load_file(str(path))
    del tensors["transformer.layers.1.attention.q_layernorm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ToolchainError, match=r"rank1\.safetensors lacks 1 required tensor.*q_layernorm"):
        CpuEngine.load(engine)


def test_q_layernorm_replicas_must_agree(copy_of, qwen3_hf):
    engine = copy_of(qwen3_hf)
    path = engine / "rank1.safetensors"
    tensors = load_file(str(path))
    tensors["transformer.layers.0.attention.k_layernorm.weight"] += 1
    save_file(tensors, str(path))
    with pytest.raises(ToolchainError, match="k_layernorm.weight differs"):
        CpuEngine.load(engine)


@pytest.mark.parametrize("value", [[0], [], "8", [True], {"a": 1}])
def test_bad_attention_window(copy_of, qwen3_hf, value):
    engine = copy_of(qwen3_hf)
    edit_config(engine, lambda c: c.update(runtime_defaults={"max_attention_window": value}))
    with pytest.raises(ToolchainError, match="max_attention_window"):
        CpuEngine.load(engine)


def test_per_layer_windows_repeat_over_layers(copy_of, qwen3_hf):
    engine = copy_of(qwen3_hf)
    edit_config(engine, lambda c: c.update(runtime_defaults={"max_attention_window": [4, 100]}))
    dims = CpuEngine.load(engine).dims
    assert [dims.attention_window(i) for i in range(2)] == [4, 100]
    assert dims.attention_window(2) == 4


def test_modelopt_qwen_architecture_name_is_accepted(copy_of, qwen3_hf):
    engine = copy_of(qwen3_hf)
    edit_config(engine, lambda c: c.update(architecture="QWenForCausalLM"))
    loaded = CpuEngine.load(engine)
    assert loaded.dims.qk_layernorm and not loaded.dims.dense_bias
    assert loaded.forward_logits([1, 2, 3]).shape == (3, 250)
