"""LoRA adapters in the CPU engine: the host cache of adapters by task id, and their deltas in the forward.

The cache mirrors TensorRT-LLM's PeftCacheManager host cache (cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp,
cpp/tensorrt_llm/runtime/loraCache.cpp @063e02f7): an adapter arrives once as `lora_weights` [1, rows, W] and
`lora_config` [1, rows, 3|4] (or from a `lora_prefetch_dir`), is checked with upstream's words
(loraUtils.cpp @2a9abd95 `loraValidateRequestTensors`, here `toolchain.checkpoint.lora.unpack`) and stored per TP
rank already cut as `LoraCache::copyToPages` cuts it (`lora.shard`). Later requests name it by task id alone.
Weights sent again for a cached id are ignored (`LoraCache::put` bumps it and returns). When the byte budget is
spent the least recently used adapter no running request uses is evicted; with none to evict the put fails with
"PEFT Cache is full. Could not store taskId=<id>". Bytes are counted as the adapter's rows in the engine dtype
(rank x (in + out) per row), without upstream's page rounding.

The forward (`LoraBatch`): one step groups its rows by adapter, and for every layer, module and TP rank shard
each adapter adds x[rows] @ A^T @ B^T to its rows of the module's output (B carries the PEFT scale, folded in by
the converter). Column-parallel modules (q/k/v, mlp_h_to_4h = gate_proj, mlp_gate = up_proj) add to the rank's
output slice; row-parallel ones (attn_dense, mlp_4h_to_h) take the rank's input columns and add to its partial
sum before the all-reduce, so the ranks' deltas sum to the whole adapter's. Rows without an adapter cost nothing.
"""

from __future__ import annotations

import logging
import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolchain.checkpoint.lora import (CONFIG_FILE, LLAMA_HF_TO_TRTLLM, LORA_MODULE_IDS, WEIGHTS_FILE, Converted,
                                       module_dims, shard, unpack)
from toolchain.engine.cpu.config import ModelDims
from toolchain.errors import ToolchainError

log = logging.getLogger(__name__)

NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32}
TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
TRTLLM_TO_HF = {trt: hf for hf, trt in LLAMA_HF_TO_TRTLLM.items()}


@dataclass(frozen=True)
class LoraEngineConfig:
    """What an engine's config.json says of LoRA: build_config.lora_config and plugin_config.lora_plugin."""

    target_modules: tuple[str, ...]
    max_lora_rank: int


def parse_lora_config(build: Mapping, origin: str) -> LoraEngineConfig | None:
    """The engine's LoRA settings, None without LoRA: as gptJsonConfig.cpp `parseLora` reads them, LoRA is on when
    plugin_config.lora_plugin is set and lora_config names modules and a rank above 0."""
    plugin = (build.get("plugin_config") or {}).get("lora_plugin")
    if plugin is None or plugin == "disable":
        return None
    config = build.get("lora_config") or {}
    modules, rank = config.get("lora_target_modules") or [], config.get("max_lora_rank") or 0
    if not isinstance(modules, list) or any(m not in LORA_MODULE_IDS for m in modules) \
            or not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ToolchainError(f"{origin}: build_config.lora_config has lora_target_modules {modules!r} and "
                             f"max_lora_rank {rank!r}; expected TensorRT-LLM LoRA module names and a rank",
                             "rebuild the engine: `toolchain build-engine --force`")
    if not modules or rank == 0:
        log.warning("lora_plugin enabled, but no lora module enabled: setting useLoraPlugin to false")
        return None
    return LoraEngineConfig(tuple(modules), rank)


def lora_build_config(target_modules: Sequence[str], max_lora_rank: int) -> dict:
    """build_config.lora_config as trtllm-build records it (tensorrt_llm/lora_helper.py `LoraConfig` fields), with
    no lora_dir: adapters come per request or from the prefetch dir."""
    return {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": max_lora_rank,
            "lora_target_modules": list(target_modules),
            "trtllm_modules_to_hf_modules": {m: TRTLLM_TO_HF[m] for m in target_modules if m in TRTLLM_TO_HF},
            "max_loras": None, "max_cpu_loras": None}


