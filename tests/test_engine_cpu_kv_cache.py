"""The paged KV cache's bookkeeping, on its own: pool sizing (the planner's function),
prefix matching by block hash, reference counts, LRU eviction, and the per-request
block counts the backend reports."""

from __future__ import annotations

import pytest

from toolchain.engine.cpu.config import parse_dims
from toolchain.engine.cpu.kv_cache import BlockTable, KvCacheConfig, KvCacheManager, kv_bytes_per_token
from toolchain.errors import ToolchainError
from toolchain.plan.memory import kv_pool_tokens

TPB = 4
DIMS = parse_dims({"architecture": "LlamaForCausalLM", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "hidden_act": "silu",
                   "mapping": {"tp_size": 2, "pp_size": 1, "world_size": 2}}, "test")


def manager(blocks: int = 8, reuse: bool = True) -> KvCacheManager:
    return KvCacheManager(DIMS, blocks, TPB, reuse)


def run(kv: KvCacheManager, tokens: list[int]) -> BlockTable:
    """Add a sequence and mark all of `tokens` as computed (as a finished forward would)."""
    table = BlockTable()
    kv.add_sequence(table, tokens)
    kv.commit(table, tokens, len(tokens))
    return table


def test_bytes_per_token_counts_every_layer_and_rank():
    # 2 (K, V) x 2 layers x 2 ranks x 1 KV head per rank x 8 head size x 4 bytes
    assert kv_bytes_per_token(DIMS) == 2 * 2 * 2 * 1 * 8 * 4 == manager().bytes_per_token


def test_pool_size_is_the_smaller_limit_in_whole_blocks():
    per_token = kv_bytes_per_token(DIMS)
    free = 1000 * per_token
    assert kv_pool_tokens(free, 0.5, per_token, TPB) == 500
    assert kv_pool_tokens(free, 0.5, per_token, TPB, max_tokens=30) == 32  # rounded up to a block
    assert kv_pool_tokens(free, 0.5, per_token, TPB, max_tokens=10_000) == 500
    kv = KvCacheManager.create(DIMS, KvCacheConfig(tokens_per_block=TPB, free_memory_fraction=0.5), free_bytes=free)
    assert kv.capacity_tokens == 500 and kv.free_blocks == 125
    with pytest.raises(ToolchainError, match="must be in"):
        KvCacheManager.create(DIMS, KvCacheConfig(tokens_per_block=TPB, free_memory_fraction=1.0), free_bytes=free)


def test_prefix_blocks_are_reused_but_never_the_last_tokens_block():
    kv = manager()
    a = run(kv, list(range(10)))  # blocks [0-3] [4-7] [8-9]
    assert (a.reused, a.alloc_total, a.alloc_new) == (0, 3, 3)
    assert kv.match(list(range(8)) + [50, 51]) == 2
    assert kv.match(list(range(8))) == 1  # the second block holds the prompt's last token: recomputed
    assert kv.match([0, 1, 2, 99, 4, 5, 6, 7, 8]) == 0  # a difference in block 0 breaks the chain
    b = BlockTable()
    kv.add_sequence(b, list(range(8)) + [50, 51, 52])
    assert b.blocks[:2] == a.blocks[:2] and b.length == 8
    assert (b.reused, b.alloc_total) == (2, 1)
    assert kv.used_blocks == 4  # 3 of a, 1 new of b: the two shared blocks count once


def test_released_blocks_stay_matchable_and_shared_ones_survive_their_first_owner():
    kv = manager()
    a = run(kv, list(range(9)))
    b = BlockTable()
    kv.add_sequence(b, list(range(9)))
    kv.release(a)
    assert kv.used_blocks == 3  # b still holds the two shared blocks and its own third
    kv.release(b)
    assert kv.used_blocks == 0 and kv.free_blocks == 8
    c = BlockTable()
    kv.add_sequence(c, list(range(9)))
    assert c.reused == 2 and c.alloc_new == 0  # its one fresh block was used before


