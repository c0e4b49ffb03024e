"""Qwen2 / Qwen2.5 and Qwen3: HF Qwen2ForCausalLM / Qwen3ForCausalLM ->
TensorRT-LLM QWenForCausalLM checkpoint.

The tensors are Llama's plus:
- Qwen2: q/k/v biases, always (HF has no switch), and no o_proj bias:
  TensorRT-LLM's Qwen attention is built with dense_bias=False.
- Qwen3: no biases, and a per-head RMSNorm on q and k before RoPE
  (`qk_layernorm`). Tensor names `attention.q_layernorm.weight` /
  `attention.k_layernorm.weight`, shape (head_size,), are those of
  TensorRT-LLM's `Attention(qk_layernorm=True)` (tensorrt_llm/layers/attention.py,
  read); that the 1.2 Qwen decoder layer builds its attention that way for
  qwen_type "qwen3" rests on PR #5650 ("Add TensorRT-Engine Qwen3 (dense)
  model support", merged 2025-07), whose diff was not available to read here.
  Open point: confirm with one `trtllm-build` of a Qwen3 checkpoint.

`architecture` is written as the HF name (Qwen2ForCausalLM, Qwen3ForCausalLM),
as TensorRT-LLM's own QWenConfig.from_hugging_face does; modelopt's exporter
writes "QWenForCausalLM" instead. MODEL_MAP maps all of them to the same
class, so either builds; the HF name keeps the source family visible.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from toolchain.archs.common import Decoder, Family
from toolchain.archs.llama import llama_rows
from toolchain.archs.params import as_window
from toolchain.errors import ToolchainError

# transformers' Qwen2Config / Qwen3Config defaults for keys a config.json may
# omit. TensorRT-LLM's QWenConfig falls back to rotary_base 100000 instead, one
# more reason the converter always writes rotary_base.
QWEN_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "hidden_act": "silu",
})
# Every Qwen type builds QWenDecoderLayer, whose attention has no output-projection bias
# (tensorrt_llm/models/qwen/model.py: Attention(..., dense_bias=False)).
QWEN_DECODER = Decoder(dense_bias=False)


def uniform_window(cfg: dict, params, origin: str) -> int | None:
    """The one window every layer uses, or None. Qwen configs describe windows
    per layer (`layer_types`, or `use_sliding_window` from `max_window_layers`
    on); a mix of windowed and full layers is refused rather than flattened."""
    layers = params.num_hidden_layers
    types = cfg.get("layer_types")
    if isinstance(types, list):
        windowed = [t == "sliding_attention" for t in types[:layers]]
    elif cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        first = cfg.get("max_window_layers", layers)
        windowed = [i >= first for i in range(layers)]
    else:
        windowed = []
    if not any(windowed):
        return None
    if not all(windowed) or len(windowed) < layers:
        count = sum(windowed)
        raise ToolchainError(f"{origin}: {count} of {layers} layers use a sliding window and the rest full attention",
                             "only one attention window for every layer is supported")
    return as_window(cfg.get("sliding_window"), origin)


def _qwen2(cfg: dict, params, origin: str):
    # HF Qwen2 always has q/k/v biases; config.json carries no attention_bias key.
    return dataclasses.replace(params, attention_bias=True, sliding_window=uniform_window(cfg, params, origin))


def _qwen3(cfg: dict, params, origin: str):
    if params.attention_bias:
        raise ToolchainError(f"{origin}: Qwen3 with attention_bias=true",
                             "TensorRT-LLM's Qwen attention has no output-projection bias; "
                             "only attention_bias=false Qwen3 checkpoints convert")
    return dataclasses.replace(params, qk_layernorm=True, sliding_window=uniform_window(cfg, params, origin))


def _extra(qwen_type: str):
    def extra(params) -> dict:
        # seq_length is read by QWenConfig only; it defaults to 8192 there (tensorrt_llm/models/qwen/config.py).
        return {"qwen_type": qwen_type, "seq_length": params.max_position_embeddings}
    return extra


QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    rows=llama_rows(qkv_bias=True, dense_bias=False),
    defaults=QWEN_DEFAULTS,
    config_extra=_extra("qwen2"),
    normalize=_qwen2,
    decoder=QWEN_DECODER,
)

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    rows=llama_rows(qkv_bias=False, dense_bias=False, qk_norm=True),
    defaults=QWEN_DEFAULTS,
    config_extra=_extra("qwen3"),
    normalize=_qwen3,
    decoder=QWEN_DECODER,
)
