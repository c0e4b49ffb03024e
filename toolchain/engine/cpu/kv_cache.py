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
  position of the prompt's last token: its logits are needed). Released
  blocks keep their contents and hash until the pool needs them; the least
  recently released goes first.
* Partial reuse (KvCacheConfig enable_partial_reuse and copy_on_partial_reuse,
  both on by default in TensorRT-LLM): a released request's last, partly filled
  block is registered too, and after the full-block chain a request takes the
  longest run of leading tokens any registered block after the same prefix shares
  with it, copied into a fresh block (so the source stays intact). A request
  that resends its own sequence plus a few tokens, as the BLS's draft -> target
  loop does every step, computes only the new tokens.
* Per request it counts what the backend reports with `return_perf_metrics`:
  blocks matched by prefix (reused), blocks taken from the pool for its context
  (total) and of those the ones that had never held data (new).

Storage: per layer and TP rank, K and V as [num_blocks * tokens_per_block,
kv_heads, head_size] in float32, or int8/e4m3 for an INT8/FP8 KV cache. The
tensors come from torch.empty, so memory is committed only as blocks are used.
Multi-head latent attention (DeepSeek-V3) keeps one latent per token instead
(`cache_widths`): K as [slots, 1, kv_lora_rank + qk_rope_head_dim] and an empty
V, as TensorRT-LLM's PyTorch backend allocates a SELFKONLY cache of one head for it;
the blocks, slots and reuse are the same.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from toolchain.engine.cpu.config import ModelDims
from toolchain.errors import ToolchainError
from toolchain.plan.memory import cpu_default_max_tokens, kv_pool_tokens
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


def cache_widths(d: ModelDims) -> tuple[int, int, int]:
    """(heads, K width, V width) of one token's cache entry per layer and TP rank: the rank's KV heads, or for
    multi-head latent attention one latent "head" of kv_lora_rank + qk_rope_head_dim and no V (CacheType.SELFKONLY
    with num_kv_heads 1 in TensorRT-LLM's _torch/pyexecutor/_util.py; engine/cpu/mla.py)."""
    if d.mla is not None:
        return 1, d.mla.latent_width, 0
    return d.kv_heads_per_rank, d.head_size, d.head_size


def kv_bytes_per_token(d: ModelDims) -> int:
    """Bytes one token's keys and values take over all layers and TP ranks of this engine."""
    kind = KV_KINDS.get(d.kv_cache_quant_algo or "")
    width = 1 if kind else 4  # the CPU engine keeps an unquantized cache in float32
    heads, k_width, v_width = cache_widths(d)
    return d.cache_layers * d.tp * heads * (k_width + v_width) * width


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


def capped(config: KvCacheConfig, max_batch_size: int, max_seq_len: int) -> KvCacheConfig:
    """`config` with the CPU engine's own cap on the pool where it sets none (plan/memory.cpu_default_max_tokens)."""
    if config.max_tokens is not None:
        return config
    return replace(config, max_tokens=cpu_default_max_tokens(max_batch_size, max_seq_len))


def pool_reserve_bytes(d: ModelDims, config: KvCacheConfig) -> int:
    """Memory to leave after the weights so `KvCacheManager.create` reaches config.max_tokens: the pool's bytes over
    the share of free memory it may take. What the weights' optional copies (linear.blocked_budget) must not touch;
    0 without a cap, where the pool takes its share of whatever is left."""
    if config.max_tokens is None:
        return 0
    return int(config.max_tokens * kv_bytes_per_token(d) / config.free_memory_fraction)


class _Block:
    __slots__ = ("index", "refs", "key", "used", "parent", "tokens")

    def __init__(self, index: int):
        self.index = index
        self.refs = 0
        self.key: int | None = None  # reuse hash while the block's contents are registered
        self.used = False  # has ever held data (TRT-LLM counts "new" blocks by this)
        self.parent: int | None = None  # while registered: the hash of everything before the block
        self.tokens: tuple = ()  # while registered: the tokens it holds (fewer than a block if partial)


