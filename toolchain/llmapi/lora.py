"""LoRA on the LLM-API path (PyTorch backend, TensorRT-LLM 1.2.1), for `CpuLLM` and the OpenAI server.

Upstream's user-facing pieces, mirrored by name:
- `LoraConfig` (tensorrt_llm/lora_helper.py, a dataclass re-exported by tensorrt_llm/lora_manager.py) and
  `PeftCacheConfig` (tensorrt_llm/llmapi/llm_args.py, a StrictBaseModel): LLM()'s `lora_config` and
  `peft_cache_config`; an unknown key is refused, as the dataclass' constructor and extra="forbid" refuse it.
- `LoRARequest` (tensorrt_llm/executor/request.py, 1.1/1.2-era): one request's adapter, named by `lora_int_id`, read
  from `lora_path` on first use. Its existence check runs at construction, as upstream's `__post_init__` does.

Adapters load lazily, once per lora_int_id, as the PyTorch worker does (tensorrt_llm/executor/base_worker.py
`_enqueue_request` -> `_load_lora_adapter`, which skips an id already loaded): the PEFT directory is read
(`toolchain.checkpoint.lora.read_adapter`), lora_B scaled by PEFT's alpha / r (lora_manager.py `load_from_hf`
folds the scale into "out"), cast to the engine dtype and put in the engine's LoRA cache under the id; the
request then runs with `lora_task_id` = lora_int_id. An id evicted from the cache is read again from its path
(resource_manager.py `PeftCacheManager.add_request_peft` reloads by `py_lora_path`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from toolchain.errors import ToolchainError

log = logging.getLogger(__name__)

LORA_CKPT_SOURCES = ("hf", "nemo")


@dataclass(slots=True)
class LoRARequest:
    """Request for a LoRA adapter (tensorrt_llm/executor/request.py `LoRARequest`, the 1.2-era one with
    lora_ckpt_source): the same fields, defaults, checks and error texts."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self):
        if self.lora_path is not None and not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")
        if self.lora_ckpt_source not in LORA_CKPT_SOURCES:
            raise ValueError(f"lora_ckpt_source must be 'hf' or 'nemo', got '{self.lora_ckpt_source}'")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def ckpt_source(self) -> str:
        return self.lora_ckpt_source


@dataclass
class LoraConfig:
    """LLM()'s `lora_config` (tensorrt_llm/lora_helper.py `LoraConfig` @037d4ba1): the fields every stored 1.x
    version has. The gate/up swap flag is left out: its name differs between the versions read (swap_gate_up_proj,
    swap_gate_up_proj_lora_b_weight, lora_weights_converters; UNVERIFIED which 1.2.1 has) and it only touches a fused
    gate_up_proj, which PEFT adapters of the Llama families this path serves do not have."""

    lora_dir: list[str] = field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=list)
    trtllm_modules_to_hf_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None


@dataclass
class PeftCacheConfig:
    """LLM()'s `peft_cache_config` (tensorrt_llm/llmapi/llm_args.py `PeftCacheConfig`, extra="forbid"), with its
    defaults. The CPU engine reads host_cache_size; the rest size GPU pages and workers."""

    num_host_module_layer: int = 0
    num_device_module_layer: int = 0
    optimal_adapter_size: int = 8
    max_adapter_size: int = 64
    num_put_workers: int = 1
    num_ensure_workers: int = 1
    num_copy_streams: int = 1
    max_pages_per_block_host: int = 24
    max_pages_per_block_device: int = 8
    device_cache_percent: float = 0.02
    host_cache_size: int = 1024**3
    lora_prefetch_dir: str | None = None


LORA_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(LoraConfig))
PEFT_CACHE_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(PeftCacheConfig))


