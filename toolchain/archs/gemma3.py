"""Gemma 3 (text): HF Gemma3ForCausalLM -> TensorRT-LLM checkpoint with `architecture: "Gemma3ForCausalLM"`,
built by TensorRT-LLM's own Gemma implementation, as Gemma 2 is (archs/gemma.py holds what they share).

Read from upstream (TensorRT-LLM tensorrt_llm/models/gemma/config.py, the stored version with
GEMMA3_ARCHITECTURE = "Gemma3ForCausalLM", read_file id 397088162; models/modeling_utils.py Gemma3ConfigGroup;
models/gemma/model.py, the stored version with `gemma3_config()`, read_file id 83670668; models/gemma/convert.py
at 65b31db1; models/__init__.py MODEL_MAP has `GEMMA3_ARCHITECTURE: GemmaForCausalLM`, read_file id 820782731):
- The engine path builds it. GemmaConfig.is_gemma_3 keeps inter_layernorms (four norms per layer, as Gemma 2),
  query_pre_attn_scalar and final_logit_softcapping, plus the Gemma3ConfigGroup fields `_sliding_window_pattern`,
  `rope_local_base_freq` and `sliding_window`, all copied verbatim from the HF config's to_dict().
- q/k norms. GemmaDecoderLayer builds Attention(qk_layernorm=True, layernorm_type=RmsNorm) for Gemma 3; the HF
  parser renames self_attn.q_norm / k_norm to attention.q_layernorm / k_layernorm and, like every Gemma norm,
  stores 1 + w ("q_norm.weight", "k_norm.weight" in load_gemma_weights' `param + 1.0` list).
- Local layers. Layer i is local when (i + 1) % _sliding_window_pattern != 0 (model.py, `is_sliding`), and a
  local layer's Attention(is_local=True) rotates with the second rope table Attention.create_attention_const_params
  registers from `rope_local_base_freq` (layers/attention.py: "a second set of rope params. e.g. Gemma3"). So an
  HF `layer_types` that is not that pattern cannot be built and is refused. The window itself is the runtime's
  per-layer max_attention_window (examples/models/core/gemma/README.md, "Run Gemma 3": "the sliding window size
  for each layer could be passed in using the `--max_attention_window_size` parameter at runtime"), written
  here as runtime_defaults.max_attention_window, one entry per layer, as for Gemma 2.
- No attention soft-capping: model.py sets max_attn_value only for Gemma 2, so a Gemma 3 config with
  attn_logit_softcapping is refused (HF's Gemma 3 has none); final_logit_softcapping (None in every published
  Gemma 3) is applied after lm_head when set (DecoderModelForCausalLM.forward in models/modeling_utils.py, for
  the Gemma2ConfigGroup or Gemma3ConfigGroup, read_file id 1189552800; the group counts only when config.json
  has all five of its fields, which config_extra writes).
- RoPE scaling. GemmaConfig passes rotary_scaling = getattr(hf_config, "rotary_scaling", None), an attribute HF
  configs do not have, so the global layers' rope_scaling (linear, factor 8 in Gemma 3 4B/12B/27B) would be
  dropped: a scaled Gemma 3 is refused (the 1B and 270M text models have none). The refusal is in `normalize`,
  which both paths run, so it refuses the LLM-API path too, whose modeling_gemma3 would keep the scaling.
- transformers 5 writes the two rope bases as rope_parameters {"full_attention": {...}, "sliding_attention":
  {...}}; `prepare` below reads them back into rope_theta / rope_scaling / rope_local_base_freq.

Quantization as for Gemma 2 (GemmaForCausalLM.NATIVE_QUANT_FLOW: W8A16 and W4A16 without calibration; the
calibrated formats are refused, see archs/gemma.py).

The LLM-API path: the PyTorch backend registers Gemma3ForCausalLM (tensorrt_llm/_torch/models/modeling_gemma3.py
at 00e7d1037, `@register_auto_model("Gemma3ForCausalLM")`; imported by both stored versions of
_torch/models/__init__.py, the 1.1/1.2-era one, read_file id 130844221, and the newest, id 54836571092): local
layers use rope_parameters["sliding_attention"] / rope_local_base_freq without scaling and the config's
sliding_window, global ones RopeParams.from_config (rope_scaling kept). The weight-only formats this
family quantizes have no Hugging Face format that backend loads (checkpoint/hf_quant.py), so a quantized Gemma 3
is refused there. KV cache reuse is off there too (`llmapi_no_reuse`): upstream's own accuracy test runs Gemma 3
on that backend with enable_block_reuse and enable_partial_reuse false, "as a WAR to deal with gaps in kernel
support for Gemma3's non-inclusive sliding window size" (tests/integration/defs/accuracy/
test_llm_api_pytorch.py, TestGemma3_1BInstruct.test_auto_dtype and test_fp8_prequantized). The windows
themselves reach that backend as kv_cache_config.max_attention_window (llmapi/args.py attention_windows).
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any

from toolchain.archs.common import Family, Row, Shard
from toolchain.archs.gemma import ACTIVATIONS, config_extra, gemma2_rows, positive, quantization_refusal
from toolchain.archs.gemma import DECODER as GEMMA2_DECODER
from toolchain.archs.llama import L, T
from toolchain.archs.params import as_window
from toolchain.errors import ToolchainError

ARCHITECTURE = "Gemma3ForCausalLM"

# transformers' Gemma3TextConfig defaults for keys a config.json may omit.
GEMMA3_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 131072,
    "hidden_act": "gelu_pytorch_tanh",
    "head_dim": 256,
    "tie_word_embeddings": True,
})
GEMMA3_FIELDS = MappingProxyType({  # Gemma3TextConfig defaults of the Gemma3ConfigGroup fields
    "query_pre_attn_scalar": 256,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "rope_local_base_freq": 10_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
})
LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma 2's decoder with Gemma3ConfigGroup's fields instead (tensorrt_llm/models/modeling_utils.py).
DECODER = dataclasses.replace(GEMMA2_DECODER, config_group="Gemma3ConfigGroup")


def _rows() -> tuple[Row, ...]:
    return (*gemma2_rows(),
            Row(f"{L}.self_attn.q_norm.weight", f"{T}.attention.q_layernorm.weight", Shard.REPLICATE,
                transform="plus_one", shape=("HD",)),
            Row(f"{L}.self_attn.k_norm.weight", f"{T}.attention.k_layernorm.weight", Shard.REPLICATE,
                transform="plus_one", shape=("HD",)))


def prepare(cfg: dict, origin: str) -> dict:
    """transformers 5's rope_parameters, one dict per layer type, read back into the 4.x keys the shared
    lookup and upstream's GemmaConfig read (rope_theta, rope_scaling, rope_local_base_freq)."""
    params = cfg.get("rope_parameters")
    if not (isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values())):
        return cfg
    unknown = sorted(set(params) - set(LAYER_TYPES))
    if unknown:
        raise ToolchainError(f"{origin}: rope_parameters for layer types {unknown}",
                             f"{ARCHITECTURE} has {', '.join(LAYER_TYPES)} layers only")
    full, local = params.get("full_attention", {}), params.get("sliding_attention", {})
    if local.get("rope_type", "default") not in ("default", None):
        raise ToolchainError(f"{origin}: {ARCHITECTURE} with rope type {local['rope_type']!r} on its sliding layers",
                             "TensorRT-LLM rotates local layers with rope_local_base_freq only, unscaled")
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    out.setdefault("rope_theta", full.get("rope_theta"))
    out.setdefault("rope_local_base_freq", local.get("rope_theta"))
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") not in ("default", None):
        out.setdefault("rope_scaling", scaling)
    return out


