"""Tensor- and pipeline-parallel layout of a TensorRT-LLM checkpoint
(TensorRT-LLM tensorrt_llm/models/convert_utils.py, tensorrt_llm/mapping.py).
Pure tensor functions: they run on meta tensors for planning and on real
tensors for writing, so shapes can never disagree between the two.
"""

from __future__ import annotations

import math

import torch

from toolchain.archs import moe
from toolchain.archs.layout import Layout, layout_problems, splits_tp
from toolchain.errors import ToolchainError


def rank_of(pp_rank: int, tp_rank: int, tp: int) -> int:
    """Rank file index with cp = 1: the TP index varies fastest (TensorRT-LLM tensorrt_llm/mapping.py)."""
    return pp_rank * tp + tp_rank


def kv_heads_per_rank(nkv: int, tp: int) -> int:
    """KV heads each rank holds; one (duplicated) head when tp > nkv (convert_utils.py, dup_kv_weight)."""
    return max(1, nkv // tp)


def padded_vocab(vocab: int, tp: int) -> int:
    """Vp = ceil(V/T)*T (TensorRT-LLM tensorrt_llm/_utils.py, pad_vocab_size)."""
    return math.ceil(vocab / tp) * tp


def pp_layers(num_layers: int, pp: int) -> list[list[int]]:
    """Global layer indices per stage, as lists (archs/layout.py Layout.stage_layers: Mapping.pp_layers)."""
    return [list(stage) for stage in Layout(pp=pp).stage_layers(num_layers)]


def check_parallelism(params, layout: Layout) -> None:
    """The divisibility rules TensorRT-LLM asserts (archs/layout.py layout_problems), checked before any weight is
    read; the first one broken is refused with the fix for its setting."""
    problems = layout_problems(params, layout)
    if not problems:
        return
    axis, text = problems[0]
    if axis == "moe":
        raise ToolchainError(text, moe.fitting_sizes(params, layout.tp))
    if axis == "tp":
        ok = [t for t in range(1, max(layout.tp, params.num_attention_heads) + 1) if splits_tp(params, layout, t)]
        raise ToolchainError(text, f"use parallelism.tp {_or_list(ok)}")
    if axis == "pp":
        raise ToolchainError(text, f"use parallelism.pp <= {params.num_hidden_layers}")
    raise ToolchainError(text)


def split_experts(experts: list[torch.Tensor], tp: int, moe_tp: int, moe_ep: int, dim: int) -> list[list[torch.Tensor]]:
    """Per TP rank, the slices it holds of its experts: the contiguous experts of its moe_ep rank
    (Mapping.ep_experts), each cut to its moe_tp slice along `dim` (convert.py's split(w, moe_tp_size,
    moe_tp_rank, dim) on the stacked tensor, here before stacking so no rank stacks experts it does not hold)."""
    out = []
    for r in range(tp):
        slot = moe.moe_tp_rank(r, moe_ep)
        out.append([experts[e].chunk(moe_tp, dim=dim)[slot] for e in moe.rank_experts(len(experts), moe_ep, r)])
    return out


def split_stacked_experts(t: torch.Tensor, fc: bool, tp: int, moe_tp: int, moe_ep: int) -> list[torch.Tensor]:
    """A layer's experts held in one HF tensor, (in, out) per expert as transformers' Llama4TextExperts holds them
    (gate_up_proj [E, H, 2I], `gate, up = gate_up.chunk(2, dim=-1)`; down_proj [E, I, H]), as each rank's stacked
    fc [E_r, 2 I/moe_tp, H] = [up; gate] per expert (w3 the linear half, w1 the activated one, as EXPERT_FC rows
    are written) or proj [E_r, H, I/moe_tp]."""
    experts = t.transpose(1, 2)  # [E, out, in]
    if not fc:
        return [torch.stack(r) for r in split_experts(list(experts), tp, moe_tp, moe_ep, dim=1)]
    gate, up = experts.chunk(2, dim=1)
    w3 = split_experts(list(up), tp, moe_tp, moe_ep, dim=0)
    w1 = split_experts(list(gate), tp, moe_tp, moe_ep, dim=0)
    return [torch.stack([torch.cat([a, b]) for a, b in zip(w3_r, w1_r, strict=True)])
            for w3_r, w1_r in zip(w3, w1, strict=True)]


def _or_list(values: list[int]) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    # (heads*hd, ...) -> (heads, hd, ...): weights and biases split the same way.
    return t.reshape(heads, t.shape[0] // heads, *t.shape[1:])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def split_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, nh: int, nkv: int, tp: int) -> list[torch.Tensor]:
    """Per rank [q_r; k_r; v_r] along dim 0, split per head (convert_utils.py). When tp > nkv
    each KV head is repeated tp/nkv times: rank r gets head r // (tp/nkv).

    Works on any tensor whose dim 0 runs over the projections' output rows, so
    the same call shards weights (out, in), biases (out,), and the quantized
    formats' per-channel (out,) and per-group (out, in/g) scales: a duplicated
    KV head carries its bias and scales along (TensorRT-LLM issue #2200). This is
    the hook the quantization formats use; a per-tensor scale (1,) has no rows
    and is replicated instead (FP8 also needs q/k/v to share it: FP8Linear)."""
    qh = _heads(q, nh).chunk(tp, dim=0)
    kh, vh = _heads(k, nkv), _heads(v, nkv)
    out = []
    for r in range(tp):
        if nkv >= tp:
            per = nkv // tp
            k_r, v_r = kh[r * per:(r + 1) * per], vh[r * per:(r + 1) * per]
        else:
            head = r // (tp // nkv)
            k_r, v_r = kh[head:head + 1], vh[head:head + 1]
        out.append(torch.cat([_flat(qh[r]), _flat(k_r), _flat(v_r)], dim=0))
    return out


def unfuse_qkv(t: torch.Tensor, *, nh: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused [q; k; v] tensor (HF Phi-3 qkv_proj, rows nh*hd + 2*nkv*hd) as its q, k and v rows:
    HF Phi3Attention slices its output that way (query, then key, then value)."""
    hd = t.shape[0] // (nh + 2 * nkv)
    q, k, v = t.split([nh * hd, nkv * hd, nkv * hd], dim=0)
    return q, k, v


def split_fused_qkv(t: torch.Tensor, *, nh: int, nkv: int, tp: int) -> list[torch.Tensor]:
    """A fused [q; k; v] tensor laid out per rank exactly like separate q/k/v rows (split_qkv): what
    TensorRT-LLM's Phi-3 converter writes (tensorrt_llm/models/phi3/split_weights.py split_weights_tp:
    q, k and v each split over tp and concatenated per rank; k/v heads duplicated when tp > nkv here too)."""
    return split_qkv(*unfuse_qkv(t, nh=nh, nkv=nkv), nh=nh, nkv=nkv, tp=tp)


def gated_halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Phi-3 gate_up_proj [gate; up] (Phi3MLP: `gate, up_states = ....chunk(2, dim=-1)`) as (up, gate),
    the order TensorRT-LLM's swiglu fc holds them (convert.py swaps the halves; swiglu computes
    silu(second half) * first half: tensorrt_llm/functional.py)."""
    gate, up = t.chunk(2, dim=0)
    return up, gate


def split_gated_fc(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Per rank [up_r; gate_r]: each half split over tp, so every rank's swiglu pairs an up row with its
    own gate row. At tp 1 this is convert.py's swapped tensor. Open point: TensorRT-LLM's Phi-3
    split_weights_tp cuts the fused [up; gate] contiguously (split_matrix_tp dim 0), which at tp > 1
    hands one rank only up rows; its MoE branch splits w3 and w1 separately and concatenates, as here."""
    up, gate = gated_halves(t)
    return [torch.cat([u, g], dim=0) for u, g in zip(split_column(up, tp), split_column(gate, tp), strict=True)]


def split_column(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Column-parallel: output features (dim 0) split evenly; biases likewise."""
    return list(t.chunk(tp, dim=0)) if tp > 1 else [t]


def split_row(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Row-parallel: input features (dim 1) of an (out, in) weight split evenly."""
    return list(t.chunk(tp, dim=1)) if tp > 1 else [t]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Append zero rows up to `rows` (cat rather than F.pad so meta tensors work)."""
    extra = rows - t.shape[0]
    if extra <= 0:
        return t
    return torch.cat([t, torch.zeros((extra, *t.shape[1:]), dtype=t.dtype, device=t.device)], dim=0)


def split_vocab(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """lm_head: pad V to a multiple of tp with zero rows, then split dim 0 (pad_vocab_size).
    The config keeps the unpadded vocab_size; the runtime slices the logits."""
    return split_column(pad_rows(t, padded_vocab(t.shape[0], tp)), tp)


def split_embedding(t: torch.Tensor, tp: int, *, parallel: bool, dim: int) -> list[torch.Tensor]:
    """Vocab embedding: the full table on every rank unless use_parallel_embedding;
    then dim 0 pads and splits the vocab like lm_head, dim 1 splits the hidden size.
    Open point: the golden layouts only cover V divisible by T, so the zero-row padding
    of a sharded embedding rests on tensorrt_llm/layers/embedding.py alone."""
    if not parallel or tp == 1:
        return [t] * tp
    if dim == 0:
        return split_vocab(t, tp)
    return list(t.chunk(tp, dim=1))