def engine_problem(d: ModelDims, target_modules: Sequence[str], ranks_apart: bool) -> str | None:
    """Why this engine cannot run LoRA here, or None: the mechanism knows Llama-style dense decoders only."""
    if ranks_apart:
        return ("LoRA is not run across rank processes (serving.launch mpirun); serve this engine in one process "
                "(serving.launch: single)")
    if d.mla is not None or d.is_moe or d.fused_mlp or d.medusa_heads:
        return (f"LoRA on {d.architecture} (multi-head latent attention, experts, a fused MLP or Medusa heads) is not "
                "run by the CPU engine; LoRA serves Llama-style dense decoders")
    if d.num_kv_heads % d.tp:
        return (f"LoRA at tp {d.tp} over {d.num_kv_heads} KV heads (duplicated per rank) is not run by the CPU engine; "
                "use a tp that divides the KV heads")
    if "attn_dense" in target_modules and d.num_heads * d.head_size != d.hidden_size:
        return ("LoRA on attn_dense needs num_heads x head_size == hidden_size (TensorRT-LLM's LoRA module dims); "
                "leave attn_dense out of lora.target_modules")
    if d.mlp_width != d.intermediate_size and {"mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"} & set(target_modules):
        return "LoRA on the MLP of an engine whose MLP is padded for per-group quantization is not run by the CPU engine"
    return None


@dataclass
class _Adapter:
    shards: list[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]
    """Per TP rank: (layer, module) -> (A [r, in_local], B [out_local, r]) in float32, rounded through the dtype."""
    nbytes: int