def local_layers(cfg: dict, layers: int, origin: str) -> tuple[int, list[bool]]:
    """(_sliding_window_pattern, which layers are local): upstream's `(i + 1) % pattern != 0`, checked against
    HF's layer_types when the config lists them."""
    types = cfg.get("layer_types")
    pattern = cfg.get("_sliding_window_pattern", cfg.get("sliding_window_pattern"))
    if pattern is None and isinstance(types, list) and types:
        # only layer_types given: the pattern their first full layer implies (checked against them below)
        pattern = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    if pattern is None:
        pattern = GEMMA3_FIELDS["sliding_window_pattern"]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ToolchainError(f"{origin}: sliding_window_pattern must be an integer >= 1, got {pattern!r}")
    local = [bool((i + 1) % pattern) for i in range(layers)]
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ToolchainError(f"{origin}: layer_types must list sliding_attention or full_attention for each of "
                                 f"the {layers} layers, got {types!r}")
        if [t == "sliding_attention" for t in types] != local:
            raise ToolchainError(f"{origin}: {ARCHITECTURE} layer_types do not follow sliding_window_pattern "
                                 f"{pattern} (every {pattern}th layer full)",
                                 "TensorRT-LLM's Gemma decoder picks local layers by that pattern only")
    return pattern, local


