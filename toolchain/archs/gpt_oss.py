"""gpt-oss (gpt-oss-20b, gpt-oss-120b): HF GptOssForCausalLM, served by TensorRT-LLM's PyTorch backend only.

Paths. TensorRT-LLM 1.2's trtllm-build has no MODEL_MAP entry for it (tensorrt_llm/models/__init__.py lists no
GptOssForCausalLM), so the engine path is refused (`engine_refusal`); the PyTorch backend registers it
(_torch/models/modeling_gpt_oss.py, `@register_auto_model("GptOssForCausalLM")`) and loads the HF checkpoint as it
is. There is no upstream engine checkpoint for it: the names below are the CPU stand-in's own (target llmapi-cpu
converts with this table and the CPU engine runs the result), chosen to read like the other families' (Llama's
attention, the MoE families' router and fc/proj stacks) plus `attention.sinks`, `mlp.router.bias`, `mlp.fc.bias`
and `mlp.proj.bias`.

What the model computes (transformers models/gpt_oss/modeling_gpt_oss.py, the parity reference):
- attention: GQA with q/k/v/o biases (attention_bias, true by default), scale head_dim^-0.5, a learned sink
  logit per q head in each softmax denominator (`sinks`, no value attached: eager_attention_forward), layers
  sliding (window `sliding_window`, 128) or full per `layer_types` (default: even layers slide), YaRN rope
  (rope_parameters / rope_scaling, rope_theta 150000; truncate false in the released configs). The rotation
  is transformers' `_apply_rotary_emb`: halves (i, i + d/2) rotated together, i.e. rope_gpt_neox.
- MoE every layer: a biased router, top-k of the logits then softmax over the k (= softmax, top-k,
  renormalised), experts with biased fused gate_up and down, the clamped SwiGLU
  `(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)` with g = min(gate, l), alpha 1.702, l = swiglu_limit (7.0);
  the down bias is added before the routing weight.

TensorRT-LLM's model (notes/i36-facts.md §1.4, a stored version of modeling_gpt_oss.py; which one is 1.2.1's is
UNVERIFIED) constrains what LLM() serves, so the LLM-API path refuses: pipeline parallelism (`assert
mapping.pp_size == 1`), tp above num_key_value_heads (its HF loader duplicates no KV heads; conservative), swiglu
constants other than the ones it hard-codes (alpha 1.702, limit 7.0), and any quantization here but the MXFP4
experts the released checkpoints store (quant/formats.py MXFP4; attention, router, embeddings and lm_head bf16). Its sliding window is `pretrained_config.sliding_window if layer_idx % 2 == 0`,
`layer_types` unread, so a config whose layer_types are not that alternation is refused at normalisation: every
path (the stand-in included) would misread it.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any

from toolchain.archs import moe
from toolchain.archs.common import Decoder, Family, Refusal, Row, Shard
from toolchain.archs.llama import L, T, llama_rows
from toolchain.archs.params import as_window
from toolchain.errors import ToolchainError

ARCHITECTURE = "GptOssForCausalLM"
X = f"{L}.mlp.experts"

ROWS = (
    *moe.with_experts(
        llama_rows(),
        # Float32 like every MoE router here (archs/mixtral.py); upstream's gate is a biased Linear in the model
        # dtype, which the float32 copy holds exactly.
        Row(f"{L}.mlp.router.weight", f"{T}.mlp.router.weight", Shard.REPLICATE, dtype="float32", shape=("E", "H")),
        Row(f"{L}.mlp.router.bias", f"{T}.mlp.router.bias", Shard.REPLICATE, dtype="float32", shape=("E",)),
        Row(f"{X}.gate_up_proj", f"{T}.mlp.fc.weight", Shard.STACKED_GATE_UP, shape=("E", "H", "2EI"),
            when="float_experts"),
        Row(f"{X}.gate_up_proj_bias", f"{T}.mlp.fc.bias", Shard.STACKED_GATE_UP, shape=("E", "2EI")),
        Row(f"{X}.down_proj", f"{T}.mlp.proj.weight", Shard.STACKED_DOWN, shape=("E", "EI", "H"), when="float_experts"),
        Row(f"{X}.down_proj_bias", f"{T}.mlp.proj.bias", Shard.STACKED_DOWN, shape=("E", "H")),
        # As released, MXFP4 (transformers integrations/mxfp4.py, notes/i35-facts.md section 6): e2m1 blocks and
        # E8M0 scales, one row per output, kept as stored bytes; the engine checkpoint holds what a quantized
        # linear of the MXFP4 row (quant/formats.py) stores, with the experts in front.
        Row(f"{X}.gate_up_proj_blocks", f"{T}.mlp.fc.weight", Shard.STACKED_GATE_UP_ROWS, dtype="uint8",
            shape=("E", "2EI", "HB", "16"), when="mxfp4_experts"),
        Row(f"{X}.gate_up_proj_scales", f"{T}.mlp.fc.weights_scaling_factor", Shard.STACKED_GATE_UP_ROWS,
            dtype="uint8", shape=("E", "2EI", "HB"), when="mxfp4_experts"),
        Row(f"{X}.down_proj_blocks", f"{T}.mlp.proj.weight", Shard.STACKED_DOWN_ROWS, dtype="uint8",
            shape=("E", "H", "EIB", "16"), when="mxfp4_experts"),
        Row(f"{X}.down_proj_scales", f"{T}.mlp.proj.weights_scaling_factor", Shard.STACKED_DOWN_ROWS, dtype="uint8",
            shape=("E", "H", "EIB"), when="mxfp4_experts"),
    ),
    # One per q head, split over tp with the heads and kept float32, as upstream loads them:
    # `sinks[self.num_heads * self.tp_rank:self.num_heads * (self.tp_rank + 1)]`, a float32 Parameter.
    Row(f"{L}.self_attn.sinks", f"{T}.attention.sinks", Shard.COLUMN, dtype="float32", shape=("NH",)),
)

# transformers' GptOssConfig defaults (configuration_gpt_oss.py) for keys a config.json may omit.
GPT_OSS_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "head_dim": 64,
    "num_key_value_heads": 8,
    "attention_bias": True,
})
DEFAULT_ROPE = MappingProxyType({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096})
DEFAULT_EXPERTS, DEFAULT_TOP_K, DEFAULT_WINDOW = 128, 4, 128
MXFP4 = "mxfp4"  # config.json quant_method of the released checkpoints, and its row's name (quant/formats.py)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GptOssConfig's defaults, and the constants upstream hard-codes
DECODER = Decoder(hidden_act="swiglu", attention_sinks=True, expert_bias=True)
LAYER_TYPES = ("sliding_attention", "full_attention")


def prepare(cfg: dict, origin: str) -> dict:
    """GptOssConfig.__post_init__'s YaRN default where config.json names no rope scaling at all."""
    if cfg.get("rope_scaling") is None and not isinstance(cfg.get("rope_parameters"), dict):
        return {**cfg, "rope_scaling": dict(DEFAULT_ROPE)}
    return cfg


