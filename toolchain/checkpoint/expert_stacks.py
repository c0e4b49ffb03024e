"""Experts stored as one tensor per layer (gpt-oss), cut into the per-rank stacks every mixture-of-experts
checkpoint here holds: `mlp.fc` [E/moe_ep, 2 I/moe_tp, H] as [up; gate] per expert (the linear half first, as
EXPERT_FC's [w3; w1]) and `mlp.proj` [E/moe_ep, H, I/moe_tp], rank r holding the contiguous experts of its
moe_ep rank and slice r // moe_ep of their width (archs/moe.py rank_experts, moe_tp_rank).

transformers' GptOssExperts (models/gpt_oss/modeling_gpt_oss.py) keeps them the other way round, as the
right-hand side of `x @ W`: gate_up_proj [E, H, 2I] with gate in the even and up in the odd columns
(`_apply_gate`: `gate, up = gate_up[..., ::2], gate_up[..., 1::2]`), gate_up_proj_bias [E, 2I] alike, down_proj
[E, I, H] and down_proj_bias [E, H]. TensorRT-LLM's PyTorch backend de-interleaves them the same way at load
(_torch/models/modeling_gpt_oss.py load_hf_weights: `gate_up_weight[:, :, ::2], gate_up_weight[:, :, 1::2]`).
Pure tensor functions: they run on meta tensors for the plan and on real ones for the writer.
"""

from __future__ import annotations

import torch

from toolchain.archs import moe


def _rank_slices(num_experts: int, tp: int, moe_ep: int) -> list[tuple[slice, int]]:
    """Per TP rank: its experts (as a slice of dim 0) and which moe_tp slice of their width it holds."""
    out = []
    for r in range(tp):
        experts = moe.rank_experts(num_experts, moe_ep, r)
        out.append((slice(experts.start, experts.stop), moe.moe_tp_rank(r, moe_ep)))
    return out


def split_gate_up(t: torch.Tensor, tp: int, moe_tp: int, moe_ep: int) -> list[torch.Tensor]:
    """gate_up_proj [E, H, 2I] (or its bias [E, 2I]) as each rank's fc [E_r, 2 I_r, H] (bias [E_r, 2 I_r]) of
    [up_r; gate_r] per expert."""
    rows = t.transpose(1, 2) if t.dim() == 3 else t  # [E, 2I, H]: one row per output feature
    gate, up = rows[:, 0::2], rows[:, 1::2]
    out = []
    for experts, slot in _rank_slices(t.shape[0], tp, moe_ep):
        u, g = up[experts].chunk(moe_tp, dim=1)[slot], gate[experts].chunk(moe_tp, dim=1)[slot]
        out.append(torch.cat([u, g], dim=1).contiguous())
    return out


def split_down(t: torch.Tensor, tp: int, moe_tp: int, moe_ep: int) -> list[torch.Tensor]:
    """down_proj [E, I, H] as each rank's proj [E_r, H, I_r]; its bias [E, H] as [E_r, H], whole on every moe_tp
    rank (the engine adds it once per expert, engine/cpu/moe.py)."""
    if t.dim() == 2:
        return [t[experts].contiguous() for experts, _ in _rank_slices(t.shape[0], tp, moe_ep)]
    cols = t.transpose(1, 2)  # [E, H, I]
    return [cols[experts].chunk(moe_tp, dim=2)[slot].contiguous() for experts, slot in _rank_slices(t.shape[0], tp, moe_ep)]


def split_gate_up_rows(t: torch.Tensor, tp: int, moe_tp: int, moe_ep: int) -> list[torch.Tensor]:
    """gate_up_proj's MXFP4 blocks [E, 2I, H/32, 16] (or scales [E, 2I, H/32]), already one row per output with gate
    in the even and up in the odd rows (TensorRT-LLM's loader: `gate_up_weight[:, ::2, :], gate_up_weight[:, 1::2,
    :]`, notes/i35-facts.md section 6.3), as each rank's fc [E_r, 2 I_r, H/2] (scales [E_r, 2 I_r, H/32]) of
    [up_r; gate_r] per expert; the blocks flattened to bytes as that loader does (`flatten(-2, -1)`)."""
    gate, up = t[:, 0::2], t[:, 1::2]
    out = []
    for experts, slot in _rank_slices(t.shape[0], tp, moe_ep):
        u, g = up[experts].chunk(moe_tp, dim=1)[slot], gate[experts].chunk(moe_tp, dim=1)[slot]
        out.append(torch.cat([u, g], dim=1).flatten(2).contiguous())
    return out


def split_down_rows(t: torch.Tensor, tp: int, moe_tp: int, moe_ep: int) -> list[torch.Tensor]:
    """down_proj's MXFP4 blocks [E, H, I/32, 16] (or scales [E, H, I/32]) as each rank's proj [E_r, H, I_r/2]
    (scales [E_r, H, I_r/32]): the expert width cut over moe_tp in whole blocks of 32 (archs/moe.py block_problem
    refuses a width that is not)."""
    return [t[experts].chunk(moe_tp, dim=2)[slot].flatten(2).contiguous()
            for experts, slot in _rank_slices(t.shape[0], tp, moe_ep)]
