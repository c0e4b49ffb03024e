"""Mistral family: HF MistralForCausalLM -> TensorRT-LLM checkpoint with
`architecture: "MistralForCausalLM"` (MODEL_MAP sends it to the Llama
implementation: TensorRT-LLM tensorrt_llm/models/__init__.py).

The tensors are Llama's. What differs is the sliding window (Mistral 7B
v0.1: 4096; v0.2+ and NeMo: null). It is not a checkpoint tensor or a
TensorRT-LLM model field: the runtime applies it as the attention window, so
it travels as ArchParams.sliding_window and is written to config.json as
`runtime_defaults.max_attention_window` (see toolchain.checkpoint.config).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from toolchain.archs.common import Family
from toolchain.archs.llama import llama_rows
from toolchain.archs.params import as_window

# transformers' MistralConfig defaults for keys a config.json may omit.
MISTRAL_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096 * 32,
    "hidden_act": "silu",
})
# MistralConfig's own default when the key is absent altogether (an explicit
# null means no window, as in Mistral 7B v0.2+).
DEFAULT_WINDOW = 4096


def normalize(cfg: dict, params, origin: str):
    window = as_window(cfg.get("sliding_window", DEFAULT_WINDOW), origin)
    return dataclasses.replace(params, sliding_window=window)


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    rows=llama_rows(),
    defaults=MISTRAL_DEFAULTS,
    normalize=normalize,
)