class LoraCache:
    """PeftCacheManager's host cache for one engine (see the module docstring)."""

    def __init__(self, dims: ModelDims, target_modules: Sequence[str], max_lora_rank: int,
                 host_bytes: int = 1 << 30, dtype: torch.dtype = torch.float32):
        self.d = dims
        self.target_modules = tuple(target_modules)
        self.max_lora_rank = max_lora_rank
        self.host_bytes = host_bytes
        self.dtype = dtype
        every = module_dims(dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_kv_heads,
                            dims.head_size)
        # Only the engine's modules: unpack refuses any other with "lora module <m> not enabled for this model".
        self.dims = {m: every[m] for m in self.target_modules if m in every}
        self._tasks: OrderedDict[int, _Adapter] = OrderedDict()  # least recently used first
        self._holders: dict[object, int] = {}  # running request -> its task id (not evictable meanwhile)

    # -- the contract -------------------------------------------------------------

    def put(self, task_id: int, weights: np.ndarray, config: np.ndarray) -> None:
        """Store an adapter sent as request tensors (or read from the prefetch dir) under `task_id`."""
        task_id = _task(task_id)
        weights, config = np.asarray(weights), np.asarray(config)
        if NUMPY_DTYPES.get(self.dtype) != weights.dtype:
            raise ToolchainError("Expected lora weights to be the same data type as base model",
                                 f"got {weights.dtype} for a {str(self.dtype).removeprefix('torch.')} engine")
        converted = unpack(weights, config, self.dims, self.d.num_layers, source=f"LoRA task {task_id}")
        self.put_converted(task_id, converted)

    def put_converted(self, task_id: int, converted: Converted) -> None:
        """Store an adapter already read per (layer, module) as (A [r, in], B [out, r]), B scaled."""
        task_id = _task(task_id)
        self._check(task_id, converted)
        if task_id in self._tasks:  # LoraCache::put: a cached id keeps its weights, the new ones are dropped
            self.bump(task_id)
            return
        nbytes = sum(a.numel() + b.numel() for a, b in converted.values()) * self.dtype.itemsize
        self._make_room(task_id, nbytes)
        shards: list[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(self.d.tp)]
        for (layer, module), (a, b) in converted.items():
            a, b = _stored(a, self.dtype), _stored(b, self.dtype)
            for rank in range(self.d.tp):
                a_local, b_local = shard(a, b, module, self.d.tp, rank)
                shards[rank][(layer, module)] = (a_local.contiguous(), b_local.contiguous())
        self._tasks[task_id] = _Adapter(shards, nbytes)

    def has(self, task_id: int) -> bool:
        return task_id in self._tasks

    def bump(self, task_id: int) -> None:
        """Mark `task_id` most recently used (a request naming it)."""
        if task_id in self._tasks:
            self._tasks.move_to_end(task_id)

    def prefetch(self, directory: Path) -> list[int]:
        """Put every digit-named subdirectory of `directory` as that task id (PeftCacheManager::prefetchLoraWeights);
        others are skipped with upstream's warning. Returns the task ids put, in numeric order."""
        directory = Path(directory)
        if not directory.is_dir():
            log.debug("Cannot find the %s, skipping prefetching the lora weights.", directory)
            return []
        done = []
        for sub in sorted(directory.iterdir(), key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit()
                                                              else 0, p.name)):
            if not sub.is_dir():
                continue
            if not (sub.name.isascii() and sub.name.isdigit()):
                log.warning("lora task name %s is invalid, skipping to load lora weight from this folder.", sub.name)
                continue
            try:
                weights = np.load(sub / WEIGHTS_FILE, allow_pickle=False)
                config = np.load(sub / CONFIG_FILE, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise ToolchainError(f"LoRA weights in {sub} are not readable ({type(e).__name__})",
                                     "write them with `toolchain convert` or hf_lora_convert.py") from None
            self.put(int(sub.name), weights, config)
            done.append(int(sub.name))
        return done

    def problem(self, task_id: int | None) -> str | None:
        """Why a request naming `task_id` alone cannot run now, or None (PeftCacheManager::addRequestPeft)."""
        if task_id is None or task_id in self._tasks:
            return None
        return f"LoRA task {task_id} not found in cache. Please send LoRA weights with request"

    # -- requests in flight -------------------------------------------------------

    def use(self, task_id: int, holder: object) -> None:
        """`holder` (a running request) uses `task_id`: it is bumped and not evicted until `done(holder)`."""
        self.bump(task_id)
        self._holders[holder] = task_id

    def done(self, holder: object) -> None:
        self._holders.pop(holder, None)

    @property
    def used_bytes(self) -> int:
        return sum(a.nbytes for a in self._tasks.values())

    def task_ids(self) -> list[int]:
        """Cached task ids, least recently used first."""
        return list(self._tasks)

    def batch(self, tasks: Sequence[int | None], rows: Sequence[tuple[int, int]]) -> "LoraBatch | None":
        """The adapters of one forward: chunk i (rows[i] = its [start, end) in the batch) uses tasks[i]."""
        by_task: dict[int, list[int]] = {}
        for task, (start, end) in zip(tasks, rows, strict=True):
            if task is not None:
                by_task.setdefault(task, []).extend(range(start, end))
        if not by_task:
            return None
        groups = []
        for task, index in by_task.items():
            problem = self.problem(task)
            if problem is not None:
                raise RuntimeError(problem)
            groups.append((self._tasks[task], torch.tensor(index, dtype=torch.int64)))
        return LoraBatch(groups)

    # -- internals ----------------------------------------------------------------

    def _check(self, task_id: int, converted: Converted) -> None:
        """What unpack checks for request tensors, for adapters read otherwise, plus the rank limit."""
        if not converted:
            raise ToolchainError(f"LoRA task {task_id}: the adapter holds no weights", "send a converted adapter")
        for (layer, module), (a, b) in converted.items():
            if module not in self.dims:
                raise ToolchainError(f"LoRA task {task_id}: lora module {module} not enabled for this model",
                                     f"this engine has LoRA modules {list(self.target_modules)}")
            if not 0 <= layer < self.d.num_layers:
                raise ToolchainError(f"LoRA task {task_id}: Expected layerId to be in the range [0, numModelLayers)",
                                     f"layer {layer}, the model has {self.d.num_layers}")
            rank = a.shape[0]
            if rank > self.max_lora_rank:
                raise ToolchainError(f"LoRA task {task_id}: Invalid low_rank ({rank}). low_rank must be smaller than "
                                     f"mMaxLowRank ({self.max_lora_rank})",
                                     "rebuild the engine with a larger lora.max_lora_rank")
            d_in, d_out = self.dims[module]
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
                raise ToolchainError(f"LoRA task {task_id}: layer {layer} {module} is A {list(a.shape)} / B "
                                     f"{list(b.shape)}, the model's is {d_in} -> {d_out}",
                                     "the adapter was made for another base model")

    def _make_room(self, task_id: int, nbytes: int) -> None:
        used = self.used_bytes
        busy = set(self._holders.values())
        for victim in [t for t in self._tasks if t not in busy]:  # least recently used first
            if used + nbytes <= self.host_bytes:
                break
            used -= self._tasks.pop(victim).nbytes
        if used + nbytes > self.host_bytes:
            raise ToolchainError(f"PEFT Cache is full. Could not store taskId={task_id}")


class LoraBatch:
    """One forward's adapters: (adapter, its rows in the batch) per task id named by a chunk."""

    def __init__(self, groups: list[tuple[_Adapter, torch.Tensor]]):
        self.groups = groups

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, tp_rank: int, module: str, start: int = 0) -> None:
        """out[rows, start:start + out_local] += x[rows] @ A^T @ B^T for each adapter training `module` at `layer`."""
        for adapter, rows in self.groups:
            pair = adapter.shards[tp_rank].get((layer, module))
            if pair is None:
                continue
            a, b = pair
            delta = (x[rows] @ a.T) @ b.T
            out[rows, start:start + delta.shape[1]] += delta

    def add_qkv(self, qkv: torch.Tensor, h: torch.Tensor, layer: int, tp_rank: int, q: int, kv: int) -> None:
        """The q, k and v deltas into a rank's fused qkv output (its q width `q`, k and v width `kv` each)."""
        for module, start in (("attn_q", 0), ("attn_k", q), ("attn_v", q + kv)):
            self.add(qkv, h, layer, tp_rank, module, start)


