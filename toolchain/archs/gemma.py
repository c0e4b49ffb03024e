"""Gemma 2: HF Gemma2ForCausalLM -> TensorRT-LLM checkpoint with `architecture: "Gemma2ForCausalLM"`,
built by TensorRT-LLM's own Gemma implementation (tensorrt_llm/models/gemma/{config,convert,model}.py).

What differs from the Llama table, each read from upstream:
- Norms. HF's Gemma2RMSNorm multiplies by (1 + w); TensorRT-LLM's RmsNorm by w, so the converter stores
  w + 1, computed in float32 (convert.py at 65b31db1, load_gemma_weights: "param = param + 1.0" for
  input/post_attention/pre_feedforward/post_feedforward layernorms, model.norm, q/k norms; the HF parser
  upcasts bfloat16 to float32 first). Transform "plus_one" below.
- Four norms per layer. HfParser.rename_to_trt_llm: post_attention_layernorm -> `post_layernorm`,
  pre_feedforward_layernorm / post_feedforward_layernorm keep their names. GemmaDecoderLayer
  (model.py at 5dedf53b, `inter_layernorms`) applies post_layernorm to the attention output before the
  residual add, pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it.
- Embedding scaled by sqrt(hidden_size) in the graph (GemmaModel.forward), not in the weights.
- Tied head: the HF parser writes `lm_head.weight` from `model.embed_tokens.weight` and has no rule for
  an `lm_head` tensor, so an untied Gemma 2 is refused here.
- Attention scale 1/sqrt(query_pre_attn_scalar) (q_scaling = sqrt(query_pre_attn_scalar)/sqrt(head_size))
  and attention soft-capping (max_attn_value = attn_logit_softcapping); final-logit soft-capping
  tanh(logits / c) * c after lm_head (DecoderModelForCausalLM.forward in modeling_utils.py, for the
  Gemma2ConfigGroup). config.json carries query_pre_attn_scalar, attn_logit_softcapping,
  final_logit_softcapping (Gemma2ConfigGroup) and inter_layernorms (GemmaConfig.to_dict).
- use_parallel_embedding: GemmaConfig.__init__ (config.py at 9df6d722) sets it to `tp_size > 1` whatever
  the checkpoint says, so the converter writes the vocab-sharded embedding at tp > 1 (Family flag).
- Sliding windows. The engine-path Gemma 2 layer is built without `is_local` (only Gemma 3 sets it), so
  the alternating window (HF layer_types; by default layers 0, 2, 4, ... slide) is the runtime's
  per-layer attention window: config.json's runtime_defaults.max_attention_window lists one entry per
  layer (RuntimeDefaults; the CPU engine reads the same key), full layers getting max_position_embeddings.
- RoPE: GemmaConfig.from_hugging_face passes rotary_base = rope_theta and rotary_scaling =
  getattr(hf_config, "rotary_scaling", None), an attribute HF configs do not have, so rope scaling would
  be dropped; a scaled Gemma 2 is refused.
- hidden_act: HF's MLP uses `hidden_activation` (gelu_pytorch_tanh). GemmaConfig copies `hidden_act` verbatim
  from the HF config dict, but the stored functional.py versions' ACT2FN (read: the older one ends with
  'gelu', 'gelu_new', 'gelu_fast' -> gelu, and no 'gelu_pytorch_tanh') would refuse HF's spelling in
  GatedMLP ("unsupported activation function"); their `gelu` is the tanh approximation
  (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), i.e. gelu_pytorch_tanh, so the checkpoint says "gelu".

The LLM-API path refuses Gemma 2 (`llmapi_refusal`): the PyTorch backend of the 1.x releases registers no
Gemma2ForCausalLM. The stored tensorrt_llm/_torch/models/__init__.py of the 1.1/1.2 era (read_file id 130844221:
Gemma3ForCausalLM, Phi3, Qwen3Next, SeedOss, and no Gemma 2) imports no modeling_gemma2, and neither does the
newest stored one (id 54836571092); modeling_gemma2.py (with attention and final soft-caps, `logits_soft_cap`)
exists only in a 2026 tree (at 04d175ac, its header dated 2026), after the 1.2 branch.

Gemma 3 (text) is archs/gemma3.py, which reuses the rows and checks here.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any, Mapping

from toolchain.archs.common import Decoder, Family, Refusal, Row, Shard
from toolchain.archs.llama import L, T, llama_rows
from toolchain.archs.params import as_window
from toolchain.errors import ToolchainError

# The HF norms whose weight is w in HF and 1 + w in the checkpoint.
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


def gemma2_rows() -> tuple[Row, ...]:
    # Llama's lm_head row already takes the embedding when no lm_head tensor is stored (tied_from), as
    # upstream's converter always does for Gemma; normalize refuses untied checkpoints.
    rows = [dataclasses.replace(r, transform="plus_one") if r.hf.endswith(_NORMS) else r for r in llama_rows()]
    return (*rows,
            Row(f"{L}.pre_feedforward_layernorm.weight", f"{T}.pre_feedforward_layernorm.weight", Shard.REPLICATE,
                transform="plus_one", shape=("H",)),
            Row(f"{L}.post_feedforward_layernorm.weight", f"{T}.post_feedforward_layernorm.weight",
                Shard.REPLICATE, transform="plus_one", shape=("H",)))


# transformers' Gemma2Config defaults for keys a config.json may omit.
GEMMA2_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "gelu_pytorch_tanh",
    "head_dim": 256,
    "tie_word_embeddings": True,
})
GEMMA2_FIELDS = MappingProxyType({  # Gemma2Config defaults of the Gemma2ConfigGroup fields
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
})
DEFAULT_WINDOW = 4096
# GemmaDecoderLayer with Gemma2ConfigGroup's fields (tensorrt_llm/models/gemma/model.py, models/modeling_utils.py);
# TensorRT-LLM's gelu is the tanh form (see the module docstring).
DECODER = Decoder(hidden_act="gelu", config_group="Gemma2ConfigGroup")
ACTIVATIONS = ("gelu_pytorch_tanh",)


def positive(cfg: dict, key: str, origin: str, fields: Mapping[str, Any] = GEMMA2_FIELDS) -> float | None:
    """config.json's `key` (absent: the HF config class default in `fields`), a positive number or None."""
    value = cfg.get(key, fields[key])
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ToolchainError(f"{origin}: {key} must be a positive number or null, got {value!r}")
    return value


