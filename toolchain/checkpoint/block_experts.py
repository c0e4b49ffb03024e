"""Mixture-of-experts stacks in FP8 block scales, imported as a DeepSeek-V3 checkpoint stores them.

Each expert of the HF checkpoint is its own linears (model.layers.N.mlp.experts.E.{gate,up,down}_proj), each an e4m3
weight with its float32 `weight_scale_inv` grid of 128x128 tiles (notes i35-facts §4.2: amax / 448 per tile, the
dequant multiplier FP8BlockScalesLinearMethod reads). The engine checkpoint stacks a rank's experts as every MoE
family's do (checkpoint/sharding.py split_experts: the experts over moe_ep, each expert's width over moe_tp): weight
[experts, out, in] e4m3 and weights_scaling_factor [experts, ceil(out/128), ceil(in/128)] float32, fc's [w3_e; w1_e]
with their grids concatenated along the rows, as TensorRT-LLM's fused gate/up loaders concatenate each part's grid.
So a cut must fall between tiles: each part's width per moe_tp rank is whole tiles (always for fc, whose parts are
concatenated; for proj only where moe_tp cuts it). Nothing is computed: the tiles are the checkpoint's own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from toolchain.archs.common import Shard
from toolchain.checkpoint import sharding
from toolchain.checkpoint.hf_quant import stored_linear
from toolchain.checkpoint.layout import stage_ranks
from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.quant.fp8 import FP8_DTYPE

SUFFIXES = {"weight": FP8_DTYPE, "weights_scaling_factor": torch.float32}


def stored_block_experts(prefix: str, output: Any, sources: tuple[str, ...], read: Callable[[str], torch.Tensor],
                         has: Callable[[str], bool], fmt: formats.Format, tp: int, mapping: Any
                         ) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """rank -> [(name, tensor)] of one stacked expert linear (`output`, a layout.Output of an EXPERT_FC or EXPERT_PROJ
    row) from its HF `sources` (every w3 then every w1 for fc, as layout.build_groups orders them)."""
    tile = fmt.tile or 1
    fc = output.row.shard is Shard.EXPERT_FC
    parts = [stored_linear(read, has, s.removesuffix(".weight"), str(fmt.quant_algo)) for s in sources]
    count = len(parts) // 2 if fc else len(parts)
    moe_tp, moe_ep = mapping.moe_tp, mapping.moe_ep
    width = parts[0]["weight"].shape[0 if fc else 1]
    if (fc or moe_tp > 1) and width % (moe_tp * tile):
        raise ToolchainError(f"{output.name}: the expert width {width} per moe_tp rank ({width} / moe_tp {moe_tp}) is "
                             f"not whole {tile}x{tile} tiles of the FP8 block scales",
                             "use a larger parallelism.moe_ep (a smaller moe_tp), or convert the unquantized model")
    out: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for suffix, dtype in SUFFIXES.items():
        if fc:  # a rank's fc is [w3_e; w1_e] of each of its experts, both cut along the expert width
            w3 = sharding.split_experts([p[suffix] for p in parts[:count]], tp, moe_tp, moe_ep, dim=0)
            w1 = sharding.split_experts([p[suffix] for p in parts[count:]], tp, moe_tp, moe_ep, dim=0)
            pieces = [torch.stack([torch.cat([a, b]) for a, b in zip(r3, r1, strict=True)])
                      for r3, r1 in zip(w3, w1, strict=True)]
        else:  # w2: its input, the expert width, is what moe_tp cuts
            pieces = [torch.stack(r) for r in sharding.split_experts([p[suffix] for p in parts], tp, moe_tp, moe_ep,
                                                                     dim=1)]
        for rank, piece in zip(stage_ranks(output.stage, tp), pieces, strict=True):
            out.setdefault(rank, []).append((f"{prefix}.{suffix}", piece.to(dtype).contiguous()))
    return out
