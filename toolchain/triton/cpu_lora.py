"""LoRA requests to the CPU `tensorrt_llm` model (backend_models/tensorrt_llm.py), read by the C++ tensorrtllm
backend's rules and served from the CPU engine's LoRA cache (engine/cpu/lora.py `LoraCache`).

Upstream (NVIDIA/TensorRT-LLM, 1.2 line):
* the cache's parameters: model_instance_state.cc `getPeftCacheConfigFromParams` (lora_cache_host_memory_bytes,
  default 1 GiB; lora_prefetch_dir, whose digit-named sub-folders PeftCacheManager `prefetchLoraWeights` loads as
  task ids when the model loads);
* a request's tensors: utils.cc `getLoraConfigFromTensors` reads LoRA only when `lora_task_id` is present (weights or
  config without it are ignored: the base model runs), squeezes the batch dim off `lora_weights` / `lora_config`,
  and `executor::LoraConfig` (loraConfig.cpp) checks their shapes, in its own words;
* on enqueue, PeftCacheManager `addRequestPeft`: weights + config are put in the cache (an id already cached keeps
  its weights), a task id alone needs the id cached ("LoRA task <id> not found in cache. Please send LoRA weights
  with request") and is bumped; the executor answers a LoRA exception with an error response for that request
  alone (executorImpl.cpp: expected ones, cache miss and cache full, as they are; any other prefixed "Encountered
  an error when fetching new request: "), which the backend's fillTritonResponse sends as "Executor failed process
  requestId <n> due to the following error: <message>".

Nothing here imports Triton: the model hands in its request reader and engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from toolchain.errors import ToolchainError
from toolchain.triton.backend_params import is_unset

# PeftCacheManagerConfig::kDefaultHostCacheSize (peftCacheManagerConfig.h): lora_cache_host_memory_bytes unset.
DEFAULT_HOST_BYTES = 1 << 30
# PeftCacheManager's words for the expected exception a put raises, which the executor sends on as it is
# (LoraCacheFullException, a LoraExpectedException; the other, a cache miss, is `problem`'s).
_EXPECTED = ("PEFT Cache is full",)


class LoraRequestError(ValueError):
    """A LoRA request the executor refuses: its message is what the client receives, whole."""


def executor_error(request_id: int, message: str) -> str:
    """An executor error response as the backend sends it to the client (model_instance_state.cc fillTritonResponse)."""
    return f"Executor failed process requestId {request_id} due to the following error: {message}"


def load_options(values: dict[str, Any], warn: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """CpuEngine.load's LoRA arguments from the parameters as backend_params.read read them (unset: the C++
    defaults). A prefetch dir that is unset or missing is skipped, as prefetchLoraWeights skips it (`warn` hears
    of a missing one, which the C++ logs at debug level)."""
    host = values.get("lora_cache_host_memory_bytes")
    prefetch = values.get("lora_prefetch_dir")
    directory = None if prefetch is None or is_unset(prefetch, "lora_prefetch_dir") else Path(prefetch)
    if directory is not None and not directory.is_dir():
        warn(f"Cannot find the {directory}, skipping prefetching the lora weights.")
        directory = None
    return {"lora_host_bytes": DEFAULT_HOST_BYTES if host is None else int(host), "lora_prefetch_dir": directory}


@dataclass(frozen=True)
class RowLora:
    """One request row's LoRA inputs, its batch dim squeezed off (utils::squeezeTensor)."""

    task_id: int
    weights: np.ndarray | None = None
    config: np.ndarray | None = None


def _squeezed(arr: np.ndarray | None, row: int, batch: int) -> np.ndarray | None:
    if arr is None or arr.size == 0:
        return None
    return arr[row] if arr.ndim == 3 and arr.shape[0] == batch else arr


def row_lora(inputs: Any, row: int) -> RowLora | None:
    """The LoRA of row `row` of a request (`inputs`: the model's reader, with get/scalar/batch), checked as
    executor::LoraConfig checks it; None without lora_task_id (its weights and config are then ignored)."""
    task_id = inputs.scalar("lora_task_id", row, None, int)
    if task_id is None:
        return None
    weights = _squeezed(inputs.get("lora_weights"), row, inputs.batch)
    config = _squeezed(inputs.get("lora_config"), row, inputs.batch)
    if config is not None:
        if config.ndim != 2:
            raise ValueError("Expected config tensor to have 2 dimensions")
        if config.dtype != np.int32:
            raise ValueError("Expected lora config tensor to have type kINT32")
    if weights is not None:
        if config is None:
            raise ValueError("Request for LoRA inference with lora weights must also have lora config")
        if weights.ndim != 2:
            raise ValueError("Expected weights tensor to have 2 dimensions")
        if weights.shape[0] != config.shape[0]:
            raise ValueError("Expected dim 0 of lora weights and lora config to have the same size")
    return RowLora(task_id, weights, config)


def prepare(engine: Any, request_id: int, lora: RowLora) -> None:
    """What PeftCacheManager.addRequestPeft does on enqueue: put the weights sent with the task id, or find the
    task cached and bump it. Raises LoraRequestError with the client's whole message."""
    cache = getattr(engine, "lora", None)
    if cache is None:
        # What the executor does with a task id for an engine without the LoRA plugin is UNVERIFIED: refused.
        raise LoraRequestError(f"tensorrt_llm: lora_task_id {lora.task_id}: this engine was built without LoRA "
                               "(give the spec a lora section and build the engine again)")
    try:
        if lora.weights is None and lora.config is None:
            problem = cache.problem(lora.task_id)
            if problem is not None:
                raise LoraRequestError(executor_error(request_id, problem))
            cache.bump(lora.task_id)
            return
        if lora.weights is None or lora.config is None:  # loraUtils.cpp loraValidateRequestTensorDims
            raise ToolchainError("Request for LoRA inference must have both lora_weights and lora_keys")
        cache.put(lora.task_id, lora.weights[None], lora.config[None])
    except ToolchainError as err:
        message = err.message if err.message.startswith(_EXPECTED) else \
            f"Encountered an error when fetching new request: {err}"
        raise LoraRequestError(executor_error(request_id, message)) from None
