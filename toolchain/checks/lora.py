"""Checks of the spec's LoRA adapters: that the base can serve each one (checkpoint/lora_setup.py setup_problems,
the family, the engine dtype, the names they are served under) and that the adapter caches hold one max-size
adapter, as TensorRT-LLM's PeftCacheManager requires at model load (plan/lora.py)."""

from __future__ import annotations

from toolchain.checkpoint.lora_setup import adapter_info, setup_of, setup_problems
from toolchain.checks.registry import ENGINE, FAIL, PASS, SERVING, SKIP, WARN, Context, check
from toolchain.errors import ToolchainError
from toolchain.gpus import GIB
from toolchain.llmapi.launch import served_model_name
from toolchain.plan import lora as lora_plan
from toolchain.plan.model import DTYPE_BYTES, weight_dtype
from toolchain.targets import ENGINE as ENGINE_FLOW
from toolchain.targets import target_of

OFF = (PASS, "no LoRA")


def size_text(n: float) -> str:
    """Bytes as GiB, MiB or KiB: a tiny model's adapters are a few KiB."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB" if n >= 1024**2 else f"{n / 1024:.1f} KiB"


@check("lora.adapters", ENGINE + SERVING,
       "every LoRA adapter must fit the base it is served on: a Llama-style dense family, ranks within "
       "max_lora_rank, modules the engine carries, the base's shapes, a tp that splits them (TensorRT-LLM "
       "loraUtils.cpp, lora_manager.py), float16/float32 on the engine path (hf_lora_convert.py, the tensorrt_llm "
       "model's lora_weights TYPE_FP16), names apart from the served model's")
def _adapters(ctx: Context):
    spec, section = ctx.spec, ctx.spec.lora
    problems: list[str] = []  # a workload class naming an unknown adapter is refused when the spec loads
    if not section.enabled:
        return OFF
    served = served_model_name(spec)
    if served in section.adapters:
        problems.append(f"LoRA adapter {served!r} has the served model's name, so `model: {served}` could not "
                        "select it; rename the adapter or set llmapi.served_model_name")
    p = ctx.model.params if ctx.model is not None else None
    dtype = weight_dtype(spec, p) if p is not None else spec.model.dtype  # before a stage the config may be unread
    if target_of(spec).path == ENGINE_FLOW and dtype == "bfloat16":
        problems.append("LoRA on the engine path with a bfloat16 engine: the tensorrt_llm model declares lora_weights "
                        "TYPE_FP16 while the runtime wants the engine's dtype, and converted adapters (.npy) have no "
                        "bfloat16; set model.dtype float16, or serve on the LLM-API path (target llmapi)")
    refusal = lora_plan.family_refusal(p) if p is not None else None
    if refusal:
        problems.append(refusal)
    unreadable, read = [], []
    for name, path in section.adapters.items():  # each bad adapter in its own words, not only the first
        try:
            read.append(adapter_info(name, section.task_id(name), path))
        except ToolchainError as err:
            unreadable.append(f"LoRA adapter {name!r}: {str(err).removeprefix('LoRA adapter ')}")
    problems += unreadable
    setup = None
    if not unreadable:
        setup = setup_of(section, tuple(read))
        if not setup.target_modules:
            problems.append("lora.target_modules is empty, so the engine would carry no LoRA module; name the "
                            "modules the adapters train, or drop the lora section")
        elif p is not None and refusal is None:
            problems += setup_problems(setup, lora_plan.base_dims(p), p.num_hidden_layers, spec.parallelism.tp)
    if problems:
        return FAIL, "; ".join(problems)
    assert setup is not None
    ranks = ", ".join(f"{a.name} r{a.rank}" for a in setup.adapters) or "none named (sent per request)"
    return PASS, (f"adapters {ranks}; max_lora_rank {setup.max_lora_rank}, modules "
                  f"{' '.join(setup.target_modules)}")


def _short(kind: str, rank: int, pool: lora_plan.Pool, geometry: lora_plan.Pages) -> str:
    # PeftCacheManager's words (peftCacheManager.cpp getMaxNumSlots' checks), then where the slots came from
    return (f"rank {rank}: Not enough space allocated to {kind} LoRA cache to hold 1 max sized LoRA {pool.slots} < "
            f"{geometry.min_total_slots} ({pool.budget} buys {pool.slots} slots of {geometry.page_width} values; one "
            f"rank-{geometry.max_adapter_size} adapter needs {geometry.min_total_slots})")


@check("lora.cache", SERVING,
       "the LoRA host cache, and on a GPU the device cache, must hold one max-size adapter or the model load fails "
       "(TensorRT-LLM peftCacheManager.cpp getMaxNumSlots: \"Not enough space allocated to host LoRA cache to hold "
       "1 max sized LoRA\")")
def _cache(ctx: Context):
    spec = ctx.spec
    if not spec.lora.enabled:
        return OFF
    m = ctx.memory
    if m is None:
        return SKIP, "no memory plan (see gpu.known, tp.heads, pp.layers)"
    if any(r.lora is None for r in m.ranks):
        return SKIP, "the adapters are not resolved (see lora.adapters)"
    caches = [(r.rank, r.lora) for r in m.ranks if r.lora is not None]
    cache = spec.lora.cache
    for rank, c in caches:
        g = c.geometry
        need = g.min_total_slots * g.page_width * DTYPE_BYTES[c.dtype]
        if not c.host.enough:
            return FAIL, (_short("host", rank, c.host, g) + f"; raise lora.cache.host_memory_bytes to at least {need}"
                          + (" (or lora.cache.max_cpu_loras)" if cache.max_cpu_loras is not None else "")
                          + " or lower lora.max_lora_rank / lora.cache.max_adapter_size")
        if c.device is not None and not c.device.enough:
            fraction = need / c.after_kv_bytes if c.after_kv_bytes > 0 else None
            fix = (f"raise lora.cache.gpu_memory_fraction to at least {fraction:.3g}" if fraction is not None
                   and fraction <= 1 else "leave more GPU memory after the KV cache (lower "
                   "serving.kv_cache_free_gpu_mem_fraction)")
            return FAIL, _short("device", rank, c.device, g) + f"; {fix} or lower lora.max_lora_rank"
        if c.device is not None and c.device.nbytes > c.after_kv_bytes:
            return FAIL, (f"rank {rank}: the LoRA device cache for {c.device.budget} takes {size_text(c.device.nbytes)}, "
                          f"more than the {size_text(c.after_kv_bytes)} the KV cache leaves; lower lora.cache.max_loras or "
                          "serving.kv_cache_free_gpu_mem_fraction")
    rank, c = min(caches, key=lambda rc: (rc[1].host.adapters, rc[1].device.adapters if rc[1].device else 0))
    held = f"host {size_text(c.host.nbytes)} holds {c.host.adapters}"
    if c.device is not None:
        held += f", device {size_text(c.device.nbytes)} holds {c.device.adapters}"
    text = (f"rank {rank}: {held} max-size adapters (rank {c.geometry.max_adapter_size}, "
            f"{size_text(c.max_adapter_bytes)} each)")
    if target_of(spec).path == ENGINE_FLOW and (cache.max_loras is not None or cache.max_cpu_loras is not None):
        return WARN, (text + "; lora.cache.max_loras / max_cpu_loras are LLM-API settings the engine path ignores "
                      "(size its caches with gpu_memory_fraction and host_memory_bytes)")
    return PASS, text
