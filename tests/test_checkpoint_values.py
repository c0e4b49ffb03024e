"""Numerical content of converted rank files against the HF weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_hf_llama
from toolchain.checkpoint.convert import convert_checkpoint

HD = 16  # head size of the conftest model: 64 hidden / 4 heads


def hf_weights(hf: Path) -> dict[str, torch.Tensor]:
    return load_file(str(hf / "model.safetensors"))


def convert(hf: Path, out: Path, **kw) -> list[dict[str, torch.Tensor]]:
    out.mkdir()
    config = convert_checkpoint(hf, out, **kw)
    world = config["mapping"]["world_size"]
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(world)]


def heads(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return torch.cat([t[h * HD:(h + 1) * HD] for h in idx], dim=0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_rank_holds_its_heads(hf_llama, tmp_path, tp):
    # 4 query heads, 2 KV heads: at tp 4 every KV head is duplicated on two ranks.
    hf = hf_weights(hf_llama)
    ranks = convert(hf_llama, tmp_path / "ck", tp=tp, pp=1, dtype="float32")
    nh, nkv = 4, 2
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        for r, rank in enumerate(ranks):
            q_idx = list(range(r * nh // tp, (r + 1) * nh // tp))
            kv_idx = list(range(r * nkv // tp, (r + 1) * nkv // tp)) if nkv >= tp else [r // (tp // nkv)]
            want = torch.cat([heads(hf[p + "q_proj.weight"], q_idx), heads(hf[p + "k_proj.weight"], kv_idx),
                              heads(hf[p + "v_proj.weight"], kv_idx)])
            assert torch.equal(rank[f"transformer.layers.{layer}.attention.qkv.weight"], want), (layer, r)


def test_qkv_bias_duplicated_with_kv_heads(tmp_path):
    src = make_hf_llama(tmp_path / "hf", attention_bias=True, mlp_bias=True)
    with torch.no_grad():  # HF initialises biases to zero; make them distinguishable
        w = hf_weights(src)
        for name in w:
            if name.endswith(".bias"):
                w[name] = torch.randn_like(w[name])
        save_file(w, str(src / "model.safetensors"), metadata={"format": "pt"})
    ranks = convert(src, tmp_path / "ck", tp=4, pp=1, dtype="float32")
    p = "model.layers.0."
    for r, rank in enumerate(ranks):
        kv = [r // 2]
        want = torch.cat([heads(w[p + "self_attn.q_proj.bias"], [r]), heads(w[p + "self_attn.k_proj.bias"], kv),
                          heads(w[p + "self_attn.v_proj.bias"], kv)])
        assert torch.equal(rank["transformer.layers.0.attention.qkv.bias"], want)
        # Row-parallel biases are whole on every rank; column-parallel ones split.
        assert torch.equal(rank["transformer.layers.0.attention.dense.bias"], w[p + "self_attn.o_proj.bias"])
        assert torch.equal(rank["transformer.layers.0.mlp.proj.bias"], w[p + "mlp.down_proj.bias"])
        assert torch.equal(rank["transformer.layers.0.mlp.fc.bias"], w[p + "mlp.gate_proj.bias"].chunk(4)[r])


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_shards_concatenate_to_hf(hf_llama, tmp_path, tp):
    hf = hf_weights(hf_llama)
    ranks = convert(hf_llama, tmp_path / "ck", tp=tp, pp=1, dtype="float32")
    for layer in range(2):
        t, h = f"transformer.layers.{layer}.", f"model.layers.{layer}."
        cat0 = lambda n: torch.cat([r[t + n] for r in ranks], dim=0)  # noqa: E731
        cat1 = lambda n: torch.cat([r[t + n] for r in ranks], dim=1)  # noqa: E731
        # Naming trap: fc is gate_proj, gate is up_proj.
        assert torch.equal(cat0("mlp.fc.weight"), hf[h + "mlp.gate_proj.weight"])
        assert torch.equal(cat0("mlp.gate.weight"), hf[h + "mlp.up_proj.weight"])
        assert torch.equal(cat1("mlp.proj.weight"), hf[h + "mlp.down_proj.weight"])
        assert torch.equal(cat1("attention.dense.weight"), hf[h + "self_attn.o_proj.weight"])
        for r in ranks:
            assert torch.equal(r[t + "input_layernorm.weight"], hf[h + "input_layernorm.weight"])
            assert torch.equal(r[t + "post_layernorm.weight"], hf[h + "post_attention_layernorm.weight"])
    for r in ranks:
        assert torch.equal(r["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(r["transformer.ln_f.weight"], hf["model.norm.weight"])


def test_lm_head_padded_rows_are_zero(hf_llama, tmp_path):
    hf = hf_weights(hf_llama)
    ranks = convert(hf_llama, tmp_path / "ck", tp=4, pp=1, dtype="float32")
    lm = torch.cat([r["lm_head.weight"] for r in ranks])
    assert lm.shape == (252, 64)
    assert torch.equal(lm[:250], hf["lm_head.weight"])
    assert not lm[250:].any()


@pytest.mark.parametrize("tp", [2, 4])
def test_tied_lm_head_equals_embedding(hf_llama_tied, tmp_path, tp):
    hf = hf_weights(hf_llama_tied)
    assert "lm_head.weight" not in hf
    ranks = convert(hf_llama_tied, tmp_path / "ck", tp=tp, pp=1, dtype="float32")
    lm = torch.cat([r["lm_head.weight"] for r in ranks])
    assert torch.equal(lm[:250], hf["model.embed_tokens.weight"])
    assert not lm[250:].any()


def test_parallel_embedding_shards_reassemble(hf_llama, tmp_path):
    emb = hf_weights(hf_llama)["model.embed_tokens.weight"]
    dim0 = convert(hf_llama, tmp_path / "d0", tp=4, pp=1, dtype="float32", use_parallel_embedding=True)
    full = torch.cat([r["transformer.vocab_embedding.weight"] for r in dim0])
    assert torch.equal(full[:250], emb) and not full[250:].any()
    dim1 = convert(hf_llama, tmp_path / "d1", tp=4, pp=1, dtype="float32", use_parallel_embedding=True,
                   embedding_sharding_dim=1)
    assert torch.equal(torch.cat([r["transformer.vocab_embedding.weight"] for r in dim1], dim=1), emb)


def test_pipeline_stages_renumber_layers(tmp_path):
    src = make_hf_llama(tmp_path / "hf", num_hidden_layers=3)
    hf = hf_weights(src)
    ranks = convert(src, tmp_path / "ck", tp=2, pp=2, dtype="float32")
    # tensor_split(range(3), 2) -> stage 0: layers 0, 1; stage 1: layer 2 as local 0. rank = pp*tp + tp_rank.
    for tp_rank in range(2):
        stage1 = ranks[2 + tp_rank]
        want = hf["model.layers.2.mlp.gate_proj.weight"].chunk(2)[tp_rank]
        assert torch.equal(stage1["transformer.layers.0.mlp.fc.weight"], want)
        stage0 = ranks[tp_rank]
        want = hf["model.layers.1.mlp.gate_proj.weight"].chunk(2)[tp_rank]
        assert torch.equal(stage0["transformer.layers.1.mlp.fc.weight"], want)
        assert "lm_head.weight" in stage1 and "lm_head.weight" not in stage0
        assert "transformer.vocab_embedding.weight" in stage0 and "transformer.vocab_embedding.weight" not in stage1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_matches_torch(hf_llama, tmp_path, dtype):
    hf = hf_weights(hf_llama)
    ranks = convert(hf_llama, tmp_path / "ck", tp=1, pp=1, dtype=dtype)
    target = getattr(torch, dtype)
    assert torch.equal(ranks[0]["lm_head.weight"], hf["lm_head.weight"].to(target))
    assert torch.equal(ranks[0]["transformer.layers.1.mlp.proj.weight"],
                       hf["model.layers.1.mlp.down_proj.weight"].to(target))


def test_sharded_hf_checkpoint_with_index(hf_llama, tmp_path):
    """A model.safetensors.index.json split over two shards converts to the same bytes."""
    src = tmp_path / "sharded"
    src.mkdir()
    (src / "config.json").write_text((hf_llama / "config.json").read_text())
    w = hf_weights(hf_llama)
    names = sorted(w)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: w[n] for n in part}, str(src / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = convert(hf_llama, tmp_path / "a", tp=2, pp=1, dtype="float32")
    b = convert(src, tmp_path / "b", tp=2, pp=1, dtype="float32")
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
