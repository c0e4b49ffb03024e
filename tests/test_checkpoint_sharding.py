"""The sharding functions on synthetic tensors: pipeline layer assignment,
rank numbering, and q/k/v splitting of any per-row tensor (weights, biases,
and the per-channel / per-group scales quantized formats add)."""

from __future__ import annotations

import pytest
import torch

from toolchain.checkpoint import sharding


@pytest.mark.parametrize("layers,pp,want", [
    (2, 2, [[0], [1]]),
    (3, 2, [[0, 1], [2]]),
    (5, 4, [[0, 1], [2], [3], [4]]),
    (80, 2, [list(range(40)), list(range(40, 80))]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
])
def test_pp_layers_follow_tensor_split(layers, pp, want):
    # TensorRT-LLM 1.x Mapping.pp_layers: torch.tensor_split, first L % P stages one layer longer.
    assert sharding.pp_layers(layers, pp) == want


def test_rank_numbering_tp_fastest():
    assert [sharding.rank_of(p, t, 4) for p in range(2) for t in range(4)] == list(range(8))
    assert sharding.rank_of(1, 0, 4) == 4


def _rows(heads: int, hd: int, width: int, base: float) -> torch.Tensor:
    # Row i of head h holds base + h: each rank's heads are recognisable.
    return (base + torch.arange(heads).repeat_interleave(hd)).float()[:, None].expand(heads * hd, width).clone()


@pytest.mark.parametrize("width", [1, 3, 16])  # per-channel scale, per-group scale (in/g), weight
@pytest.mark.parametrize("nkv,tp", [(2, 4), (1, 4), (4, 2), (2, 2)])
def test_split_qkv_duplicates_kv_rows_of_any_per_row_tensor(width, nkv, tp):
    nh, hd = 4, 8
    q, k, v = _rows(nh, hd, width, 0), _rows(nkv, hd, width, 100), _rows(nkv, hd, width, 200)
    pieces = sharding.split_qkv(q, k, v, nh=nh, nkv=nkv, tp=tp)
    kv_r = max(1, nkv // tp)
    for r, piece in enumerate(pieces):
        assert piece.shape == ((nh // tp + 2 * kv_r) * hd, width)
        heads = piece[::hd, 0].tolist()
        q_heads = list(range(r * nh // tp, (r + 1) * nh // tp))
        kv_heads = list(range(r * kv_r, (r + 1) * kv_r)) if nkv >= tp else [r // (tp // nkv)]
        assert heads == q_heads + [100 + h for h in kv_heads] + [200 + h for h in kv_heads]
    # A 1-D tensor (bias, per-channel scale) splits the same way as its weight's rows.
    flat = sharding.split_qkv(q[:, 0], k[:, 0], v[:, 0], nh=nh, nkv=nkv, tp=tp)
    assert all(torch.equal(f, p[:, 0]) for f, p in zip(flat, pieces))


def test_vocab_padding_and_embedding_dims():
    t = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    lm = sharding.split_vocab(t, 4)
    assert [p.shape[0] for p in lm] == [3, 3, 3, 3] and not lm[3][1:].any()
    assert sharding.padded_vocab(250, 4) == 252 and sharding.padded_vocab(256, 4) == 256
    assert all(p is t for p in sharding.split_embedding(t, 2, parallel=False, dim=0))
    assert [p.shape for p in sharding.split_embedding(t, 2, parallel=True, dim=1)] == [(10, 2), (10, 2)]
