"""The checkpoint's config.json: TensorRT-LLM's PretrainedConfig and QuantConfig
(tensorrt_llm/models/modeling_utils.py), LLaMAConfig / QWenConfig
(tensorrt_llm/models/{llama,qwen}/config.py) and Mapping (tensorrt_llm/mapping.py).

Every field a Llama-family model uses is written explicitly because several
TensorRT-LLM code defaults are wrong for Llama (hidden_act "gelu",
position_embedding_type "learned_absolute"), and the key set is checked
against an allow-list because TensorRT-LLM silently accepts misspelt keys.
"""

from __future__ import annotations

from toolchain.archs.common import Family
from toolchain.archs.params import ArchParams

# Phi3Config's own keys (tensorrt_llm/models/phi3/config.py): rotary_pct always, the longrope ones with long_rope.
PHI3_KEYS = frozenset({"rotary_pct", "original_max_position_embeddings", "longrope_scaling_short_factors",
                       "longrope_scaling_long_factors"})
TOP_LEVEL_KEYS = PHI3_KEYS | frozenset({
    "architecture", "dtype", "logits_dtype", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_size", "intermediate_size", "hidden_act",
    "norm_epsilon", "position_embedding_type", "max_position_embeddings", "rotary_base", "rotary_scaling",
    "attn_bias", "mlp_bias", "use_parallel_embedding", "embedding_sharding_dim", "tie_word_embeddings",
    "qk_layernorm", "mapping", "quantization",
    # family extras: Qwen2 (QWenConfig) and MoE families, runtime defaults
    "qwen_type", "seq_length", "moe", "runtime_defaults",
    # Qwen MoE's expert widths (QWenConfig.from_hugging_face passes them as PretrainedConfig extras)
    "moe_intermediate_size", "moe_shared_expert_intermediate_size",
})
# Gemma 2 (GemmaConfig.to_dict: Gemma2ConfigGroup and inter_layernorms, tensorrt_llm/models/gemma/config.py)
GEMMA2_KEYS = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                         "inter_layernorms"})
# Gemma 3 adds Gemma3ConfigGroup's own fields (tensorrt_llm/models/modeling_utils.py; GemmaConfig.to_dict)
GEMMA3_KEYS = frozenset({"_sliding_window_pattern", "rope_local_base_freq", "sliding_window"})
# DeepSeek-V3's MLA ranks, dense layers and routing groups: this toolchain's own section (archs/deepseek_v3.py)
DEEPSEEK_V3_KEYS = frozenset({"deepseek_v3"})
# gpt-oss's clamped SwiGLU constants (archs/gpt_oss.py; the CPU stand-in's own checkpoint, no upstream one)
GPT_OSS_KEYS = frozenset({"swiglu_alpha", "swiglu_limit"})
# Llama 4 (no upstream engine checkpoint: the CPU engine's own keys, transformers' names; archs/llama4.py)
LLAMA4_KEYS = frozenset({"moe_layers", "no_rope_layers", "attention_chunk_size", "use_qk_norm",
                         "attn_temperature_tuning", "floor_scale", "attn_scale"})
FAMILY_KEYS = DEEPSEEK_V3_KEYS | GPT_OSS_KEYS | LLAMA4_KEYS
TOP_LEVEL_KEYS = TOP_LEVEL_KEYS | GEMMA2_KEYS | GEMMA3_KEYS | FAMILY_KEYS
REQUIRED_KEYS = TOP_LEVEL_KEYS - {"qwen_type", "seq_length", "moe", "runtime_defaults", "moe_intermediate_size",
                                  "moe_shared_expert_intermediate_size"} - GEMMA2_KEYS - GEMMA3_KEYS - PHI3_KEYS \
    - FAMILY_KEYS
RUNTIME_DEFAULT_KEYS = frozenset({"max_attention_window", "sink_token_length"})
MAPPING_KEYS = frozenset({"world_size", "tp_size", "pp_size", "cp_size", "moe_tp_size", "moe_ep_size",
                          "moe_cluster_size", "gpus_per_node"})
QUANT_KEYS = frozenset({"quant_algo", "kv_cache_quant_algo", "group_size", "has_zero_point", "pre_quant_scale",
                        "smoothquant_val", "clamp_val", "use_meta_recipe", "exclude_modules"})


