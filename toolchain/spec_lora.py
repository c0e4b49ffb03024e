"""The spec's `lora` section: the PEFT adapters one deployment serves beside its base model, the engine's LoRA
limits and the adapter caches.

Names follow the pinned release. The engine path: trtllm-build's `--lora_plugin`, `--max_lora_rank`,
`--lora_target_modules` (tensorrt_llm/commands/build.py), the tensorrt_llm model's `lora_cache_*` parameters
(triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt @0c8de69). The LLM-API path: `LoraConfig`
(`max_lora_rank`, `lora_target_modules`, `max_loras`, `max_cpu_loras`; tensorrt_llm/lora_helper.py) and
`PeftCacheConfig` (`host_cache_size`, `device_cache_percent`, `optimal_adapter_size`, `max_adapter_size`;
tensorrt_llm/llmapi/llm_args.py). What the adapters themselves hold (rank, modules) is read from their files by
`toolchain/checkpoint/lora_setup.py`, not here: the spec loader reads no adapter.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from toolchain.spec_section import Section as _Section

# The dense decoder's LoRA modules (loraModule.h `ModuleType`, tensorrt_llm/lora_manager.py LORA_MODULE_IDS) a
# Llama-style family maps from PEFT's q/k/v/o/gate/up/down_proj (lora_helper.py get_default_trtllm_modules_to_hf_modules).
LoraModule = Literal["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class LoraCacheSection(_Section):
    optimal_adapter_size: int = Field(8, ge=1)
    """Rank one cache page is sized for (tensorrt_llm model `lora_cache_optimal_adapter_size`, PeftCacheConfig
    `optimal_adapter_size`; clamped to max_lora_rank, as PeftCacheManager does)."""
    max_adapter_size: int = Field(64, ge=1)
    """Largest rank a page must fit one row of (`lora_cache_max_adapter_size`, `max_adapter_size`; clamped to
    max_lora_rank)."""
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    """Device cache as a fraction of the GPU memory left after the engine and the KV cache (engine path
    `lora_cache_gpu_memory_fraction`, default 0.05; LLM API `device_cache_percent`, default 0.02)."""
    host_memory_bytes: int = Field(1 << 30, ge=1)
    """Host cache bytes (`lora_cache_host_memory_bytes`, `host_cache_size`; 1 GiB by default)."""
    max_loras: int | None = Field(None, ge=1)
    """LLM-API path: adapters held on the GPU at once (LoraConfig.max_loras); unset sizes the device cache by
    gpu_memory_fraction."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """LLM-API path: adapters held in host memory (LoraConfig.max_cpu_loras); unset sizes it by host_memory_bytes."""


class LoraSection(_Section):
    adapters: dict[str, Path] = Field(default_factory=dict)
    """Adapter name -> Hugging Face PEFT directory (adapter_config.json + adapter_model.safetensors). Each is served
    under its name (the OpenAI `model` field) and, on the engine path, as LoRA task id 1, 2, ... in this order."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Largest adapter rank the engine serves (trtllm-build --max_lora_rank, LoraConfig.max_lora_rank); default:
    the largest rank among the adapters."""
    target_modules: list[LoraModule] | None = None
    """TensorRT-LLM LoRA modules the engine carries (--lora_target_modules, LoraConfig.lora_target_modules);
    default: every module an adapter trains, with attn_q/attn_k/attn_v completed together as upstream does."""
    cache: LoraCacheSection = Field(default_factory=LoraCacheSection)
    """The adapter caches (host and device pools)."""

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, Path]) -> dict[str, Path]:
        bad = [name for name in adapters if not re.match(ADAPTER_NAME, name)]
        if bad:
            raise ValueError(f"lora.adapters names {bad} must start with a letter or digit and hold only letters, "
                             "digits, '.', '_' and '-' (they are served as OpenAI model names)")
        return adapters

    @model_validator(mode="after")
    def _rank_or_adapters(self) -> "LoraSection":
        if not self.adapters and self.target_modules is not None and self.max_lora_rank is None:
            raise ValueError("lora.target_modules without lora.adapters needs lora.max_lora_rank "
                             "(the engine's rank limit cannot be read from adapters it does not have)")
        return self

    @property
    def enabled(self) -> bool:
        """The deployment serves LoRA: adapters are named, or the engine is built for adapters sent per request."""
        return bool(self.adapters) or self.target_modules is not None

    def task_id(self, name: str) -> int:
        """The adapter's LoRA task id (engine path) and lora_int_id (LLM API): its 1-based place in `adapters`.
        0 is avoided: tensorrtllm_backend's client treats task id 0 as no adapter."""
        return list(self.adapters).index(name) + 1