def normalize(cfg: dict, params, origin: str):
    arch = params.architecture
    if not params.tie_word_embeddings:
        raise ToolchainError(f"{origin}: {arch} with tie_word_embeddings=false",
                             "TensorRT-LLM's Gemma converter writes lm_head from the embedding; only tied "
                             "Gemma 3 checkpoints convert")
    if params.rotary_scaling is not None:
        raise ToolchainError(f"{origin}: {arch} with rope scaling {params.rotary_scaling} on its global layers",
                             "TensorRT-LLM's GemmaConfig drops rope scaling; only unscaled Gemma 3 text models "
                             "(1B, 270M) convert")
    act = cfg.get("hidden_activation") or params.hidden_act
    if act not in ACTIVATIONS:
        raise ToolchainError(f"{origin}: {arch} with hidden_activation {act!r}", f"supported: {', '.join(ACTIVATIONS)}")
    if params.attention_bias or params.mlp_bias:
        raise ToolchainError(f"{origin}: {arch} with attention_bias or mlp_bias",
                             "TensorRT-LLM's Gemma converter reads no bias tensors")
    if positive(cfg, "attn_logit_softcapping", origin, GEMMA3_FIELDS) is not None:
        raise ToolchainError(f"{origin}: {arch} with attn_logit_softcapping",
                             "TensorRT-LLM's Gemma decoder soft-caps attention for Gemma 2 only; set it to null")
    window = as_window(cfg.get("sliding_window", GEMMA3_FIELDS["sliding_window"]), origin)
    pattern, local = local_layers(cfg, params.num_hidden_layers, origin)
    if window is None and any(local):
        raise ToolchainError(f"{origin}: {arch} has sliding layers but sliding_window is null")
    local_base = positive(cfg, "rope_local_base_freq", origin, GEMMA3_FIELDS)
    if local_base is None:
        raise ToolchainError(f"{origin}: {arch} with rope_local_base_freq null",
                             "the local layers' rope base is required (transformers' default is 10000)")
    full = params.max_position_embeddings
    extras: dict[str, Any] = {
        "query_pre_attn_scalar": positive(cfg, "query_pre_attn_scalar", origin, GEMMA3_FIELDS),
        "final_logit_softcapping": positive(cfg, "final_logit_softcapping", origin, GEMMA3_FIELDS),
        "_sliding_window_pattern": pattern,
        "rope_local_base_freq": local_base,
        "sliding_window": window,
        "inter_layernorms": True,
        "hidden_act": DECODER.hidden_act,  # TensorRT-LLM's gelu is the tanh form (archs/gemma.py)
    }
    if any(local):
        extras["runtime_defaults"] = {"max_attention_window": [window if is_local else full for is_local in local]}
    return dataclasses.replace(params, hidden_act=act, qk_layernorm=True,
                               extras_json=json.dumps(extras, sort_keys=True))


def llmapi_refusal(params, tp: int, quantized: bool) -> str | None:
    if quantized:
        return (f"{params.architecture} quantized on the LLM-API path: this family quantizes weight-only int8/int4, "
                "which has no Hugging Face format the PyTorch backend loads; quantize on the engine path or serve "
                "it unquantized")
    return None


FAMILY = Family(
    name="gemma3",
    architectures=(ARCHITECTURE,),
    rows=_rows(),
    defaults=GEMMA3_DEFAULTS,
    config_extra=config_extra,
    prepare=prepare,
    normalize=normalize,
    parallel_embedding_at_tp=True,
    llmapi_refusal=llmapi_refusal,
    llmapi_no_reuse=("upstream runs it with block and partial reuse off, a workaround for its non-inclusive sliding "
                     "window: tests/integration/defs/accuracy/test_llm_api_pytorch.py TestGemma3_1BInstruct"),
    quantization=quantization_refusal,
    decoder=DECODER,
)