def section_problem(key: str, value: Any) -> str | None:
    """Why `lora_config` / `peft_cache_config` (the YAML mapping) would be refused by upstream's class, or None."""
    fields = {"lora_config": LORA_CONFIG_FIELDS, "peft_cache_config": PEFT_CACHE_CONFIG_FIELDS}[key]
    if value is None or isinstance(value, (LoraConfig, PeftCacheConfig)):
        return None
    if not isinstance(value, dict):
        return f"{key} must be a mapping, got {type(value).__name__}"
    import difflib

    for sub in value:
        if sub not in fields:
            close = difflib.get_close_matches(str(sub), fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            return f"unknown key '{key}.{sub}' (TensorRT-LLM 1.2: {key} has no such field{hint})"
    return None


def _section_of(key: str, cls, value):
    """`value` (None, an instance of `cls` or the YAML mapping) as `cls`; ValueError (one line) for unknown keys."""
    if value is None or isinstance(value, cls):
        return value
    problem = section_problem(key, value)
    if problem:
        raise ValueError(problem)
    return cls(**value)


def lora_config_of(value: LoraConfig | dict | None) -> LoraConfig | None:
    """LLM()'s lora_config as the dataclass; ValueError (one line) for unknown keys or a bad source."""
    cfg = _section_of("lora_config", LoraConfig, value)
    if cfg is not None and cfg.lora_ckpt_source not in LORA_CKPT_SOURCES:  # LoraConfig.__post_init__'s assert
        raise ValueError(f"lora_ckpt_source must be one of 'hf' or 'nemo', got {cfg.lora_ckpt_source}")
    return cfg


def engine_lora_section(lora_config: LoraConfig | dict | None, peft: PeftCacheConfig | dict | None,
                        model_dir: Path | None = None, dtype: str = "auto") -> dict | None:
    """The spec `lora` section of the CPU engine these LLM() arguments ask for (None: no LoRA), or ValueError.

    Target modules as the PyTorch executor settles them (tensorrt_llm/_torch/pyexecutor/_util.py
    `create_py_executor_instance`): given, or read from the one lora_dir (`load_torch_hf_lora`), q/k/v completed.
    With neither, upstream takes all twelve default modules, MoE ones among them (llm_args.py
    validate_lora_config_consistency), which a dense CPU model cannot carry: refused instead. max_cpu_loras, when
    set, sizes the host cache instead of host_cache_size, as the executor does (`num_host_module_layer =
    max_lora_rank * num_lora_modules * max_cpu_loras`, _util.py): room for that many adapters of max_lora_rank on
    every target module of every layer of the model in `model_dir`."""
    from toolchain.checkpoint.lora_setup import adapter_info, with_missing_qkv  # imports torch

    cfg = lora_config_of(lora_config)
    cache = _section_of("peft_cache_config", PeftCacheConfig, peft) or PeftCacheConfig()
    if cfg is None:
        return None
    if cfg.lora_ckpt_source != "hf":
        raise ValueError("lora_config.lora_ckpt_source 'nemo': the CPU engine reads Hugging Face PEFT adapters only; "
                         "set lora_ckpt_source: hf")
    modules = list(cfg.lora_target_modules)
    if not modules and len(cfg.lora_dir) == 1:
        try:
            modules = list(adapter_info("lora_dir", 0, Path(cfg.lora_dir[0])).modules)
        except ToolchainError as err:
            raise ValueError(f"lora_config.lora_dir: {err}") from None
    if not modules:
        raise ValueError("lora_config needs lora_target_modules (or exactly one lora_dir to read them from): "
                         "upstream would otherwise expect every default LoRA module, MoE ones included")
    dense = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h")  # spec_lora.LoraModule
    other = [m for m in modules if m not in dense]
    if other:
        raise ValueError(f"lora_config.lora_target_modules {other} are not LoRA modules the CPU engine carries (the "
                         f"dense decoder's: {', '.join(dense)})")
    if cache.lora_prefetch_dir is not None:  # llm_args.py validate_peft_cache_config
        raise ValueError(f"lora_prefetch_dir was set to '{cache.lora_prefetch_dir}' while LoRA prefetch is not supported")
    modules = list(with_missing_qkv(modules))
    host = cache.host_cache_size
    if cfg.max_cpu_loras is not None and model_dir is not None:
        host = cfg.max_cpu_loras * adapter_bytes(model_dir, modules, cfg.max_lora_rank, dtype)
    return {"target_modules": modules, "max_lora_rank": cfg.max_lora_rank,
            "cache": {"host_memory_bytes": host, "optimal_adapter_size": cache.optimal_adapter_size,
                      "max_adapter_size": cache.max_adapter_size, "max_loras": cfg.max_loras,
                      "max_cpu_loras": cfg.max_cpu_loras}}


def adapter_bytes(model_dir: Path, modules: Sequence[str], rank: int, dtype: str = "auto") -> int:
    """Bytes of one adapter of `rank` on `modules` of every layer of the HF model in `model_dir`, in the engine dtype
    (`dtype`, or config.json's): what the CPU engine's LoRA cache counts for it (A [r, in] + B [out, r] per module)."""
    import json

    from toolchain.checkpoint.lora import module_dims  # imports torch

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    dims = module_dims(cfg["hidden_size"], cfg["intermediate_size"], heads, cfg.get("num_key_value_heads") or heads,
                       cfg.get("head_dim") or cfg["hidden_size"] // heads)
    stored = dtype if dtype != "auto" else str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    itemsize = 4 if stored == "float32" else 2
    return cfg["num_hidden_layers"] * sum(rank * sum(dims[m]) for m in modules) * itemsize


class AdapterLoader:
    """Puts each LoRARequest's adapter in `engine.lora` on its first use (per lora_int_id) and returns the task id
    the request runs with. `loads` counts the reads from disk (a test sees lazy, once-per-id loading)."""

    def __init__(self, engine):
        self.engine = engine
        self.loads = 0
        self._lock = threading.Lock()

    def task_id(self, request: LoRARequest | None) -> int | None:
        """The engine task id for `request` (None: the base model); ValueError in one line when it cannot run."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        cache = getattr(self.engine, "lora", None)
        if cache is None:
            raise ValueError(f"lora_request {request.lora_name!r}: this LLM was created without lora_config, so it "
                             "serves no adapters; create it with lora_config (spec: lora)")
        if request.lora_ckpt_source != "hf":
            raise ValueError(f"lora_request {request.lora_name!r}: lora_ckpt_source 'nemo' is not read by the CPU "
                             "engine, which loads Hugging Face PEFT adapters; send lora_ckpt_source 'hf'")
        task = int(request.lora_int_id)
        with self._lock:
            if not cache.has(task):
                try:
                    cache.put_converted(task, self._read(request))
                except ToolchainError as err:  # the cache's checks (rank, modules, shapes) and "PEFT Cache is full"
                    raise ValueError(f"lora_request {request.lora_name!r}: {err}") from None
                self.loads += 1
        return task

    def _read(self, request: LoRARequest):
        import torch

        from toolchain.checkpoint.lora import read_scaled

        try:
            weights = read_scaled(Path(request.lora_path))
        except ToolchainError as err:
            raise ValueError(f"lora_request {request.lora_name!r}: {err}") from None
        dtype = getattr(self.engine.lora, "dtype", torch.float32)
        targets = set(getattr(self.engine.lora, "target_modules", ()) or ())
        out = {}
        for (layer, module), (a, b) in weights.items():
            if targets and module not in targets:
                # lora_manager.py load_from_hf: "LoRA module '...' not in target modules ..., skipping." (a warning)
                log.warning("LoRA module '%s' not in target modules %s, skipping.", module, sorted(targets))
                continue
            out[(layer, module)] = (a.to(dtype), b.to(dtype))
        return out


def requests_for(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                 count: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt: LLM.generate takes one for all or a list aligned with the prompts."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    requests = list(lora_request)
    if len(requests) != count:
        raise ValueError(f"lora_request has {len(requests)} entries for {count} prompts; give one per prompt")
    return requests