def lora_request_problem(cache: LoraCache | None, task_id) -> str | None:
    """Why a request naming `task_id` cannot run on an engine with `cache` (None: built without LoRA), or None."""
    if task_id is None:
        return None
    if cache is None:
        return (f"this engine was built without LoRA (lora_task_id {task_id} sent); rebuild it with a lora section "
                "in the spec or send no lora_task_id")
    return cache.problem(task_id)


def _task(task_id) -> int:
    if not isinstance(task_id, numbers.Integral) or isinstance(task_id, bool) or task_id < 0:
        raise ToolchainError(f"lora_task_id must be a non-negative integer, got {task_id!r}")
    return int(task_id)


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as the cache holds it (the engine dtype), widened to float32 for the engine's matmuls; always a copy."""
    return t.to(dtype, copy=True).to(torch.float32)


def load_lora(config: Mapping, dims: ModelDims, ranks_apart: bool, host_bytes: int | None,
              prefetch_dir: Path | None, origin: str) -> LoraCache | None:
    """The LoRA cache of an engine whose config.json enables LoRA (None otherwise), sized `host_bytes` (the tensorrt_llm
    model's lora_cache_host_memory_bytes; 1 GiB by default) and holding `prefetch_dir`'s adapters."""
    settings = parse_lora_config(config.get("build_config") or {}, origin)
    if settings is None:
        return None
    problem = engine_problem(dims, settings.target_modules, ranks_apart)
    if problem is not None:
        raise ToolchainError(problem)
    dtype = TORCH_DTYPES.get(str((config.get("pretrained_config") or {}).get("dtype")), torch.float32)
    cache = LoraCache(dims, settings.target_modules, settings.max_lora_rank,
                      host_bytes if host_bytes is not None else 1 << 30, dtype)
    if prefetch_dir is not None:
        cache.prefetch(Path(prefetch_dir))
    return cache