class BlockTable:
    """One request's blocks, the tokens written through them, and its allocation counts."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.keys: list[int] = []  # reuse hash of each full block, in order
        self.length = 0  # tokens whose K/V are in the cache
        self.tail: tuple = ()  # tokens of the last, partly filled block (registered on release)
        self.root = 0  # the hash its first block follows: a LoRA adapter's own (reuse_root)
        self.reused = 0
        self.alloc_total = 0
        self.alloc_new = 0


class BlockEvents(Protocol):
    """Told when a block becomes matchable by its hash (stored) and when it stops being so (removed), as
    TensorRT-LLM's KV cache event manager reports them; a Dynamo worker relays them to the KV router
    (toolchain/dynamo/kv_events.py). Called on the batcher thread, inside the step."""

    def stored(self, key: int, parent: int, tokens: tuple) -> None: ...

    def removed(self, key: int, tokens: tuple) -> None: ...


class KvCacheManager:
    def __init__(self, d: ModelDims, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool):
        self.d = d
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.enable_block_reuse = enable_block_reuse
        self.kind = KV_KINDS.get(d.kv_cache_quant_algo or "")
        dtype = storage_dtype(self.kind) if self.kind else torch.float32
        heads, k_width, v_width = cache_widths(d)
        slots = num_blocks * tokens_per_block
        self.k = torch.empty((d.cache_layers, d.tp, slots, heads, k_width), dtype=dtype)
        self.v = torch.empty((d.cache_layers, d.tp, slots, heads, v_width), dtype=dtype)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Never-registered free blocks, as a stack: the most recently freed (warm) block goes out first.
        self._clean = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but registered, least recently freed first
        self._by_key: dict[int, int] = {}  # reuse hash -> block index
        self._children: dict[int, dict[int, None]] = {}  # parent hash -> registered blocks after it (partial reuse)
        self.reused_total = 0  # blocks matched by prefix since start (the `reused` gauge)
        # KV-block events: None unless a listener is attached, so a plain engine pays one attribute test per
        # registration and nothing else.
        self.events: BlockEvents | None = None
        self.copy_log: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def create(cls, d: ModelDims, config: KvCacheConfig, *, free_bytes: int | None = None) -> "KvCacheManager":
        tpb = config.tokens_per_block
        problem = config.problem() or (None if tpb is not None else
                                       "tokens_per_block is not set (CpuEngine.load takes the engine's)")
        if problem or tpb is None:
            raise ToolchainError(f"KV cache: {problem}")
        free = available_memory_bytes() if free_bytes is None else free_bytes
        tokens = kv_pool_tokens(free, config.free_memory_fraction, kv_bytes_per_token(d), tpb, config.max_tokens)
        return cls(d, tokens // tpb, tpb, config.enable_block_reuse)

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
        entry = self.k.element_size() * self.k[0, 0, 0].numel() + self.v.element_size() * self.v[0, 0, 0].numel()
        return entry * self.d.cache_layers * self.d.tp

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_block)

    # -- per request ------------------------------------------------------------

    @staticmethod
    def reuse_root(lora_task_id: int | None) -> int:
        """The hash a request's first block follows: 0 for the base model, the adapter's own otherwise, so blocks
        computed under one adapter are never reused by another (TensorRT-LLM's BlockKey carries the LoRA task id)."""
        return 0 if lora_task_id is None else hash(("lora", int(lora_task_id)))

    @staticmethod
    def _key(parent: int, tokens: tuple) -> int:
        """A block's reuse hash: its tokens (fewer than a block for a partial one) after its parent's."""
        return hash((parent, tokens))

    def _chain(self, tokens: list[int], count: int, start_key: int = 0, start: int = 0) -> list[int]:
        keys, key = [], start_key
        tpb = self.tokens_per_block
        for b in range(start, count):
            key = self._key(key, tuple(tokens[b * tpb:(b + 1) * tpb]))
            keys.append(key)
        return keys

    def match(self, tokens: list[int], root: int = 0) -> int:
        """Full blocks of `tokens` the cache already holds (never the one with the last token)."""
        if not self.enable_block_reuse:
            return 0
        found = 0
        for key in self._chain(tokens, (len(tokens) - 1) // self.tokens_per_block, root):
            if key not in self._by_key:
                break
            found += 1
        return found

    def _partial(self, tokens: list[int], keys: list[int], root: int = 0) -> tuple[int, int] | None:
        """(block, n): the registered block after the matched full blocks (their hashes `keys`)
        sharing the longest run of leading tokens (n >= 1) with the rest of `tokens`, the last
        token excluded."""
        if not self.enable_block_reuse:
            return None
        tpb = self.tokens_per_block
        full = len(keys)
        want = tokens[full * tpb:min((full + 1) * tpb, len(tokens) - 1)]
        if not want:
            return None
        parent = keys[-1] if keys else root
        best = None
        for index in self._children.get(parent, ()):
            have = self._blocks[index].tokens
            n = 0
            while n < len(want) and n < len(have) and have[n] == want[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (index, n)
        return best

    def matched_tokens(self, tokens: list[int], root: int = 0) -> int:
        """Tokens of `tokens` a new request would take from the cache (full blocks, then a partial one)."""
        full = self.match(tokens, root)
        part = self._partial(tokens, self._chain(tokens, full, root), root)
        return full * self.tokens_per_block + (part[1] if part else 0)

    def add_sequence(self, table: BlockTable, tokens: list[int], *, reuse: bool = True, root: int = 0) -> None:
        """Give a request its context: matched blocks by prefix, fresh ones for the rest of
        `tokens`. Raises if the pool cannot supply them (callers check `blocks_to_add` first).
        `root` keys its blocks apart from other adapters' (reuse_root)."""
        table.root = root
        matched = self.match(tokens, root) if reuse else 0
        keys = self._chain(tokens, matched, root)
        part = self._partial(tokens, keys, root) if reuse else None
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
        for i in range(needed):
            self._append_block(table, count=True)
            if i == 0 and part is not None:
                # Copy before any later allocation could evict the source (when the fresh block is
                # the source itself, evicted just now, its contents are already in place).
                src, n = part
                self._copy_slots(src, table.blocks[-1], n)
                table.length += n

    def _copy_slots(self, src: int, dst: int, n: int) -> None:
        """The first `n` token slots of block `src` into block `dst`."""
        if src != dst:
            tpb = self.tokens_per_block
            self.copy_pool(torch.arange(src * tpb, src * tpb + n), torch.arange(dst * tpb, dst * tpb + n))

    def copy_pool(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K/V at pool slots `src` into slots `dst`, every layer and rank at once."""
        if self.copy_log is not None:  # rank processes (ranks.py): the other ranks' pools copy the same
            self.copy_log.append((src, dst))
        for pool in (self.k, self.v):
            # float8 has no CPU indexing kernels; its bytes move the same.
            raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
            raw[:, :, dst] = raw[:, :, src]

    def _cached_among(self, keys: list[int]) -> int:
        return sum(1 for k in keys if self._blocks[self._by_key[k]].refs == 0)

    def blocks_to_add(self, tokens: list[int], root: int = 0) -> int:
        """Free blocks adding a sequence over `tokens` would consume (matched blocks that sit
        unreferenced in the cache count: taking them removes them from the free pool)."""
        matched = self.match(tokens, root)
        return self.blocks_for(len(tokens)) - matched + self._cached_among(self._chain(tokens, matched, root))

    def _append_block(self, table: BlockTable, count: bool = False) -> None:
        if self._clean:
            index = self._clean.pop()
        elif self._cached:
            index, _ = self._cached.popitem(last=False)  # evict the least recently released
            self._unregister(self._blocks[index])
        else:
            raise RuntimeError("KV cache exhausted: no free block")
        block = self._blocks[index]
        if count:
            table.alloc_total += 1
            table.alloc_new += not block.used
        block.used = True
        block.refs = 1
        table.blocks.append(index)

    def _register(self, block: _Block, key: int, parent: int, tokens: tuple) -> None:
        block.key, block.parent, block.tokens = key, parent, tokens
        self._by_key[key] = block.index
        self._children.setdefault(parent, {})[block.index] = None
        if self.events is not None:
            self.events.stored(key, parent, tokens)

    def _unregister(self, block: _Block) -> None:
        if self.events is not None and block.key is not None:
            self.events.removed(block.key, block.tokens)
        if block.key is not None:
            self._by_key.pop(block.key, None)
        siblings = self._children.get(block.parent) if block.parent is not None else None
        if siblings is not None and block.parent is not None:
            siblings.pop(block.index, None)
            if not siblings:
                del self._children[block.parent]
        block.key, block.parent, block.tokens = None, None, ()

    def reserve(self, table: BlockTable, length: int) -> None:
        """Make room for `length` tokens in total (decode growth)."""
        while len(table.blocks) * self.tokens_per_block < length:
            self._append_block(table)

    def commit(self, table: BlockTable, tokens: list[int], length: int) -> None:
        """`length` tokens of `tokens` now have their K/V written: register the blocks they filled."""
        table.length = length
        if not self.enable_block_reuse:
            return
        tpb = self.tokens_per_block
        full = length // tpb
        table.tail = tuple(tokens[full * tpb:length])
        if full <= len(table.keys):
            return
        start_key = table.keys[-1] if table.keys else table.root
        for b, key in enumerate(self._chain(tokens, full, start_key, len(table.keys)), start=len(table.keys)):
            parent = table.keys[-1] if table.keys else table.root
            table.keys.append(key)
            block = self._blocks[table.blocks[b]]
            if block.key is None and key not in self._by_key:
                self._register(block, key, parent, tuple(tokens[b * tpb:(b + 1) * tpb]))

    def release(self, table: BlockTable) -> None:
        """Return a request's blocks; registered ones stay matchable until evicted, the last
        partly filled one included (partial reuse)."""
        full = len(table.keys)
        if self.enable_block_reuse and table.tail and full < len(table.blocks) \
                and table.length == full * self.tokens_per_block + len(table.tail):
            parent = table.keys[-1] if table.keys else table.root
            key = self._key(parent, table.tail)
            block = self._blocks[table.blocks[full]]
            if block.key is None and block.refs == 1 and key not in self._by_key:
                self._register(block, key, parent, table.tail)
        for index in reversed(table.blocks):  # tail first: the prefix stays cached longest
            block = self._blocks[index]
            block.refs -= 1
            if block.refs:
                continue
            if block.key is not None:
                self._cached[index] = None
            else:
                self._clean.append(index)
        table.blocks, table.keys, table.length, table.tail = [], [], 0, ()

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table over `table`'s cached tokens, for a beam that branches off another (beam search):
        the full blocks are shared (nothing writes into them again), the partly filled last one is copied
        into a fresh block, which the new beam then writes on. Raises when the pool has no free block."""
        tpb = self.tokens_per_block
        full, part = divmod(table.length, tpb)
        child = BlockTable()
        for index in table.blocks[:full]:
            self._blocks[index].refs += 1
            child.blocks.append(index)
        child.keys, child.length, child.tail, child.root = table.keys[:full], table.length, table.tail, table.root
        if part:
            self._append_block(child)
            self._copy_slots(table.blocks[full], child.blocks[-1], part)
        return child

    def forget_cached(self) -> int:
        """Drop every free block's registration, so no later request reuses it (a cold cache for
        side-by-side measurements); returns how many were dropped. Held blocks are untouched."""
        dropped = list(self._cached)
        for index in dropped:
            self._unregister(self._blocks[index])
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
        self.copy_pool(blocks[src // tpb] * tpb + src % tpb, blocks[dst // tpb] * tpb + dst % tpb)
