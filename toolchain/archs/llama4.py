"""Llama 4 text (Scout, Maverick): HF Llama4ForCausalLM, and the text part of Llama4ForConditionalGeneration
checkpoints, served on TensorRT-LLM's PyTorch backend only.

Upstream: the PyTorch backend registers both names (tensorrt_llm/_torch/models/modeling_llama.py,
`@register_auto_model("Llama4ForCausalLM")` and `("Llama4ForConditionalGeneration")`; an older version builds the
text model from `pretrained_config.text_config`), while the TensorRT flow's MODEL_MAP (tensorrt_llm/models/
__init__.py) has no Llama 4 key: trtllm-build cannot build it, so the engine path refuses it (`engine_refusal`) and
the LLM-API path serves the HF checkpoint as it is. There is no upstream engine checkpoint of this family: the
checkpoint convert writes here is read by the CPU engine only (target llmapi-cpu's stand-in), with Llama's names
where a Llama tensor fits and the stand-in's own config keys, transformers' names, for what Llama lacks.

The model (transformers 5.25 models/llama4/modeling_llama4.py and configuration_llama4.py, Llama4TextConfig):
- attention: Llama's q/k/v/o. Layer i rotates q and k only when `no_rope_layers[i]` is 1 (the naming trap:
  Llama4TextAttention sets `self.use_rope = config.no_rope_layers[layer_idx]`; the default marks every 4th layer 0,
  a NoPE layer), with the interleaved (complex, GPT-J) rope of `apply_rotary_emb` (pairs 2i, 2i + 1), written as
  position_embedding_type rope_gptj. Rope layers attend within chunks of `attention_chunk_size` positions
  (layer_types chunked_attention; masking_utils chunked_overlay: kv // chunk == q // chunk) and, with
  use_qk_norm, normalise q and k per head by a weightless RMSNorm after the rotation (Llama4TextL2Norm, eps
  rms_norm_eps; no tensor). NoPE layers attend to every earlier position, and with attn_temperature_tuning scale
  q by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1.
- MLP: layer i is a mixture of experts when i is in `moe_layers` (default range(step - 1, L, step) for
  interleave_moe_layer_step), else a dense SiLU-gated MLP `intermediate_size_mlp` wide. The mixture: router
  [E, H] without bias, top-k of the logits whose sigmoid scales each chosen expert's *input* (Llama4Router,
  Llama4TextMoe.forward: `routed_in = hidden_states * router_scores`), experts held as one tensor per layer
  (gate_up_proj [E, H, 2I], gate half first; down_proj [E, I, H]) `intermediate_size` wide, plus a shared expert
  of the same width added ungated for every token.

Conversion: attention and norms are Llama's rows; a dense layer's feed_forward.{gate,up,down}_proj are Llama's MLP
rows; a MoE layer's router is written float32 and whole on every rank as every MoE family's, its experts stacked
and split over moe_ep and moe_tp like Mixtral's (`Shard.STACKED_EXPERT_FC`/`_PROJ`), its shared expert as
Qwen2-MoE's (split over tp, no gate). In ArchParams intermediate_size is the dense width (intermediate_size_mlp),
moe_intermediate_size and shared_expert_size the expert width (HF intermediate_size).

Llama4ForConditionalGeneration: its config.json nests the text model's keys in text_config (read by `prepare`),
its text tensors sit under `language_model.` and the vision tower's (`vision_model.*`, `multi_modal_projector.*`)
are skipped (DROP rows), as the older PyTorch backend's text-only build from text_config does (whether 1.2.1 loads
the vision tower is UNVERIFIED; images are not served here either way).

Refused: num_experts_per_tok other than 1 (TensorRT-LLM's Llama 4 routing is top-1 then sigmoid, RoutingMethodType
Llama4 per a secondary source, UNVERIFIED beyond that), hidden_act other than silu, layer_types that disagree
with no_rope_layers and attention_chunk_size, and every quantization but FP8 (with or without an FP8 KV cache) on the
LLM-API path (`quantization_refusal`).

FP8. The layout is read off upstream source, not off a released checkpoint: ModelOpt's HF export quantizes
Llama4TextExperts as a whole (modelopt/torch/export/unified_export_hf.py _process_quantized_modules calls
_export_quantized_weight for "gate_up_proj" and "down_proj"; quantizer_attr_names prefixes the weight's name), so a
MoE layer stores feed_forward.experts.gate_up_proj e4m3 [E, H, 2I] and down_proj e4m3 [E, I, H] (the bmm layout
kept: the per-tensor FP8 branch does not transpose) beside gate_up_proj_weight_scale, gate_up_proj_input_scale,
down_proj_weight_scale and down_proj_input_scale, each one float32 scalar for every expert of the layer.
TensorRT-LLM's Llama4MoE loads it with MoEWeightLoadingMode.FUSED_GATE_UP_PROJ and apply_router_weight_on_input
(_torch/models/modeling_llama.py), whose FP8 path reads exactly those four names without an expert index
(_torch/modules/fused_moe/quantization.py FP8QDQFusedMoEMethod.load_quant_scales, load_activation_scales_fp8_qdq;
`.reshape([])` of each: a scalar) and the weights as `gate_up_proj[expert].transpose(0, 1).chunk(2)` (gate first).
The router stays in the model dtype (TensorRT-LLM builds it with quant_config None; the export names it in
exclude_modules); attention, the shared expert and dense MLPs are ordinary FP8 linears. Which TensorRT-LLM release
the stored versions read are is not established (1.2.1 is assumed to read the same names), and the tensor list of
nvidia/Llama-4-Scout-17B-16E-Instruct-FP8 was not read: UNVERIFIED against it. The export is
checkpoint/stacked_fp8.py (calibrated by quant/calibration_llama4.py), imported back as stored by the same module;
computing FP8 elsewhere (the engine path) is refused. A Llama4ForConditionalGeneration export keeps the vision tower
as stored, in the model dtype and in exclude_modules.

KV cache: the planner counts every layer at the full sequence (plan/memory.py): how TensorRT-LLM's KV manager
sizes the chunked-attention layers is not established in the notes this was written from, so the rope layers
are not planned at attention_chunk_size tokens.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any

from toolchain.archs import moe
from toolchain.archs.common import Decoder, Family, Refusal, Row, Shard
from toolchain.archs.llama import L, T, llama_rows
from toolchain.errors import ToolchainError

CAUSAL_LM = "Llama4ForCausalLM"
CONDITIONAL = "Llama4ForConditionalGeneration"
F = f"{L}.feed_forward"

FEED_FORWARD_ROWS = (
    # a dense layer: Llama's GatedMLP names (fc the activated gate_proj, gate the up_proj)
    Row(f"{F}.gate_proj.weight", f"{T}.mlp.fc.weight", Shard.COLUMN, shape=("I", "H"), layers="dense"),
    Row(f"{F}.up_proj.weight", f"{T}.mlp.gate.weight", Shard.COLUMN, shape=("I", "H"), layers="dense"),
    Row(f"{F}.down_proj.weight", f"{T}.mlp.proj.weight", Shard.ROW, shape=("H", "I"), layers="dense"),
    # a mixture-of-experts layer
    Row(f"{F}.router.weight", f"{T}.mlp.router.weight", Shard.REPLICATE, dtype="float32", shape=("E", "H"),
        layers="moe"),
    Row(f"{F}.experts.gate_up_proj", f"{T}.mlp.fc.weight", Shard.STACKED_EXPERT_FC, shape=("E", "H", "2EI"),
        layers="moe"),
    Row(f"{F}.experts.down_proj", f"{T}.mlp.proj.weight", Shard.STACKED_EXPERT_PROJ, shape=("E", "EI", "H"),
        layers="moe"),
    Row(f"{F}.shared_expert.up_proj.weight", f"{T}.mlp.shared_expert.fc.weight", Shard.GATED_FC, part="w3",
        shape=("SI", "H"), layers="moe"),
    Row(f"{F}.shared_expert.gate_proj.weight", f"{T}.mlp.shared_expert.fc.weight", Shard.GATED_FC, part="w1",
        shape=("SI", "H"), layers="moe"),
    Row(f"{F}.shared_expert.down_proj.weight", f"{T}.mlp.shared_expert.proj.weight", Shard.ROW, shape=("H", "SI"),
        layers="moe"),
)
# Llama4ForConditionalGeneration's tensors outside the text model (skipped, see the module docstring)
VISION_ROWS = (Row("vision_model.{any}", None, Shard.DROP), Row("multi_modal_projector.{any}", None, Shard.DROP))


def _rows(prefix: str = "") -> tuple[Row, ...]:
    text = moe.with_experts(llama_rows(), *FEED_FORWARD_ROWS)
    if not prefix:
        return text
    return tuple(dataclasses.replace(r, hf=prefix + r.hf, tied_from=r.tied_from and prefix + r.tied_from)
                 for r in text) + VISION_ROWS


# transformers' Llama4TextConfig defaults for keys a config.json may omit.
LLAMA4_DEFAULTS = MappingProxyType({
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096 * 32,
    "hidden_act": "silu",
})
FIELDS = MappingProxyType({  # Llama4TextConfig defaults of the keys only this family reads
    "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "use_qk_norm": True, "attn_temperature_tuning": True,
    "floor_scale": 8192, "attn_scale": 0.1,
})
# What config.json carries for the CPU engine beyond Llama's keys (transformers' names; checkpoint/config.py)
CONFIG_KEYS = ("moe_layers", "no_rope_layers", "attention_chunk_size", "use_qk_norm", "attn_temperature_tuning",
               "floor_scale", "attn_scale")


def prepare(cfg: dict, origin: str) -> dict:
    """A Llama4ForConditionalGeneration config.json as its text model's: text_config's keys, with the
    architecture and the weight dtype the outer config holds."""
    text = cfg.get("text_config")
    if text is None:
        if (cfg.get("architectures") or [None])[0] == CONDITIONAL:
            raise ToolchainError(f"{origin}: {CONDITIONAL} without text_config",
                                 "point model.checkpoint at a complete Llama 4 checkpoint")
        return cfg
    if not isinstance(text, dict):
        raise ToolchainError(f"{origin}: text_config must be an object, got {text!r}")
    out = {**text, "architectures": cfg.get("architectures")}
    for key in ("dtype", "torch_dtype"):
        if out.get(key) is None and cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def _int(cfg: dict, key: str, origin: str, least: int = 1) -> int:
    value = cfg.get(key, FIELDS[key])
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ToolchainError(f"{origin}: {key} must be an integer >= {least}, got {value!r}")
    return value


def _layer_list(cfg: dict, key: str, origin: str) -> list[int] | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise ToolchainError(f"{origin}: {key} must be a list of integers, got {value!r}")
    return value


def moe_layers(cfg: dict, layers: int, origin: str) -> list[int]:
    """Llama4TextConfig.__post_init__: moe_layers as given, else every interleave_moe_layer_step-th layer."""
    given = _layer_list(cfg, "moe_layers", origin)
    if given is None:
        step = _int(cfg, "interleave_moe_layer_step", origin)
        return list(range(step - 1, layers, step))
    if any(not 0 <= i < layers for i in given) or len(set(given)) != len(given):
        raise ToolchainError(f"{origin}: moe_layers {given} must name distinct layers below num_hidden_layers {layers}")
    return sorted(given)


def rope_layers(cfg: dict, layers: int, origin: str) -> list[int]:
    """no_rope_layers as Llama4TextConfig reads it: 1 where the layer USES rope; an absent or empty list means
    the default, every no_rope_layer_interval-th layer without rope."""
    given = _layer_list(cfg, "no_rope_layers", origin)
    if not given:
        interval = _int(cfg, "no_rope_layer_interval", origin)
        return [int((i + 1) % interval != 0) for i in range(layers)]
    if len(given) != layers or any(i not in (0, 1) for i in given):
        raise ToolchainError(f"{origin}: no_rope_layers must hold 0 or 1 for each of the {layers} layers, got {given}")
    return given


def _check_layer_types(cfg: dict, rope: list[int], chunk: int | None, origin: str) -> None:
    """transformers masks by layer_types and rotates by no_rope_layers; a file where they disagree with the rule
    __post_init__ derives them by (chunked where rope is used and a chunk size is set) is refused."""
    types = cfg.get("layer_types")
    if types is None:
        return
    want = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if types != want:
        raise ToolchainError(f"{origin}: layer_types {types} disagree with no_rope_layers {rope} and "
                             f"attention_chunk_size {chunk}",
                             "rope layers attend in chunks and NoPE layers in full; fix layer_types or drop it")


def normalize(cfg: dict, params, origin: str):
    arch = params.architecture
    layers = params.num_hidden_layers
    if params.hidden_act != "silu":
        raise ToolchainError(f"{origin}: {arch} with hidden_act {params.hidden_act!r}",
                             "Llama 4's experts and MLPs are SiLU-gated only")
    experts = _int(cfg, "num_local_experts", origin)
    top_k = _int(cfg, "num_experts_per_tok", origin)
    if top_k != 1:
        raise ToolchainError(f"{origin}: {arch} with num_experts_per_tok {top_k}",
                             "Llama 4 routes each token to one expert (TensorRT-LLM's Llama 4 routing is top-1, "
                             "then sigmoid); only num_experts_per_tok 1 is supported")
    mixed = moe_layers(cfg, layers, origin)
    rope = rope_layers(cfg, layers, origin)
    chunk = cfg.get("attention_chunk_size", FIELDS["attention_chunk_size"])
    if chunk is not None:
        chunk = _int(cfg, "attention_chunk_size", origin)
    _check_layer_types(cfg, rope, chunk, origin)
    floor_scale = cfg.get("floor_scale", FIELDS["floor_scale"])
    attn_scale = cfg.get("attn_scale", FIELDS["attn_scale"])
    for key, value in (("floor_scale", floor_scale), ("attn_scale", attn_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ToolchainError(f"{origin}: {key} must be a positive number, got {value!r}")
    expert_width = params.intermediate_size  # HF intermediate_size: the routed and the shared experts' width
    extras: dict[str, Any] = {
        "moe_layers": mixed, "no_rope_layers": rope, "attention_chunk_size": chunk,
        "use_qk_norm": bool(cfg.get("use_qk_norm", FIELDS["use_qk_norm"])),
        "attn_temperature_tuning": bool(cfg.get("attn_temperature_tuning", FIELDS["attn_temperature_tuning"])),
        "floor_scale": floor_scale, "attn_scale": attn_scale, "shared_expert_gate": False,
    }
    routed = dict(num_experts=experts, top_k=1, moe_normalization="none", moe_intermediate_size=expert_width,
                  shared_expert_size=expert_width) if mixed else {}
    return dataclasses.replace(params, intermediate_size=_int(cfg, "intermediate_size_mlp", origin),
                               extras_json=json.dumps(extras, sort_keys=True), **routed)


def config_extra(params) -> dict:
    extras = json.loads(params.extras_json or "{}")
    out: dict[str, Any] = {"hidden_act": "swiglu", "position_embedding_type": "rope_gptj",
                           **{k: extras[k] for k in CONFIG_KEYS}}
    if params.is_moe:
        out.update(moe=moe.config_section(params), moe_intermediate_size=params.expert_size,
                   moe_shared_expert_intermediate_size=params.shared_expert_size)
    return out


def quantization_refusal(params, method: str, kv_cache: str, stored: str | None = None) -> Refusal | None:
    """FP8 weights and/or an FP8 KV cache: the HF-format export writes them and convert imports them back as stored
    (checkpoint/stacked_fp8.py). `stored` is config.json's quant_method ("modelopt") at convert and the stored
    format's name ("fp8") in the plan's checks; what a ModelOpt checkpoint stores beyond FP8 is refused by the
    import (stacked_fp8.check_stored)."""
    if stored:
        if stored in ("modelopt", "fp8") and method == "none" and kv_cache in ("none", "fp8"):
            return None
        what = f"a pre-quantized checkpoint ({stored})"
    elif method not in ("none", "fp8"):
        what = f"quantization {method}"
    elif kv_cache not in ("none", "fp8"):
        what = f"quantization.kv_cache {kv_cache}"
    else:
        return None
    return Refusal(f"{what} of {params.architecture} is not supported yet",
                   "convert the model unquantized, or use quantization.method fp8 (kv_cache none or fp8)")


DECODER = Decoder(hidden_act="swiglu", moe_router="sigmoid_input", shared_expert_gate=False,
                  attention_config="llama4")
ENGINE_REFUSAL = ("TensorRT-LLM 1.2.1's trtllm-build has no Llama 4 model (no Llama4ForCausalLM or "
                  "Llama4ForConditionalGeneration key in MODEL_MAP, tensorrt_llm/models/__init__.py); the PyTorch "
                  "backend serves it (tensorrt_llm/_torch/models/modeling_llama.py)")


def _family(name: str, architecture: str, prefix: str) -> Family:
    return Family(name=name, architectures=(architecture,), rows=_rows(prefix), defaults=LLAMA4_DEFAULTS,
                  config_extra=config_extra, prepare=prepare, normalize=normalize, quantization=quantization_refusal,
                  decoder=DECODER, engine_refusal=ENGINE_REFUSAL)


FAMILY = _family("llama4", CAUSAL_LM, "")
CONDITIONAL_FAMILY = _family("llama4", CONDITIONAL, "language_model.")
