"""What a parameter of a filled repository means: its value typed as the model that reads it parses it, or the
default that model applies where it is unset, so two repositories compare by effect, not by spelling.

The tensorrt_llm model's parameters are typed and defaulted by the C++ backend's own rules (triton/backend_params.py,
from facts/backend_parameters.json), then by the documented defaults the toolchain writes explicitly
(engine/trtllm.py TRITON_DEFAULTS, tensorrtllm_backend docs/model_config.md). The Python models' defaults are
those of their model.py (UNVERIFIED: read from tensorrtllm_backend's all_models/inflight_batcher_llm/*/1/model.py
as remembered, not from a stored file).
"""

from __future__ import annotations

import os
from typing import Any

from toolchain.engine.trtllm import TRITON_DEFAULTS
from toolchain.importer.repo import ENGINE_MODEL, Model
from toolchain.triton.backend_params import PARSERS, parameters

# Unset in tensorrt_llm, where the C++ backend passes "no value" on and the executor picks: the defaults
# tensorrtllm_backend docs/model_config.md states (read at v0.21.0, the docs' last tag in this repository's mirror;
# not re-read at 1.2.1): kv_cache_free_gpu_mem_fraction 0.9, batch_scheduler_policy guaranteed_no_evict,
# decoding_mode top_k_top_p at max_beam_width 1 and beam_search above, max_attention_window_size the engine's
# max_sequence_length.
EXECUTOR_DEFAULTS: dict[str, Any] = {"kv_cache_free_gpu_mem_fraction": 0.9,
                                     "batch_scheduler_policy": "guaranteed_no_evict"}
PYTHON_DEFAULTS: dict[tuple[str, str], Any] = {
    ("preprocessing", "add_special_tokens"): True,
    ("postprocessing", "skip_special_tokens"): True,
    ("tensorrt_llm_bls", "accumulate_tokens"): False,
    ("tensorrt_llm_bls", "tensorrt_llm_model_name"): ENGINE_MODEL,
}
# Spellings the reader maps to one behaviour: the backend's getBatchingTypeFromParams (model_instance_state.cc)
# takes inflight_batching and inflight_fused_batching both as executor::BatchingType::kINFLIGHT (UNVERIFIED at
# 1.2.1: read from the backend's source as remembered, not from a stored file).
SAME_EFFECT: dict[tuple[str, str], dict[Any, Any]] = {
    (ENGINE_MODEL, "gpt_model_type"): {"inflight_batching": "inflight_fused_batching"},
}
_BACKEND = {p.name: p for p in parameters()}
_WORDS = {"true": True, "false": False}


def typed(template: str, key: str, text: str) -> Any:
    """`text` as its reader parses it (a path normalised, a list without blanks)."""
    if template == ENGINE_MODEL and key in _BACKEND:
        parse = _BACKEND[key].parse
        if parse in ("int_list", "int_list_list"):
            return text.replace(" ", "")
        if parse != "string":
            try:
                return PARSERS[parse](text)
            except ValueError:
                return text
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return os.path.normpath(text) if text.startswith("/") else text


def default(model: Model, key: str, beam_width: int = 1, max_seq_len: int | None = None) -> Any:
    """The value `model` applies where `key` is unset; None where it has none (the feature is off). The
    attention window defaults to the engine's max_seq_len (engine/trtllm.py TRITON_UNSET)."""
    if model.template == ENGINE_MODEL:
        if key == "max_attention_window_size" and max_seq_len is not None:
            return str(max_seq_len)
        if key == "decoding_mode":
            return "beam_search" if beam_width > 1 else "top_k_top_p"
        if key in EXECUTOR_DEFAULTS:
            return EXECUTOR_DEFAULTS[key]
        p = _BACKEND.get(key)
        found = p.default if p is not None else None
        return found if found is not None else TRITON_DEFAULTS.get(key)
    return PYTHON_DEFAULTS.get((model.template, key))


def effective(model: Model, key: str, beam_width: int = 1, max_seq_len: int | None = None) -> Any:
    """The value `model` runs with: the parameter typed, or its default where unset."""
    text = model.param(key)
    return default(model, key, beam_width, max_seq_len) if text is None else typed(model.template, key, text)


def same_effect(template: str, key: str, a: Any, b: Any) -> bool:
    """Two different values of `key` that its reader treats alike."""
    canon = SAME_EFFECT.get((template, key), {})
    return canon.get(a, a) == canon.get(b, b)
