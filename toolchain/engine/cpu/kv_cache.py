"""The paged KV cache: one pool of fixed-size blocks shared by every request.

Mirrors TensorRT-LLM's KV cache manager (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp):

* The pool holds `num_blocks` blocks of `tokens_per_block` tokens for every layer
  and TP rank. Its size is the smaller of `max_tokens` and what
  `free_memory_fraction` of the memory left after the weights holds
  (`kv_pool_tokens`, shared with the planner so both state the same capacity).
* A request gets the blocks of its whole prompt when its context starts, and one
  more block whenever decoding crosses a block boundary; its block table maps
  positions to pool slots.
* With block reuse, every block a request fills is registered under a hash of
  its tokens and of everything before it. A later request whose prompt starts
  with the same tokens takes those blocks instead of computing them (never the
  block holding the prompt's last token: its logits are needed). Released
  blocks keep their contents and hash until the pool needs them; the least
  recently released goes first.
* Per request it counts what the backend reports with `return_perf_metrics`:
  blocks matched by prefix (reused), blocks taken from the pool for its context
  (total) and of those the ones that had never held data (new).

Storage: per layer and TP rank, K and V as [num_blocks * tokens_per_block,
kv_heads, head_size] in float32, or int8/e4m3 for an INT8/FP8 KV cache. The
tensors come from torch.empty, so memory is committed only as blocks are used.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from toolchain.engine.cpu.config import ModelDims
from toolchain.errors import ToolchainError
from toolchain.plan.memory import kv_pool_tokens
from toolchain.quant.kv_cache import storage_dtype

# kv_cache_quant_algo -> what the cache stores (TensorRT-LLM tensorrt_llm/quantization/quantize_by_modelopt.py):
# x / scale as int8 or e4m3.
KV_KINDS = {"INT8": "int8", "FP8": "fp8"}
DEFAULT_FREE_MEMORY_FRACTION = 0.9  # KvCacheConfig::kDefaultGpuMemFraction


@dataclass(frozen=True)
class KvCacheConfig:
    """The executor's KvCacheConfig, as the tensorrt_llm model parameters set it."""

    tokens_per_block: int | None = None
    """Block size; None takes the engine's (plugin_config.tokens_per_block), the only one it can run."""
    free_memory_fraction: float = DEFAULT_FREE_MEMORY_FRACTION
    """kv_cache_free_gpu_mem_fraction: share of the host memory available after loading the weights."""
    max_tokens: int | None = None
    """max_tokens_in_paged_kv_cache: a cap on the pool; the smaller limit wins."""
    enable_block_reuse: bool = True
    """enable_kv_cache_reuse."""

    def problem(self) -> str | None:
        tpb = self.tokens_per_block
        if tpb is not None and (tpb < 1 or tpb & (tpb - 1)):
            return f"tokens_per_block {self.tokens_per_block} must be a power of 2"
        if not 0 < self.free_memory_fraction < 1:
            return f"kv_cache_free_gpu_mem_fraction {self.free_memory_fraction} must be in (0, 1)"
        if self.max_tokens is not None and self.max_tokens < 1:
            return f"max_tokens_in_paged_kv_cache {self.max_tokens} must be positive"
        return None


def kv_bytes_per_token(d: ModelDims) -> int:
    """Bytes one token's keys and values take over all layers and TP ranks of this engine."""
    kind = KV_KINDS.get(d.kv_cache_quant_algo)
    width = 1 if kind else 4  # the CPU engine keeps an unquantized cache in float32
    return 2 * d.num_layers * d.tp * d.kv_heads_per_rank * d.head_size * width


def available_memory_bytes() -> int:
    """Memory the kernel could hand this process now (MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class _Block:
    __slots__ = ("index", "refs", "key", "used")

    def __init__(self, index: int):
        self.index = index
        self.refs = 0
        self.key = None  # reuse hash while the block's contents are registered
        self.used = False  # has ever held data (TRT-LLM counts "new" blocks by this)


class BlockTable:
    """One request's blocks, the tokens written through them, and its allocation counts."""

    def __init__(self):
        self.blocks: list[int] = []
        self.keys: list[int] = []  # reuse hash of each full block, in order
        self.length = 0  # tokens whose K/V are in the cache
        self.reused = 0
        self.alloc_total = 0
        self.alloc_new = 0