def test_least_recently_released_blocks_are_evicted_first():
    kv = manager(blocks=6)
    old = run(kv, [1] * 4 + [2] * 4 + [3])  # 3 blocks, 2 of them registered
    new = run(kv, [7] * 4 + [8] * 4 + [9])
    kv.release(old)
    kv.release(new)
    assert kv.match([1] * 4 + [2] * 4 + [3]) == 2 and kv.match([7] * 4 + [8] * 4 + [9]) == 2
    # 6 free blocks: 2 never-registered go first, then the oldest release's cached blocks.
    filler = BlockTable()
    kv.add_sequence(filler, [60 + i for i in range(16)])
    assert kv.match([7] * 4 + [8] * 4 + [9]) == 2, "the recently released prefix must survive"
    assert kv.match([1] * 4 + [2] * 4 + [3]) == 0, "the least recently released prefix is evicted"


def test_forgetting_cached_blocks_leaves_held_ones_matchable():
    kv = manager(blocks=6)
    held = run(kv, [1] * 4 + [2] * 4 + [3])
    released = run(kv, [7] * 4 + [8] * 4 + [9])
    kv.release(released)
    assert kv.forget_cached() == 3  # its two full blocks and its partly filled last one
    assert kv.match([7] * 4 + [8] * 4 + [9]) == 0 and kv.match([1] * 4 + [2] * 4 + [3]) == 2
    assert kv.free_blocks == 3 and kv.forget_cached() == 0
    kv.release(held)


def test_reuse_off_never_matches():
    kv = manager(reuse=False)
    run(kv, list(range(10)))
    assert kv.match(list(range(10))) == 0


def test_exhausted_pool_refuses_instead_of_overwriting():
    kv = manager(blocks=2)
    run(kv, list(range(8)))
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.add_sequence(BlockTable(), [90, 91])
    assert kv.blocks_to_add([90, 91]) == 1 and kv.free_blocks == 0


def _fill(kv: KvCacheManager, table: BlockTable, start: int, stop: int) -> None:
    """Write recognisable K/V (the position's token value) into table's positions [start, stop)."""
    slots = kv.slots(table, start, stop)
    for i, slot in enumerate(slots.tolist()):
        kv.k[:, :, slot] = float(start + i + 1)
        kv.v[:, :, slot] = -float(start + i + 1)


def test_partial_reuse_copies_the_shared_leading_tokens_of_a_block():
    """TensorRT-LLM's enable_partial_reuse / copy_on_partial_reuse (both default on): after the full
    blocks, the longest run of tokens a registered block shares with the request is copied into a
    fresh block; the source block stays as it was."""
    kv = manager(blocks=8)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # two full blocks and a tail of two
    table = BlockTable()
    kv.add_sequence(table, first)
    _fill(kv, table, 0, len(first))
    kv.commit(table, first, len(first))
    source_tail = table.blocks[2]
    kv.release(table)
    # The same sequence plus new tokens (the BLS's next step): only the new ones are computed.
    again = first + [11, 12]
    assert kv.match(again) == 2 and kv.matched_tokens(again) == 10
    t2 = BlockTable()
    kv.add_sequence(t2, again)
    assert t2.length == 10 and t2.blocks[2] != source_tail and t2.reused == 2
    assert kv.k[0, 0, kv.slots(t2, 8, 10), 0, 0].tolist() == [9.0, 10.0]
    assert kv.v[0, 0, kv.slots(t2, 8, 10), 0, 0].tolist() == [-9.0, -10.0]
    kv.release(t2)
    # A full block shares only its first tokens with this request: those two are taken.
    diverging = [1, 2, 3, 4, 5, 6, 99, 98, 97]
    assert kv.matched_tokens(diverging) == 6
    # Never the prompt's last token, even when a registered tail holds it.
    assert kv.matched_tokens(first[:9]) == 8
    assert kv.matched_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 9
    # forget_cached drops the partial registrations too.
    kv.forget_cached()
    assert kv.matched_tokens(again) == 0


def test_partial_reuse_is_off_with_block_reuse():
    kv = manager(reuse=False)
    table = run(kv, [1, 2, 3, 4, 5, 6])
    kv.release(table)
    assert kv.matched_tokens([1, 2, 3, 4, 5, 6, 7]) == 0
