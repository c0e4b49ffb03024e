"""HF config.json normalised once into a frozen `ArchParams`.

HF spells the same hyper-parameter differently across families and
transformers versions (5.x writes `dtype` and `rope_parameters` where 4.x wrote
`torch_dtype`, `rope_theta` and `rope_scaling`), so every field is read through
an alias list. No stage reads raw HF keys after this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from toolchain.errors import ToolchainError
from toolchain.targets import TARGETS

ALIASES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size", "n_vocab", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "head_dim": ("head_dim", "head_size", "kv_channels"),
    "rms_norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon"),
    "rope_theta": ("rope_theta", "rotary_emb_base", "rotary_base"),
    "rope_scaling": ("rope_scaling",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "seq_length"),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "attention_bias": ("attention_bias",),
    "mlp_bias": ("mlp_bias",),
    "hidden_act": ("hidden_act", "activation_function"),
    "dtype": ("dtype", "torch_dtype"),
}

# Missing and without a family default -> error. Families give the HF config
# class defaults (what transformers itself would load) for the last three.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "rms_norm_eps", "max_position_embeddings", "hidden_act")

# TensorRT-LLM 1.x RotaryScalingType (tensorrt_llm/functional.py) accepts these; "default"
# and "none" mean no scaling and become null.
ROPE_TYPES = ("linear", "dynamic", "longrope", "llama3", "yarn", "mrope")
ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32",
          "float16": "float16", "half": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ArchParams:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_json: str | None
    """Normalised TensorRT-LLM `rotary_scaling` as JSON (kept as text so the dataclass stays immutable)."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    dtype: str | None
    """HF weight dtype ("float32", "float16", "bfloat16"), None when config.json does not say."""
    sliding_window: int | None = None
    """Attention window in tokens (each query sees at most this many keys, itself included), None
    for full attention. Not a TensorRT-LLM checkpoint field: written as runtime_defaults (PretrainedConfig)."""
    qk_layernorm: bool = False
    """RMSNorm over each q and k head before RoPE (Qwen3)."""
    num_experts: int = 0
    """Mixture of experts: routed experts per layer (HF num_local_experts); 0 for a dense model."""
    top_k: int = 0
    """Experts each token is routed to (HF num_experts_per_tok); 0 for a dense model."""
    moe_normalization: str | None = None
    """How the top-k routing weights are scaled (archs.moe.NORMALIZATION): "renormalize" (Mixtral) or
    "none"; None for a dense model."""
    moe_intermediate_size: int = 0
    """Width of each routed expert where the family names it apart from intermediate_size (Qwen MoE's
    moe_intermediate_size); 0: intermediate_size is the expert width (Mixtral)."""
    shared_expert_size: int = 0
    """Width of the shared expert every token runs (Qwen2-MoE's shared_expert_intermediate_size); 0: none."""
    extras_json: str | None = None
    """Family-specific config.json fields as JSON text (Gemma 2's soft-caps and per-layer windows), for its config_extra."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layer_windows(self) -> tuple[int, ...] | None:
        """Each layer's attention window where they differ (config.json runtime_defaults.max_attention_window,
        which Gemma's normalize writes into extras_json); None when every layer attends alike."""
        windows = json.loads(self.extras_json or "{}").get("runtime_defaults", {}).get("max_attention_window")
        return tuple(windows) if windows and len(windows) == self.num_hidden_layers else None

    @property
    def mla(self) -> dict | None:
        """Multi-head latent attention's ranks and head widths (DeepSeek-V3: q_lora_rank, kv_lora_rank,
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim, from extras_json); None for every other attention."""
        return json.loads(self.extras_json or "{}").get("mla")

    @property
    def moe_layers(self) -> tuple[int, ...] | None:
        """The layers whose MLP is a mixture of experts where only some are (Llama 4's moe_layers, which its
        normalize writes into extras_json); None when every layer's MLP is alike."""
        layers = json.loads(self.extras_json or "{}").get("moe_layers")
        return tuple(layers) if layers is not None and self.is_moe else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` holds experts: every layer of a MoE model unless moe_layers says (Llama
        4), and none of the first `first_k_dense_replace` (DeepSeek-V3's dense layers, which extras_json carries)."""
        layers = self.moe_layers
        first_dense = json.loads(self.extras_json or "{}").get("first_k_dense_replace", 0)
        return self.is_moe and layer >= first_dense and (layers is None or layer in layers)

    def is_mtp_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a multi-token-prediction layer convert kept (DeepSeek-V3's, from
        `mtp_from`, the main model's layer count, which checkpoint/mtp.py records in extras_json)."""
        return layer >= json.loads(self.extras_json or "{}").get("mtp_from", self.num_hidden_layers)

    @property
    def mxfp4_experts(self) -> bool:
        """The routed experts are stored in MXFP4 blocks and scales (gpt-oss as released: its normalize writes
        mxfp4_experts into extras_json from config.json's quantization_config); the family's MXFP4 rows read them."""
        return bool(json.loads(self.extras_json or "{}").get("mxfp4_experts"))

    @property
    def float_experts(self) -> bool:
        """The routed experts are stored in the model's float dtype (not `mxfp4_experts`)."""
        return not self.mxfp4_experts

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer holds a dense MLP of intermediate_size (every layer of a dense model)."""
        return not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def shared_expert_gated(self) -> bool:
        """Whether a shared expert is scaled by a sigmoid gate [1, H] (Qwen2-MoE's shared_expert_gate); Llama 4's
        shared expert is added ungated (its normalize writes shared_expert_gate false into extras_json)."""
        return bool(self.shared_expert_size) and json.loads(self.extras_json or "{}").get("shared_expert_gate", True)

    @property
    def expert_size(self) -> int:
        """The routed experts' width, what moe_tp splits."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def norms_per_layer(self) -> int:
        """RMSNorm weights per decoder layer: 2, or 4 with Gemma 2's pre/post feed-forward norms."""
        return 4 if json.loads(self.extras_json or "{}").get("inter_layernorms") else 2

    @property
    def rotary_scaling(self) -> dict | None:
        return json.loads(self.rope_scaling_json) if self.rope_scaling_json is not None else None


_MISSING = object()


def _find(cfg: dict, field: str, origin: str, defaults: dict) -> Any:
    for key in ALIASES[field]:
        if cfg.get(key) is not None:
            return cfg[key]
    if field in defaults:
        return defaults[field]
    if field in REQUIRED:
        raise ToolchainError(
            f"{origin} lacks {field} (looked for {', '.join(ALIASES[field])})",
            "add it to config.json or point model.checkpoint at a complete HF checkpoint",
        )
    return _MISSING


def _as_int(value: Any, field: str, origin: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ToolchainError(f"{origin}: {field} must be an integer >= {minimum}, got {value!r}")
    return value


def _as_float(value: Any, field: str, origin: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ToolchainError(f"{origin}: {field} must be a positive number, got {value!r}")
    return float(value)


def normalize_rope(cfg: dict, origin: str = "config.json") -> tuple[float | None, dict | None]:
    """(rope_theta, rotary_scaling) from either spelling; rotary_scaling as TensorRT-LLM's attention
    reads it (tensorrt_llm/layers/attention.py)."""
    params = cfg.get("rope_parameters")
    theta = None
    scaling = None
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):
            # transformers 5 nests one dict per attention-layer type for hybrid models.
            raise ToolchainError(f"{origin}: per-layer-type rope_parameters ({', '.join(params)}) are not supported",
                                 "only one RoPE setting for all layers can be converted")
        theta = params.get("rope_theta")
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    nested = params if isinstance(params, dict) else {}
    partial = nested.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        # rotary_pct is omitted for the Llama family (LLaMAConfig): rotary dim = head_size.
        raise ToolchainError(f"{origin}: partial_rotary_factor {partial} is not supported",
                             "the Llama family rotates the full head (rotary_dim = head_size)")
    if cfg.get("rope_scaling") is not None:
        scaling = dict(cfg["rope_scaling"]) if isinstance(cfg["rope_scaling"], dict) else cfg["rope_scaling"]
    for key in ALIASES["rope_theta"]:
        if cfg.get(key) is not None:
            theta = cfg[key]
            break
    if scaling is not None and not isinstance(scaling, dict):
        raise ToolchainError(f"{origin}: rope_scaling must be a mapping or null, got {scaling!r}")
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default", "none"):
        return theta, None
    if kind == "su":
        # Older HF name for longrope; TensorRT-LLM only treats "su" like longrope for
        # length deduction (tensorrt_llm/builder.py), so write the enum name it parses (open point:
        # the 1.2 attention enum is not stated to accept "su").
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ToolchainError(f"{origin}: unsupported rope type '{kind}'",
                             f"TensorRT-LLM 1.x accepts {', '.join(ROPE_TYPES)} (or no scaling)")
    missing = [k for k in ROPE_REQUIRED_KEYS.get(kind, ()) if scaling.get(k) is None]
    if missing:
        raise ToolchainError(f"{origin}: rope type '{kind}' lacks {', '.join(missing)}",
                             "add the missing keys to rope_scaling / rope_parameters")
    # Both spellings: the 1.x attention layer reads "type", falling back to "rope_type".
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    return theta, {"type": kind, "rope_type": kind, **out}


def trained_positions(max_position_embeddings: int, rotary_scaling: dict | None) -> int:
    """Positions the model was trained for: max_position_embeddings times the rope
    factor, except for types whose max_position_embeddings already reports the
    long context (llama3, longrope; TensorRT-LLM tensorrt_llm/builder.py, _init_max_seq_len)."""
    scaling = rotary_scaling or {}
    factor = 1.0 if scaling.get("type") in (None, "llama3", "longrope", "su") else float(scaling.get("factor", 1.0))
    return int(max_position_embeddings * factor)


def normalize_dtype(value: Any, origin: str = "config.json") -> str | None:
    if value is None or value is _MISSING:
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise ToolchainError(f"{origin}: unsupported weight dtype '{value}'",
                             "convert float32, float16 or bfloat16 checkpoints")
    return DTYPES[name]


def engine_dtype(requested: str, source: str | None, target: str) -> str:
    """The dtype convert writes and the planner plans. TensorRT-LLM's `infer_dtype`
    (tensorrt_llm/models/convert_utils.py, called by LLaMAConfig.from_hugging_face and the other
    model configs) resolves only "auto": the checkpoint's torch_dtype, float16 when it has none,
    and float32 narrowed to float16 for GPU engines (the target row's `narrows_float32`); an explicit
    dtype is kept as given. Target cpu keeps float32 (fp16 matmuls on a CPU are slow and lossy for no gain)."""
    if requested != "auto":
        return requested
    dtype = source or "float16"
    return "float16" if dtype == "float32" and TARGETS[target].narrows_float32 else dtype


def normalize_params(cfg: dict, family: Any, origin: str = "config.json") -> ArchParams:
    """ArchParams for `cfg`, an HF config.json dict of `family`."""
    defaults = dict(family.defaults)
    if family.prepare is not None:
        cfg = family.prepare(cfg, origin)

    def get(field: str) -> Any:
        return _find(cfg, field, origin, defaults)

    hidden = _as_int(get("hidden_size"), "hidden_size", origin)
    heads = _as_int(get("num_attention_heads"), "num_attention_heads", origin)
    kv = get("num_key_value_heads")
    kv = heads if kv is _MISSING else _as_int(kv, "num_key_value_heads", origin)
    head_dim = get("head_dim")
    if head_dim is _MISSING:
        if hidden % heads:
            raise ToolchainError(f"{origin}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
                                 "add head_dim to config.json")
        head_dim = hidden // heads
    head_dim = _as_int(head_dim, "head_dim", origin)
    if heads % kv:
        raise ToolchainError(f"{origin}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    theta, scaling = normalize_rope(cfg, origin)
    if theta is None:
        theta = defaults.get("rope_theta")
    if theta is None:
        raise ToolchainError(f"{origin} lacks rope_theta (looked for rope_parameters.rope_theta, "
                             f"{', '.join(ALIASES['rope_theta'])})", "add rope_theta to config.json")

    def flag(field: str) -> bool:
        value = get(field)
        return False if value is _MISSING else bool(value)

    params = ArchParams(
        architecture=(cfg.get("architectures") or family.architectures)[0],
        vocab_size=_as_int(get("vocab_size"), "vocab_size", origin),
        hidden_size=hidden,
        intermediate_size=_as_int(get("intermediate_size"), "intermediate_size", origin),
        num_hidden_layers=_as_int(get("num_hidden_layers"), "num_hidden_layers", origin),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_size=head_dim,
        rms_norm_eps=_as_float(get("rms_norm_eps"), "rms_norm_eps", origin),
        rope_theta=_as_float(theta, "rope_theta", origin),
        rope_scaling_json=json.dumps(scaling, sort_keys=True) if scaling is not None else None,
        max_position_embeddings=_as_int(get("max_position_embeddings"), "max_position_embeddings", origin),
        tie_word_embeddings=flag("tie_word_embeddings"),
        attention_bias=flag("attention_bias"),
        mlp_bias=flag("mlp_bias"),
        hidden_act=str(get("hidden_act")),
        dtype=normalize_dtype(get("dtype"), origin),
    )
    if family.normalize is not None:
        params = family.normalize(cfg, params, origin)
    return params


def as_window(value: Any, origin: str, key: str = "sliding_window") -> int | None:
    """A sliding-window length from config.json (None or a positive integer)."""
    return None if value is None else _as_int(value, key, origin)