def build_mapping(tp: int, pp: int, moe: tuple[int, int] | None = None) -> dict:
    """TensorRT-LLM's Mapping (tensorrt_llm/mapping.py) with cp = 1; `moe` is (moe_tp, moe_ep), default
    (tp, 1) as Mapping derives it, so moe_tp x moe_ep x moe_cluster = tp holds. The keys are Mapping's
    constructor arguments; modelopt's golden files write only world/tp/pp
    (open point: not verified against a 1.2 `trtllm-build` here)."""
    moe_tp, moe_ep = moe or (tp, 1)
    return {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1,
            "moe_tp_size": moe_tp, "moe_ep_size": moe_ep, "moe_cluster_size": 1, "gpus_per_node": 8}


def build_config(family: Family, params: ArchParams, *, dtype: str, tp: int, pp: int,
                 use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                 moe: tuple[int, int] | None = None) -> dict:
    config = {
        "architecture": params.architecture,
        "dtype": dtype,
        # PretrainedConfig defaults to float32; modelopt's golden exports write the model dtype
        # instead (open point: both build; float32 logits are the safer choice).
        "logits_dtype": "float32",
        "vocab_size": params.vocab_size,  # unpadded, even though lm_head rows are padded (PretrainedConfig)
        "hidden_size": params.hidden_size,
        "num_hidden_layers": params.num_hidden_layers,  # full model, not per stage
        "num_attention_heads": params.num_attention_heads,
        "num_key_value_heads": params.num_key_value_heads,  # the HF count, not the duplicated one
        "head_size": params.head_size,
        "intermediate_size": params.intermediate_size,
        "hidden_act": params.hidden_act,
        "norm_epsilon": params.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": params.max_position_embeddings,
        "rotary_base": params.rope_theta,
        "rotary_scaling": params.rotary_scaling,
        "attn_bias": params.attention_bias,
        "mlp_bias": params.mlp_bias,
        "use_parallel_embedding": use_parallel_embedding,
        "embedding_sharding_dim": embedding_sharding_dim,
        "tie_word_embeddings": params.tie_word_embeddings,  # informational: lm_head.weight is always written
        "qk_layernorm": params.qk_layernorm,
        "mapping": build_mapping(tp, pp, moe),
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if params.sliding_window is not None:
        # Not a model field in TensorRT-LLM: PretrainedConfig.runtime_defaults
        # (RuntimeDefaults: max_attention_window, a list repeated over the layers)
        # is what the runtime falls back to for the attention window, and the
        # CPU engine reads the same key. Triton's `max_attention_window_size`
        # overrides it per deployment (tensorrtllm_backend docs/model_config.md).
        config["runtime_defaults"] = {"max_attention_window": [params.sliding_window]}
    if family.config_extra is not None:
        config.update(family.config_extra(params))
    validate_config(config)
    return config


def validate_config(config: dict) -> None:
    """Raise on keys outside the allow-lists or missing required keys. These are
    converter bugs (the config is generated), so they are not ToolchainErrors."""
    unknown = sorted(set(config) - TOP_LEVEL_KEYS)
    missing = sorted(REQUIRED_KEYS - set(config))
    unknown += [f"mapping.{k}" for k in sorted(set(config.get("mapping", {})) - MAPPING_KEYS)]
    unknown += [f"quantization.{k}" for k in sorted(set(config.get("quantization", {})) - QUANT_KEYS)]
    unknown += [f"runtime_defaults.{k}" for k in sorted(set(config.get("runtime_defaults", {})) - RUNTIME_DEFAULT_KEYS)]
    if unknown or missing:
        raise ValueError(f"checkpoint config.json: unknown keys {unknown}, missing keys {missing}")
    m = config["mapping"]
    if m["world_size"] != m["tp_size"] * m["pp_size"] * m.get("cp_size", 1):
        raise ValueError(f"checkpoint config.json: mapping world_size {m['world_size']} != tp x pp x cp")
    if m["moe_tp_size"] * m["moe_ep_size"] * m["moe_cluster_size"] != m["tp_size"]:
        raise ValueError(f"checkpoint config.json: mapping moe_tp x moe_ep x moe_cluster != tp_size {m['tp_size']}")
