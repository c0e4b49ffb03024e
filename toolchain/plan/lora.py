"""LoRA in the memory plan: which families serve adapters, each LoRA module's (in, out) from the model's config,
the adapter caches per rank (their page geometry, their sizes and how many max-size adapters each holds) and an
adapter's bytes per rank.

Both paths size their caches with TensorRT-LLM's C++ PeftCacheManager (cpp/tensorrt_llm/batch_manager/
peftCacheManager.cpp `getPageManagerConfig`, `getMaxNumSlots`; facts in /work/notes/i38-facts-engine.md §4):
- a page is `slots_per_page` slots of `page_width` elements of the model dtype; page_width is the narrowest
  module's localIn + localOut, and a page holds one optimal-size adapter (or at least one max-size row);
- the host pool is `lora_cache_host_memory_bytes` / PeftCacheConfig.host_cache_size (1 GiB) on every rank;
- the device pool is a fraction of the GPU memory free when the cache is made, which is after the engine and the
  KV cache ("a fraction of left over memory after engine load, and after KV cache is loaded", tensorrtllm_backend
  docs/lora.md): `lora_cache_gpu_memory_fraction` 0.05 on the engine path (PeftCacheManagerConfig
  kDefaultDeviceCachePercent), PeftCacheConfig.device_cache_percent 0.02 on the LLM API (llm_args.py). So the KV
  budget is taken first and the LoRA device cache comes out of what it leaves: it shrinks no KV cache here;
- on the LLM API, LoraConfig.max_loras / max_cpu_loras size the pools instead, as
  `max_lora_rank x layers x modules x max_loras` "module layers" (tensorrt_llm/_torch/pyexecutor/_util.py
  create_py_executor_instance), each max1dModSize elements, in whole slots (getMaxNumSlots's
  numDeviceModuleLayer / numHostModuleLayer branch: recalled, UNVERIFIED against the C++ source);
- either pool must hold one max-size adapter, or the model load fails with "Not enough space allocated to host
  (device) LoRA cache to hold 1 max sized LoRA <slots> < <min slots>".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from toolchain.archs import get_family
from toolchain.archs.params import ArchParams
from toolchain.checkpoint.lora import LLAMA_HF_TO_TRTLLM, NOT_SPLIT, ROW_PARALLEL, module_dims
from toolchain.checkpoint.lora_setup import LoraSetup, lora_setup
from toolchain.errors import ToolchainError
from toolchain.plan.model import DTYPE_BYTES, weight_dtype
from toolchain.targets import ENGINE, target_of

ENGINE_DEVICE_FRACTION = 0.05  # peftCacheManagerConfig.h kDefaultDeviceCachePercent (tensorrt_llm model default)
LLMAPI_DEVICE_FRACTION = 0.02  # llm_args.py PeftCacheConfig.device_cache_percent
_LAYER_MODULE = re.compile(r"\.layers\.\{layer\}\.(self_attn|mlp)\.([a-z_]+)\.weight$")


# ------------------------------------------------------------------------------------------- the base model


def family_refusal(p: ArchParams) -> str | None:
    """Why this model's family serves no LoRA here, or None: only Llama-style dense decoders, whose layers hold
    PEFT's q/k/v/o_proj and gate/up/down_proj as separate linears (the PyTorch backend's Attention and GatedMLP
    LoraLayers, the engine's attn_q..mlp_4h_to_h modules). Experts and multi-head latent attention have LoRA
    modules of their own (moe_*, MLA's) that this toolchain does not convert."""
    arch = p.architecture
    hint = "serve LoRA adapters on a dense Llama-style model, or drop the lora section"
    if p.is_moe:
        return f"LoRA on {arch}: a mixture-of-experts model is not served with LoRA adapters ({hint})"
    if p.mla is not None:
        return f"LoRA on {arch}: multi-head latent attention has no attn_q/attn_k/attn_v LoRA modules ({hint})"
    have = {m.group(2) for row in get_family(arch).rows if (m := _LAYER_MODULE.search(row.hf))}
    missing = [m for m in LLAMA_HF_TO_TRTLLM if m not in have]
    if missing:
        return f"LoRA on {arch}: its decoder layers have no separate {', '.join(missing)} ({hint})"
    return None


def base_dims(p: ArchParams) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA module of the whole (unsplit) base, from the plan's model facts."""
    return module_dims(p.hidden_size, p.intermediate_size, p.num_attention_heads, p.num_key_value_heads, p.head_size)


def local_dims(dims: tuple[int, int], module: str, tp: int) -> tuple[int, int]:
    """(localIn, localOut) of a module on one TP rank (loraModule.h localInDim/localOutDim): row-parallel modules
    split their in dim, the others their out dim (checkpoint/lora.py `shard` cuts the same)."""
    d_in, d_out = dims
    if module in NOT_SPLIT:
        return d_in, d_out
    return (d_in // tp, d_out) if module in ROW_PARALLEL else (d_in, d_out // tp)


def resolved(spec) -> LoraSetup | None:
    """The spec's LoRA setup (adapters' headers read), or None without LoRA or where the adapters or the family are
    refused (the lora.adapters check says why)."""
    if not spec.lora.enabled:
        return None
    try:
        setup = lora_setup(spec.lora)
    except ToolchainError:
        return None
    return setup if setup is not None and setup.target_modules else None


def cache_dtype(spec, p: ArchParams) -> str:
    """The dtype the caches hold: the model's (the engine's lora_plugin dtype, the PyTorch model's), float32 on the
    CPU engine, which computes in it."""
    return target_of(spec).compute_dtype or weight_dtype(spec, p)


# ------------------------------------------------------------------------------------------- the caches


@dataclass(frozen=True)
class Pages:
    """One rank's page geometry (getPageManagerConfig)."""

    page_width: int
    """Elements per slot: min over the target modules of localIn + localOut."""
    slots_per_page: int
    min_total_slots: int
    """Slots one max-size adapter needs: ceil(max_adapter_size x max1dLoraSize / page_width)."""
    max_lora_size: int
    """Elements of one max-size adapter on this rank: max_adapter_size x sum of (localIn + localOut) x layers."""
    max1d_module_size: int
    optimal_adapter_size: int
    max_adapter_size: int


def pages(dims: dict[str, tuple[int, int]], modules, tp: int, local_layers: int, optimal_adapter_size: int,
          max_adapter_size: int, max_lora_rank: int) -> Pages:
    """getPageManagerConfig for `modules` over `local_layers` layers at `tp`; the adapter sizes are clamped to
    max_lora_rank as PeftCacheManager's constructor clamps them."""
    optimal, largest = min(optimal_adapter_size, max_lora_rank), min(max_adapter_size, max_lora_rank)
    one_d = [sum(local_dims(dims[m], m, tp)) for m in modules]
    width = min(one_d)
    total_slots = sum(optimal * math.ceil(d / width) for d in one_d) * local_layers
    per_page = max(total_slots, math.ceil(largest * max(one_d) / width))
    max_lora = largest * sum(one_d) * local_layers
    return Pages(width, per_page, math.ceil(max_lora / width), max_lora, max(one_d), optimal, largest)


@dataclass(frozen=True)
class Pool:
    """One cache pool of one rank."""

    slots: int
    """Slots its budget buys (getMaxNumSlots)."""
    pages: int
    nbytes: int
    """Bytes its pages take: pages x slots_per_page x page_width x dtype bytes."""
    adapters: int
    """Max-size adapters it holds ("LoRA host/device Cache can hold N max sized LoRAs")."""
    enough: bool
    """It holds one max-size adapter (slots >= min_total_slots); else the model load fails."""
    budget: str
    """What sized it, for the report."""


def pool(geometry: Pages, slots: int, dtype_bytes: int, budget: str) -> Pool:
    n_pages = math.ceil(slots / geometry.slots_per_page)
    elements = n_pages * geometry.slots_per_page * geometry.page_width
    return Pool(slots, n_pages, elements * dtype_bytes, elements // geometry.max_lora_size,
                slots >= geometry.min_total_slots, budget)


def module_layer_slots(geometry: Pages, module_layers: int) -> int:
    """Slots of `module_layers` max1d-module rows of rank 1 (the num_*_module_layer branch of getMaxNumSlots)."""
    return math.ceil(module_layers * geometry.max1d_module_size / geometry.page_width)


@dataclass(frozen=True)
class RankLora:
    """The LoRA caches of one rank and the adapters' bytes on it."""

    dtype: str
    geometry: Pages
    host: Pool
    device: Pool | None
    """None on the CPU engine, which holds its adapters in host memory only."""
    after_kv_bytes: int
    """GPU memory left after the engine and the KV cache, which the device pool comes out of (0 off a GPU)."""
    max_adapter_bytes: int
    """One max-size adapter (max_adapter_size clamped to max_lora_rank, every target module) on this rank."""
    adapter_bytes: tuple[tuple[str, int], ...]
    """Each of the spec's adapters on this rank: sum over its (layer, module) of r x (localIn + localOut) x dtype."""


def adapter_rank_bytes(shapes, layers: range, tp: int, dtype_bytes: int) -> int:
    """Bytes of one adapter's (layer, module) -> (A [r, in], B [out, r]) shapes held by a rank of `layers` at tp."""
    total = 0
    for (layer, module), ((rank, d_in), (d_out, _)) in shapes.items():
        if layer in layers:
            total += rank * sum(local_dims((d_in, d_out), module, tp)) * dtype_bytes
    return total


def rank_lora(spec, p: ArchParams, setup: LoraSetup, *, layers: range, tp: int, after_kv_bytes: int,
              gpu: bool) -> RankLora:
    """The caches of one rank holding `layers` at `tp`; `after_kv_bytes` is what the engine and the KV cache left
    on its GPU."""
    cache, engine = spec.lora.cache, target_of(spec).path == ENGINE
    dtype = cache_dtype(spec, p)
    dt = DTYPE_BYTES[dtype]
    dims = base_dims(p)
    geometry = pages(dims, setup.target_modules, tp, len(layers), cache.optimal_adapter_size,
                     cache.max_adapter_size, setup.max_lora_rank)
    slot_bytes = geometry.page_width * dt
    # LoRA module layers of max_loras adapters (_util.py: max_lora_rank x num_hidden_layers x modules x adapters)
    module_layers = setup.max_lora_rank * p.num_hidden_layers * len(setup.target_modules)
    if cache.max_cpu_loras is not None and not engine:
        host = pool(geometry, module_layer_slots(geometry, module_layers * cache.max_cpu_loras), dt,
                    f"lora.cache.max_cpu_loras {cache.max_cpu_loras}")
    else:
        host = pool(geometry, cache.host_memory_bytes // slot_bytes, dt,
                    f"lora.cache.host_memory_bytes {cache.host_memory_bytes}")
    device = None
    if gpu:
        if cache.max_loras is not None and not engine:
            device = pool(geometry, module_layer_slots(geometry, module_layers * cache.max_loras), dt,
                          f"lora.cache.max_loras {cache.max_loras}")
        else:
            fraction = cache.gpu_memory_fraction or (ENGINE_DEVICE_FRACTION if engine else LLMAPI_DEVICE_FRACTION)
            device = pool(geometry, int(fraction * max(after_kv_bytes, 0)) // slot_bytes, dt,
                          f"{fraction:g} of the memory left after the KV cache")
    sizes = tuple((a.name, adapter_rank_bytes(a.shapes, layers, tp, dt)) for a in setup.adapters)
    return RankLora(dtype, geometry, host, device, max(after_kv_bytes, 0) if gpu else 0,
                    geometry.max_lora_size * dt, sizes)
