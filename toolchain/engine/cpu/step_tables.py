"""A step's index tensors built for the whole batch at once, never request by request.

A decode step at batch 16 ran ~60 small tensor operations per request just to find where each
request's keys sit in the pool (`KvCacheManager.slots` per chunk, then a row of the padded slot
matrix each); on a 2-core host every operation costs a few microseconds of dispatch whatever its
size. Here the block tables of a group of requests become one padded [B, blocks] tensor and the
slot matrix [B, keys] comes from it in a handful of operations. The values are exactly those of
the per-request path: position p of a request sits at slot blocks[p // tpb] * tpb + p % tpb, and
padding beyond a request's length reads slot 0 (masked out by the attention mask).
"""

from __future__ import annotations

import torch


def slot_matrix(blocks: list[list[int]], lengths: list[int], tokens_per_block: int) -> torch.Tensor:
    """[B, max(lengths)] int64: the pool slot of each request's positions 0 .. length - 1, 0 beyond."""
    keys = max(lengths)
    width = -(-keys // tokens_per_block)
    # Only the blocks the longest request's keys reach; shorter tables are padded with block 0.
    table = torch.tensor([b[:width] + [0] * (width - len(b[:width])) for b in blocks], dtype=torch.int64)
    key = torch.arange(keys)
    slots = table[:, key // tokens_per_block] * tokens_per_block + key % tokens_per_block
    return slots.masked_fill_(key[None, :] >= torch.tensor(lengths)[:, None], 0)


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the float one SDPA turns it into on every call
    (torch.nn.functional.scaled_dot_product_attention: 0 where attended, -inf elsewhere), made
    once per step instead of once per layer; the attention's result is the same."""
    return torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