def _count(cfg: dict, keys: tuple[str, ...], default: int, least: int, origin: str) -> int:
    """The first of `keys` config.json sets (transformers' attribute_map spells num_local_experts num_experts)."""
    value = next((cfg[k] for k in keys if cfg.get(k) is not None), default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ToolchainError(f"{origin}: {keys[0]} must be an integer >= {least}, got {value!r}")
    return value


def _number(cfg: dict, key: str, default: float, origin: str) -> float:
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ToolchainError(f"{origin}: {key} must be a positive number, got {value!r}")
    return float(value)


def layer_windows(cfg: dict, layers: int, origin: str) -> list[int | None]:
    """Each layer's window (None: full). Upstream slides layer i when i % 2 == 0 whatever layer_types says, so
    layer_types must be that alternation. A null sliding_window is refused: transformers' sliding layers cannot run
    without one (masking_utils: "Could not find a `sliding_window` argument in the config")."""
    window = as_window(cfg.get("sliding_window", DEFAULT_WINDOW), origin)
    if window is None:
        raise ToolchainError(f"{origin}: {ARCHITECTURE} with sliding_window null",
                             "its even layers slide; set sliding_window (128 in the released models)")
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    types = cfg.get("layer_types")
    if types is not None and types != alternating:
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ToolchainError(f"{origin}: layer_types must list sliding_attention or full_attention for each of "
                                 f"the {layers} layers, got {types!r}")
        raise ToolchainError(f"{origin}: {ARCHITECTURE} layer_types other than sliding on even layers, full on odd",
                             "TensorRT-LLM's gpt-oss slides layer i when i % 2 == 0 and reads no layer_types "
                             "(_torch/models/modeling_gpt_oss.py); only that alternation is served")
    return [window if t == "sliding_attention" else None for t in alternating]


def normalize(cfg: dict, params, origin: str):
    experts = _count(cfg, ("num_local_experts", "num_experts"), DEFAULT_EXPERTS, 2, origin)
    top_k = _count(cfg, ("num_experts_per_tok", "experts_per_token"), DEFAULT_TOP_K, 1, origin)
    if top_k > experts:
        raise ToolchainError(f"{origin}: num_experts_per_tok {top_k} exceeds num_local_experts {experts}")
    if params.rotary_scaling is None or params.rotary_scaling["type"] != "yarn":
        raise ToolchainError(f"{origin}: {ARCHITECTURE} with rope scaling {params.rotary_scaling}",
                             "gpt-oss rotates with YaRN (TensorRT-LLM builds its attention with "
                             "PositionEmbeddingType.yarn); set rope_type yarn")
    if "original_max_position_embeddings" not in params.rotary_scaling:
        raise ToolchainError(f"{origin}: {ARCHITECTURE}'s YaRN rope lacks original_max_position_embeddings",
                             "add it to rope_parameters / rope_scaling (4096 in the released models)")
    windows = layer_windows(cfg, params.num_hidden_layers, origin)
    full = params.max_position_embeddings
    extras: dict[str, Any] = {
        "hidden_act": DECODER.hidden_act,
        "swiglu_alpha": _number(cfg, "swiglu_alpha", SWIGLU_ALPHA, origin),
        "swiglu_limit": _number(cfg, "swiglu_limit", SWIGLU_LIMIT, origin),
    }
    extras["runtime_defaults"] = {"max_attention_window": [w or full for w in windows]}
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == MXFP4:
        extras["mxfp4_experts"] = True  # the MXFP4 rows read the experts (quant/view.py stored_format checks the rest)
    return dataclasses.replace(params, num_experts=experts, top_k=top_k, moe_normalization="renormalize",
                               extras_json=json.dumps(extras, sort_keys=True))


def config_extra(params) -> dict:
    # mxfp4_experts picks the rows (ArchParams.mxfp4_experts); the checkpoint says it in its `quantization` section
    extras = {k: v for k, v in json.loads(params.extras_json or "{}").items() if k != "mxfp4_experts"}
    return {**extras, "moe": moe.config_section(params)}


def quantization_refusal(params, method: str, kv_cache: str, stored: str | None = None) -> Refusal | None:
    """Only the released form is taken quantized: MXFP4 experts as stored (config.json quant_method mxfp4, which the
    view reads as method mxfp4, quant/view.py stored_format); nothing is quantized here."""
    if stored not in (None, MXFP4):
        what = f"a pre-quantized checkpoint ({stored})"
    elif method not in ("none", MXFP4) or (method == MXFP4 and stored):
        what = f"quantization {method}"
    elif kv_cache != "none":
        what = f"quantization.kv_cache {kv_cache}"
    else:
        return None
    return Refusal(f"{what} on {params.architecture} is not supported (only its MXFP4 experts as released are)",
                   "convert the bfloat16 or the released MXFP4 checkpoint with quantization.method none and kv_cache "
                   "none")


def llmapi_refusal(params, tp: int, quantized: bool) -> str | None:
    # `quantized` needs no rule here: quantization_refusal takes nothing but the stored MXFP4 experts.
    extras = json.loads(params.extras_json or "{}")
    if tp > params.num_key_value_heads:
        return (f"{params.architecture} at tp {tp} on the LLM-API path: tp above num_key_value_heads "
                f"{params.num_key_value_heads} (TensorRT-LLM's gpt-oss HF loader duplicates no KV heads); use tp <= "
                f"{params.num_key_value_heads}")
    if (extras.get("swiglu_alpha"), extras.get("swiglu_limit")) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
        return (f"{params.architecture} with swiglu_alpha {extras.get('swiglu_alpha')} / swiglu_limit "
                f"{extras.get('swiglu_limit')} on the LLM-API path: TensorRT-LLM's gpt-oss hard-codes alpha "
                f"{SWIGLU_ALPHA} and limit {SWIGLU_LIMIT} (_torch/models/modeling_gpt_oss.py)")
    return None


FAMILY = Family(
    name="gpt_oss",
    architectures=(ARCHITECTURE,),
    rows=ROWS,
    defaults=GPT_OSS_DEFAULTS,
    config_extra=config_extra,
    prepare=prepare,
    normalize=normalize,
    llmapi_refusal=llmapi_refusal,
    quantization=quantization_refusal,
    decoder=DECODER,
    engine_refusal=("TensorRT-LLM 1.2's trtllm-build has no GptOssForCausalLM (tensorrt_llm/models/__init__.py "
                    "MODEL_MAP); its PyTorch backend serves it (_torch/models/modeling_gpt_oss.py)"),
    pipeline_refusal=("TensorRT-LLM's gpt-oss asserts mapping.pp_size == 1 (_torch/models/modeling_gpt_oss.py: "
                      "\"Pipeline parallelism is not supported.\")"),
)