def layer_windows(cfg: dict, layers: int, origin: str) -> list[int | None]:
    """Each layer's window (None: full attention): HF `layer_types`, else Gemma2Config's default
    pattern (sliding where (i + 1) % 2, i.e. every even layer)."""
    window = as_window(cfg.get("sliding_window", DEFAULT_WINDOW), origin)
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise ToolchainError(f"{origin}: layer_types must list sliding_attention or full_attention for each of "
                             f"the {layers} layers, got {types!r}")
    if window is None and "sliding_attention" in types:
        raise ToolchainError(f"{origin}: layer_types names sliding_attention layers but sliding_window is null")
    return [window if t == "sliding_attention" else None for t in types]


def normalize(cfg: dict, params, origin: str):
    if not params.tie_word_embeddings:
        raise ToolchainError(f"{origin}: Gemma2ForCausalLM with tie_word_embeddings=false",
                             "TensorRT-LLM's Gemma converter writes lm_head from the embedding; only tied "
                             "Gemma 2 checkpoints convert")
    if params.rotary_scaling is not None:
        raise ToolchainError(f"{origin}: Gemma2ForCausalLM with rope scaling {params.rotary_scaling}",
                             "TensorRT-LLM's GemmaConfig drops rope scaling; only unscaled Gemma 2 converts")
    act = cfg.get("hidden_activation") or params.hidden_act
    if act not in ACTIVATIONS:
        raise ToolchainError(f"{origin}: Gemma2ForCausalLM with hidden_activation {act!r}",
                             f"supported: {', '.join(ACTIVATIONS)}")
    if params.attention_bias or params.mlp_bias:
        raise ToolchainError(f"{origin}: Gemma2ForCausalLM with attention_bias or mlp_bias",
                             "TensorRT-LLM's Gemma converter reads no bias tensors")
    scalar = positive(cfg, "query_pre_attn_scalar", origin)
    windows = layer_windows(cfg, params.num_hidden_layers, origin)
    full = params.max_position_embeddings
    extras: dict[str, Any] = {
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": positive(cfg, "attn_logit_softcapping", origin),
        "final_logit_softcapping": positive(cfg, "final_logit_softcapping", origin),
        "inter_layernorms": True,
        "hidden_act": DECODER.hidden_act,
    }
    if any(w is not None for w in windows):
        extras["runtime_defaults"] = {"max_attention_window": [w or full for w in windows]}
    return dataclasses.replace(params, hidden_act=act, extras_json=json.dumps(extras, sort_keys=True))


# Quantization on the engine path: upstream's Gemma converter quantizes weight-only int8/int4 natively
# (GemmaForCausalLM.NATIVE_QUANT_FLOW at 5dedf53b: W8A16, W4A16, plus SmoothQuant plugins) and the rest
# through ModelOpt. Here only the formats that need no calibration convert: the calibration pass runs HF's
# layers Llama-style (embedding unscaled, no soft-caps) and smoothing folds into the norm before each linear,
# which for Gemma's MLP is pre_feedforward_layernorm; both would be wrong for Gemma, so they are refused.
QUANT_METHODS = ("none", "int8_wo", "int4_wo")


def quantization_refusal(params, method: str, kv_cache: str, stored: str | None = None) -> Refusal | None:
    """Why a Gemma 2 model cannot be quantized as asked (None: it can)."""
    hint = "set quantization.method to none, int8_wo or int4_wo and quantization.kv_cache to none"
    if method not in QUANT_METHODS:
        return Refusal(f"quantization {method} on {params.architecture} is not supported yet (only int8_wo, "
                       "int4_wo)", hint)
    if kv_cache != "none":
        return Refusal(f"quantization.kv_cache {kv_cache} on {params.architecture} is not supported yet (it is "
                       "calibrated)", hint)
    if stored:
        return Refusal(f"a pre-quantized {params.architecture} checkpoint ({stored}) is not supported yet",
                       "convert the unquantized model and set quantization.method instead")
    return None


def config_extra(params) -> dict:
    return json.loads(params.extras_json or "{}")


def llmapi_refusal(params, tp: int, quantized: bool) -> str | None:
    return (f"{params.architecture} on the LLM-API path: TensorRT-LLM 1.2's PyTorch backend registers no Gemma 2 "
            "model (tensorrt_llm/_torch/models/__init__.py imports no modeling_gemma2); use the engine path "
            "(target trtllm or cpu)")


FAMILY = Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    rows=gemma2_rows(),
    defaults=GEMMA2_DEFAULTS,
    config_extra=config_extra,
    normalize=normalize,
    parallel_embedding_at_tp=True,
    llmapi_refusal=llmapi_refusal,
    quantization=quantization_refusal,
    decoder=DECODER,
)
