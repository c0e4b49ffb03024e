"""Phi-3 (mini, medium; Phi-3.5-mini): HF Phi3ForCausalLM -> TensorRT-LLM checkpoint with
`architecture: "Phi3ForCausalLM"`, which MODEL_MAP sends to TensorRT-LLM's own Phi-3 model
(tensorrt_llm/models/__init__.py; tensorrt_llm/models/phi3/model.py at 1479eaf5).

Read from upstream (TensorRT-LLM tensorrt_llm/models/phi3/convert.py at a newer stored version than 43bf1a65,
the one with PhiMoE and `split_weights_tp` for Phi3ForCausalLM; config.py at 033f4067; model.py at 1479eaf5):
- attention: HF `self_attn.qkv_proj` [q; k; v] is renamed `attention.qkv` as it is, and split per rank
  into q, k and v slices (split_weights.py split_weights_tp: q, k, v each split over tp, concatenated);
  `o_proj` -> `attention.dense`. No biases (Phi3DecoderLayer: bias only for the small and MoE variants).
- MLP: HF `mlp.gate_up_proj` [gate; up] becomes `mlp.fc` with its halves swapped, [up; gate] ("Swap the
  halves"), run by `MLP(hidden_act="swiglu")` (config.py writes swiglu for silu) whose swiglu computes
  silu(second half) * first half; `down_proj` -> `mlp.proj`. There is no `mlp.gate`. Per rank each half is
  split over tp on its own (sharding.split_gated_fc; see its open point on upstream's contiguous split).
- norms are RmsNorm (`post_attention_layernorm` -> `post_layernorm`, `model.norm` -> `ln_f`); lm_head
  tied to the embedding when tie_word_embeddings.
- config.json: `rotary_pct` (partial_rotary_factor, 1.0; model.py reads config.rotary_pct unguarded),
  `rotary_scaling` left null, and for longrope (only when max_position_embeddings >= 128000, config.py)
  `position_embedding_type: "long_rope"`, `original_max_position_embeddings`,
  `longrope_scaling_short_factors` and `longrope_scaling_long_factors` (the short/long mscales are read only
  for the small and MoE variants).

Parallelism and quantization: examples/models/core/phi/README.md (at 2bf8c593) marks TP for Phi-2, Phi-3-small and
Phi-3.5-MoE only, and lists FP8 and INT8 SmoothQuant (quantization/quantize.py) for "All Phi-3 variants". Here
tp > 1 writes each rank's own [up_r; gate_r] and q/k/v slices, the shapes TensorRT-LLM's ColumnLinear
holds per rank, so the engine computes the HF model (proven on the CPU engine; open point: one GPU build
at tp 2). Every quantization method the formats table has runs on the rows (the quantizer unfuses the
projections into the parts it quantizes together); AWQ and weight-only are beyond the README's list.

HF's sliding_window (Phi-3-mini-4k: 2047) is not read by upstream's config.py; it travels as
runtime_defaults.max_attention_window, as Mistral's does, so the engine attends like transformers does.

The LLM-API path: the PyTorch backend registers Phi3ForCausalLM (tensorrt_llm/_torch/models/modeling_phi3.py,
`@register_auto_model("Phi3ForCausalLM")`, longrope from rope_scaling short/long factors) and loads
qkv_proj and gate_up_proj with WeightMode.VANILLA under "TODO (williamj): maybe need to update it for
tp_size>1": a fused tensor split contiguously over tp ranks pairs the wrong rows, so tp > 1 is refused there.

Not converted: Phi3SmallForCausalLM and PhiMoEForCausalLM (other architectures, not registered), partial
rotary (Phi-4-mini: partial_rotary_factor 0.75; params.normalize_rope refuses it), pre-quantized Phi-3
checkpoints (the quantizer refuses imports of fused projections).
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

from toolchain.archs.common import Decoder, Family, Row, Shard, Stage
from toolchain.archs.llama import L, T
from toolchain.archs.params import as_window
from toolchain.errors import ToolchainError

ROWS = (
    Row("model.embed_tokens.weight", "transformer.vocab_embedding.weight", Shard.EMBEDDING, stage=Stage.FIRST,
        shape=("V", "H")),
    Row(f"{L}.input_layernorm.weight", f"{T}.input_layernorm.weight", Shard.REPLICATE, shape=("H",)),
    Row(f"{L}.self_attn.qkv_proj.weight", f"{T}.attention.qkv.weight", Shard.FUSED_QKV, shape=("QKV", "H")),
    Row(f"{L}.self_attn.o_proj.weight", f"{T}.attention.dense.weight", Shard.ROW, shape=("H", "Q")),
    Row(f"{L}.post_attention_layernorm.weight", f"{T}.post_layernorm.weight", Shard.REPLICATE, shape=("H",)),
    Row(f"{L}.mlp.gate_up_proj.weight", f"{T}.mlp.fc.weight", Shard.FUSED_GATE_UP, shape=("2I", "H")),
    Row(f"{L}.mlp.down_proj.weight", f"{T}.mlp.proj.weight", Shard.ROW, shape=("H", "I")),
    Row("model.norm.weight", "transformer.ln_f.weight", Shard.REPLICATE, stage=Stage.LAST, shape=("H",)),
    Row("lm_head.weight", "lm_head.weight", Shard.VOCAB, stage=Stage.LAST,
        tied_from="model.embed_tokens.weight", shape=("V", "H")),
    Row(f"{L}.self_attn.rotary_emb.inv_freq", None, Shard.DROP),
)

# transformers' Phi3Config defaults for keys a config.json may omit.
PHI3_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
})
# Phi3DecoderLayer (tensorrt_llm/models/phi3/model.py): the fused fc run by MLP(hidden_act="swiglu"), and
# Attention with the long_rope factors when position_embedding_type says so.
DECODER = Decoder(hidden_act="swiglu", fused_mlp=True, long_rope=True)
DEFAULT_ORIGINAL_MAX = 4096  # Phi3Config.original_max_position_embeddings
# tensorrt_llm/models/phi3/config.py: `if hf_config.max_position_embeddings >= 128000:` -> long_rope
LONGROPE_MIN_POSITIONS = 128000


def _longrope(cfg: dict, params, origin: str) -> dict | None:
    """The longrope scaling both engines compute, or None; refused where upstream would silently drop it."""
    scaling = params.rotary_scaling
    if scaling is None:
        return None
    kind = scaling.get("type")
    if kind not in ("longrope", "yarn"):  # Phi3Config renames su and yarn to longrope
        raise ToolchainError(f"{origin}: Phi3ForCausalLM with rope type '{kind}'",
                             "Phi-3 configs carry longrope scaling or none (transformers Phi3Config.validate_rope)")
    half = params.head_size // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, list) or len(value) != half or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value):
            raise ToolchainError(f"{origin}: longrope {key} must be a list of {half} positive numbers "
                                 "(head_size / 2)", "fix rope_scaling in config.json")
        factors[key] = [float(v) for v in value]
    original = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings",
                                                                       DEFAULT_ORIGINAL_MAX))
    original = as_window(original, origin, "original_max_position_embeddings")
    if params.max_position_embeddings < LONGROPE_MIN_POSITIONS:
        raise ToolchainError(
            f"{origin}: longrope with max_position_embeddings {params.max_position_embeddings}",
            f"TensorRT-LLM's Phi3Config applies longrope only from {LONGROPE_MIN_POSITIONS} positions "
            "(tensorrt_llm/models/phi3/config.py) and would drop the scaling transformers applies")
    if scaling.get("attention_factor") is not None:
        raise ToolchainError(f"{origin}: longrope with an explicit attention_factor",
                             "TensorRT-LLM derives the scale from max_position_embeddings / "
                             "original_max_position_embeddings and reads no attention_factor")
    return {"type": "longrope", "rope_type": "longrope", "original_max_position_embeddings": original,
            **factors}


def normalize(cfg: dict, params, origin: str):
    if params.hidden_act != "silu":
        raise ToolchainError(f"{origin}: Phi3ForCausalLM with hidden_act {params.hidden_act!r}",
                             "TensorRT-LLM runs Phi-3's fused gate_up as swiglu (silu) only")
    if params.attention_bias or params.mlp_bias:
        raise ToolchainError(f"{origin}: Phi3ForCausalLM with biases",
                             "TensorRT-LLM's Phi-3 (mini/medium) has no attention or MLP biases")
    scaling = _longrope(cfg, params, origin)
    window = as_window(cfg.get("sliding_window"), origin)
    if window is not None and window >= params.max_position_embeddings:
        window = None  # no sequence is longer than the window (Phi-3-mini-128k: 262144): full attention
    return dataclasses.replace(params, sliding_window=window,
                               rope_scaling_json=json.dumps(scaling, sort_keys=True) if scaling else None)


def config_extra(params) -> dict:
    extra: dict = {"hidden_act": DECODER.hidden_act, "rotary_pct": 1.0, "rotary_scaling": None}
    scaling = params.rotary_scaling
    if scaling is not None:
        extra.update(position_embedding_type="long_rope",
                     original_max_position_embeddings=scaling["original_max_position_embeddings"],
                     longrope_scaling_short_factors=scaling["short_factor"],
                     longrope_scaling_long_factors=scaling["long_factor"])
    return extra


def llmapi_refusal(params, tp: int, quantized: bool) -> str | None:
    if tp > 1:
        return (f"Phi3ForCausalLM at tp {tp} on the LLM-API path: TensorRT-LLM's PyTorch backend loads the fused "
                "qkv_proj and gate_up_proj with WeightMode.VANILLA ('TODO ... tp_size>1', modeling_phi3.py); "
                "use parallelism.tp 1 or the engine path")
    if quantized:
        return ("Phi3ForCausalLM quantized on the LLM-API path: the HF-format export writes separate q/k/v and "
                "gate/up projections only; quantize on the engine path or serve it unquantized")
    return None


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    rows=ROWS,
    defaults=PHI3_DEFAULTS,
    config_extra=config_extra,
    normalize=normalize,
    llmapi_refusal=llmapi_refusal,
    decoder=DECODER,
)