class KvCacheManager:
    def __init__(self, d: ModelDims, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool):
        self.d = d
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.enable_block_reuse = enable_block_reuse
        self.kind = KV_KINDS.get(d.kv_cache_quant_algo)
        dtype = storage_dtype(self.kind) if self.kind else torch.float32
        shape = (d.num_layers, d.tp, num_blocks * tokens_per_block, d.kv_heads_per_rank, d.head_size)
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Never-registered free blocks, as a stack: the most recently freed (warm) block goes out first.
        self._clean = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but registered, least recently freed first
        self._by_key: dict[int, int] = {}  # reuse hash -> block index
        self.reused_total = 0  # blocks matched by prefix since start (the `reused` gauge)

    @classmethod
    def create(cls, d: ModelDims, config: KvCacheConfig, *, free_bytes: int | None = None) -> "KvCacheManager":
        problem = config.problem() or (None if config.tokens_per_block is not None else
                                       "tokens_per_block is not set (CpuEngine.load takes the engine's)")
        if problem:
            raise ToolchainError(f"KV cache: {problem}")
        free = available_memory_bytes() if free_bytes is None else free_bytes
        tokens = kv_pool_tokens(free, config.free_memory_fraction, kv_bytes_per_token(d), config.tokens_per_block,
                                config.max_tokens)
        return cls(d, tokens // config.tokens_per_block, config.tokens_per_block, config.enable_block_reuse)

    # -- pool state -------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    @property
    def free_blocks(self) -> int:
        """Blocks a request could take now: never used, or released and only kept for reuse."""
        return len(self._clean) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def bytes_per_token(self) -> int:
        return (self.k.element_size() + self.v.element_size()) * self.k[0, 0, 0].numel() * self.d.num_layers \
            * self.d.tp

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_block)

    # -- per request ------------------------------------------------------------

    def _chain(self, tokens: list[int], count: int, start_key: int = 0, start: int = 0) -> list[int]:
        keys, key = [], start_key
        tpb = self.tokens_per_block
        for b in range(start, count):
            key = hash((key, tuple(tokens[b * tpb:(b + 1) * tpb])))
            keys.append(key)
        return keys

    def match(self, tokens: list[int]) -> int:
        """Blocks of `tokens` the cache already holds (never the one with the last token)."""
        if not self.enable_block_reuse:
            return 0
        found = 0
        for key in self._chain(tokens, (len(tokens) - 1) // self.tokens_per_block):
            if key not in self._by_key:
                break
            found += 1
        return found

    def add_sequence(self, table: BlockTable, tokens: list[int], *, reuse: bool = True) -> None:
        """Give a request its context: matched blocks by prefix, fresh ones for the rest of
        `tokens`. Raises if the pool cannot supply them (callers check `blocks_to_add` first)."""
        matched = self.match(tokens) if reuse else 0
        keys = self._chain(tokens, matched)
        needed = self.blocks_for(len(tokens)) - matched
        if needed > self.free_blocks - self._cached_among(keys):
            raise RuntimeError(f"KV cache exhausted: {needed} blocks needed, {self.free_blocks} free")
        for key in keys:
            block = self._blocks[self._by_key[key]]
            if block.refs == 0:
                del self._cached[block.index]
            block.refs += 1
            table.blocks.append(block.index)
        table.keys = keys
        table.length = matched * self.tokens_per_block
        table.reused = matched
        self.reused_total += matched
        for _ in range(needed):
            self._append_block(table, count=True)

    def _cached_among(self, keys: list[int]) -> int:
        return sum(1 for k in keys if self._blocks[self._by_key[k]].refs == 0)

    def blocks_to_add(self, tokens: list[int]) -> int:
        """Free blocks adding a sequence over `tokens` would consume (matched blocks that sit
        unreferenced in the cache count: taking them removes them from the free pool)."""
        matched = self.match(tokens)
        return self.blocks_for(len(tokens)) - matched + self._cached_among(self._chain(tokens, matched))

    def _append_block(self, table: BlockTable, count: bool = False) -> None:
        if self._clean:
            index = self._clean.pop()
        elif self._cached:
            index, _ = self._cached.popitem(last=False)  # evict the least recently released
            del self._by_key[self._blocks[index].key]
            self._blocks[index].key = None
        else:
            raise RuntimeError("KV cache exhausted: no free block")
        block = self._blocks[index]
        if count:
            table.alloc_total += 1
            table.alloc_new += not block.used
        block.used = True
        block.refs = 1
        table.blocks.append(index)

    def reserve(self, table: BlockTable, length: int) -> None:
        """Make room for `length` tokens in total (decode growth)."""
        while len(table.blocks) * self.tokens_per_block < length:
            self._append_block(table)

    def commit(self, table: BlockTable, tokens: list[int], length: int) -> None:
        """`length` tokens of `tokens` now have their K/V written: register the blocks they filled."""
        table.length = length
        if not self.enable_block_reuse:
            return
        full = length // self.tokens_per_block
        if full <= len(table.keys):
            return
        start_key = table.keys[-1] if table.keys else 0
        for b, key in enumerate(self._chain(tokens, full, start_key, len(table.keys)), start=len(table.keys)):
            table.keys.append(key)
            block = self._blocks[table.blocks[b]]
            if block.key is None and key not in self._by_key:
                block.key = key
                self._by_key[key] = block.index

    def release(self, table: BlockTable) -> None:
        """Return a request's blocks; registered ones stay matchable until evicted."""
        for index in reversed(table.blocks):  # tail first: the prefix stays cached longest
            block = self._blocks[index]
            block.refs -= 1
            if block.refs:
                continue
            if block.key is not None:
                self._cached[index] = None
            else:
                self._clean.append(index)
        table.blocks, table.keys, table.length = [], [], 0

    def forget_cached(self) -> int:
        """Drop every free block's registration, so no later request reuses it (a cold cache for
        side-by-side measurements); returns how many were dropped. Held blocks are untouched."""
        dropped = list(self._cached)
        for index in dropped:
            block = self._blocks[index]
            self._by_key.pop(block.key, None)
            block.key = None
            self._clean.append(index)
        self._cached.clear()
        return len(dropped)

    def slots(self, table: BlockTable, start: int, stop: int) -> torch.Tensor:
        """Pool slot of each position in [start, stop)."""
        tpb = self.tokens_per_block
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table.blocks, dtype=torch.int64)
        return blocks[pos // tpb] * tpb + pos % tpb

    def move(self, table: BlockTable, src, dst) -> None:
        """Copy the K/V at positions `src` of `table` to positions `dst` (a verified draft tree's
        accepted nodes into sequence order), every layer and rank at once."""
        tpb = self.tokens_per_block
        blocks = torch.tensor(table.blocks, dtype=torch.int64)
        src, dst = torch.as_tensor(list(src), dtype=torch.int64), torch.as_tensor(list(dst), dtype=torch.int64)
        s, d = blocks[src // tpb] * tpb + src % tpb, blocks[dst // tpb] * tpb + dst % tpb
        for pool in (self.k, self.v):
            # float8 has no CPU indexing kernels; its bytes move the same.
            raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
            raw[:, :, d] = raw[:, :, s]
