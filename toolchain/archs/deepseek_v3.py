"""DeepSeek-V3 and R1: HF DeepseekV3ForCausalLM, multi-head latent attention (MLA) and grouped sigmoid routing.

The math is transformers 5.25's models/deepseek_v3/modeling_deepseek_v3.py:
- attention (DeepseekV3Attention): q = q_b_proj(q_a_layernorm(q_a_proj(x))), per head [qk_nope | qk_rope];
  kv_a_proj_with_mqa(x) = [kv_lora_rank latent | qk_rope_head_dim shared key], the latent RMS-normed by
  kv_a_layernorm; kv_b_proj(latent) per head [k_nope | v]; rope on the rope parts (pairs interleaved when
  rope_interleave), YaRN with its mscale folded into the softmax scale (yarn_apply_mscale);
- MLP: a dense swiglu MLP (intermediate_size) on the first first_k_dense_replace layers, then a mixture of
  n_routed_experts (moe_intermediate_size wide) plus n_shared_experts always-added shared experts (one MLP
  moe_intermediate_size x n_shared_experts wide, no gate: DeepseekV3MoE);
- routing (DeepseekV3TopkRouter): sigmoid scores in float32, e_score_correction_bias added for the choice only,
  the topk_group best of n_group groups (a group scored by its top two), top-k among their experts, the weights
  the raw scores of the chosen, divided by their sum, times routed_scaling_factor.

TensorRT-LLM 1.2.1 serves DeepseekV3ForCausalLM on the PyTorch backend only (_torch/models/modeling_deepseekv3.py,
@register_auto_model("DeepseekV3ForCausalLM")); the TensorRT flow's MODEL_MAP (tensorrt_llm/models/__init__.py)
has DeepseekV2ForCausalLM and no V3, so the engine path is refused (`engine_refusal`). There is no upstream engine
checkpoint layout for V3, so the checkpoint names below are this toolchain's own, read by its CPU engine (target
llmapi-cpu's stand-in): the Llama table's names where a tensor is one (input_layernorm, attention.dense for
o_proj, mlp.fc/gate/proj, mlp.router, the stacked experts, mlp.shared_expert.fc/proj as Qwen2-MoE's), the HF
module names under `attention.` for the MLA projections, and mlp.router.e_score_correction_bias.
q_b_proj and kv_b_proj are split over tp by head (their rows are head-major), o_proj by its head-major columns;
the latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms are whole on every rank, as the latent is
(the PyTorch backend's MLA cache keeps one latent "head" per token on every rank: notes i36-facts §3.5).

The multi-token-prediction layers (model.layers.{num_hidden_layers}.*, num_nextn_predict_layers of them) are
dropped, as transformers drops them (_keys_to_ignore_on_load_unexpected), unless speculative.mode is mtp: then
checkpoint/mtp.py keeps the first one as transformer.layers.{num_hidden_layers}.* (pp 1 only), its decoder under the
names every layer has and MTP_ROWS' own tensors (this toolchain's names, after the HF ones): enorm, hnorm, eh_proj
and shared_head.norm, whole on every rank. Its embed_tokens and shared_head.head, where a checkpoint stores them,
are the main model's embedding and lm_head again (DeepSeek-V3 paper §2.2: "shared embedding ... shared output
head"), so they are dropped and the CPU engine uses the main ones.
Refused in one line: q_lora_rank null (DeepSeek-V2-Lite's plain q_proj), norm_topk_prob false (TensorRT-LLM's
DeepSeekV3 routing always normalises), scoring_func other than sigmoid or topk_method other than noaux_tc (V2's
softmax routing), attention_bias true, hidden_act other than silu, and any quantization but the released
checkpoints' own: FP8 block scales (128x128 tiles, `weight_scale_inv`) imported as stored (`quantization`). Which linears are quantized is the
checkpoint's: a linear stored e4m3 with its scale grid is, one stored in bf16 is not (TensorRT-LLM excludes
`*kv_b_proj*` for its TRTLLM MoE backend by dequantizing at load; the import keeps what the tensors say). The
router, its correction bias, the norms, the embedding and lm_head stay in the model dtype.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any

from toolchain.archs import moe
from toolchain.archs.common import Decoder, Family, Refusal, Row, Shard, Stage
from toolchain.archs.llama import L, T
from toolchain.errors import ToolchainError

A = f"{L}.self_attn"
E = f"{L}.mlp.experts.{{expert}}"
S = f"{L}.mlp.shared_experts"


ROWS = (
    Row("model.embed_tokens.weight", "transformer.vocab_embedding.weight", Shard.EMBEDDING, stage=Stage.FIRST,
        shape=("V", "H")),
    Row(f"{L}.input_layernorm.weight", f"{T}.input_layernorm.weight", Shard.REPLICATE, shape=("H",)),
    Row(f"{A}.q_a_proj.weight", f"{T}.attention.q_a_proj.weight", Shard.REPLICATE, shape=("QL", "H")),
    Row(f"{A}.q_a_layernorm.weight", f"{T}.attention.q_a_layernorm.weight", Shard.REPLICATE, shape=("QL",)),
    Row(f"{A}.q_b_proj.weight", f"{T}.attention.q_b_proj.weight", Shard.COLUMN, shape=("QB", "QL")),
    Row(f"{A}.kv_a_proj_with_mqa.weight", f"{T}.attention.kv_a_proj_with_mqa.weight", Shard.REPLICATE,
        shape=("KVA", "H")),
    Row(f"{A}.kv_a_layernorm.weight", f"{T}.attention.kv_a_layernorm.weight", Shard.REPLICATE, shape=("KVL",)),
    Row(f"{A}.kv_b_proj.weight", f"{T}.attention.kv_b_proj.weight", Shard.COLUMN, shape=("KVB", "KVL")),
    Row(f"{A}.o_proj.weight", f"{T}.attention.dense.weight", Shard.ROW, shape=("H", "OV")),
    Row(f"{L}.post_attention_layernorm.weight", f"{T}.post_layernorm.weight", Shard.REPLICATE, shape=("H",)),
    # the dense layers: GatedMLP's naming trap as in archs/llama.py (fc is the activated gate_proj)
    Row(f"{L}.mlp.gate_proj.weight", f"{T}.mlp.fc.weight", Shard.COLUMN, shape=("I", "H"), layers="dense"),
    Row(f"{L}.mlp.up_proj.weight", f"{T}.mlp.gate.weight", Shard.COLUMN, shape=("I", "H"), layers="dense"),
    Row(f"{L}.mlp.down_proj.weight", f"{T}.mlp.proj.weight", Shard.ROW, shape=("H", "I"), layers="dense"),
    # the mixtures: router and its correction bias float32 and whole on every rank (the router computes in float32)
    Row(f"{L}.mlp.gate.weight", f"{T}.mlp.router.weight", Shard.REPLICATE, dtype="float32", shape=("E", "H"),
        layers="moe"),
    Row(f"{L}.mlp.gate.e_score_correction_bias", f"{T}.mlp.router.e_score_correction_bias", Shard.REPLICATE,
        dtype="float32", shape=("E",), layers="moe"),
    Row(f"{E}.up_proj.weight", f"{T}.mlp.fc.weight", Shard.EXPERT_FC, part="w3", shape=("EI", "H"),
        layers="moe"),
    Row(f"{E}.gate_proj.weight", f"{T}.mlp.fc.weight", Shard.EXPERT_FC, part="w1", shape=("EI", "H"),
        layers="moe"),
    Row(f"{E}.down_proj.weight", f"{T}.mlp.proj.weight", Shard.EXPERT_PROJ, shape=("H", "EI"), layers="moe"),
    Row(f"{S}.up_proj.weight", f"{T}.mlp.shared_expert.fc.weight", Shard.GATED_FC, part="w3", shape=("SI", "H"),
        layers="moe"),
    Row(f"{S}.gate_proj.weight", f"{T}.mlp.shared_expert.fc.weight", Shard.GATED_FC, part="w1", shape=("SI", "H"),
        layers="moe"),
    Row(f"{S}.down_proj.weight", f"{T}.mlp.shared_expert.proj.weight", Shard.ROW, shape=("H", "SI"),
        layers="moe"),
    Row("model.norm.weight", "transformer.ln_f.weight", Shard.REPLICATE, stage=Stage.LAST, shape=("H",)),
    Row("lm_head.weight", "lm_head.weight", Shard.VOCAB, stage=Stage.LAST, tied_from="model.embed_tokens.weight",
        shape=("V", "H")),
    Row(f"{L}.self_attn.rotary_emb.inv_freq", None, Shard.DROP),
)

# The multi-token-prediction layer's own tensors (TensorRT-LLM _torch/models/modeling_deepseekv3.py DeepseekV3MTP:
# enorm and hnorm RMSNorms, eh_proj [H, 2H] without bias, shared_head.norm); its decoder is the table above.
MTP_ROWS = (
    Row(f"{L}.enorm.weight", f"{T}.enorm.weight", Shard.REPLICATE, shape=("H",), layers="nextn"),
    Row(f"{L}.hnorm.weight", f"{T}.hnorm.weight", Shard.REPLICATE, shape=("H",), layers="nextn"),
    Row(f"{L}.eh_proj.weight", f"{T}.eh_proj.weight", Shard.REPLICATE, shape=("H", "2H"), layers="nextn"),
    Row(f"{L}.shared_head.norm.weight", f"{T}.shared_head.norm.weight", Shard.REPLICATE, shape=("H",),
        layers="nextn"),
    Row(f"{L}.embed_tokens.weight", None, Shard.DROP),
    Row(f"{L}.shared_head.head.weight", None, Shard.DROP),
)

# transformers 5.25's DeepseekV3Config defaults (models/deepseek_v3/configuration_deepseek_v3.py) for keys a
# config.json may omit; the MLA and routing ones are read in `normalize` with the same defaults.
DEFAULTS = MappingProxyType({"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                             "num_hidden_layers": 61, "num_attention_heads": 128, "rms_norm_eps": 1e-6,
                             "max_position_embeddings": 4096, "hidden_act": "silu", "rope_theta": 10000.0})
HF_DEFAULTS = MappingProxyType({
    "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "rope_interleave": True, "num_nextn_predict_layers": 1})
# transformers 5 saves n_routed_experts and num_nextn_predict_layers under these names too (attribute_map)
ALIASES = {"n_routed_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers"}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _value(cfg: dict, key: str) -> Any:
    for name in (key, ALIASES.get(key)):
        if name is not None and cfg.get(name) is not None:
            return cfg[name]
    return HF_DEFAULTS[key]


def _int(cfg: dict, key: str, origin: str, least: int = 1) -> int:
    value = _value(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ToolchainError(f"{origin}: {key} must be an integer >= {least}, got {value!r}")
    return value


def _refusals(cfg: dict, params: Any, origin: str) -> None:
    arch = params.architecture
    if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
        raise ToolchainError(f"{origin}: {arch} with q_lora_rank null (a plain q_proj, as DeepSeek-V2-Lite) is not "
                             "supported yet", "only checkpoints with q_a_proj/q_b_proj (q_lora_rank set) convert")
    if _value(cfg, "norm_topk_prob") is not True:
        raise ToolchainError(f"{origin}: {arch} with norm_topk_prob false",
                             "TensorRT-LLM's DeepSeekV3 routing always normalises the top-k weights; only "
                             "norm_topk_prob true checkpoints convert")
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, value) != value:
            raise ToolchainError(f"{origin}: {arch} with {key} {cfg[key]!r}",
                                 f"DeepSeek-V3 routing is {key} {value!r} (a DeepSeek-V2 style router is not "
                                 "supported)")
    if params.num_key_value_heads != params.num_attention_heads:
        raise ToolchainError(f"{origin}: {arch} with num_key_value_heads {params.num_key_value_heads} and "
                             f"num_attention_heads {params.num_attention_heads}",
                             "MLA expands the latent into every head: set num_key_value_heads = num_attention_heads")
    if params.attention_bias:
        raise ToolchainError(f"{origin}: {arch} with attention_bias true", "only attention_bias false converts")
    if params.hidden_act != "silu":
        raise ToolchainError(f"{origin}: {arch} with hidden_act {params.hidden_act!r}",
                             "DeepSeek-V3's MLPs and experts are silu-gated (swiglu) only")


def normalize(cfg: dict, params: Any, origin: str) -> Any:
    _refusals(cfg, params, origin)
    mla = {key: _int(cfg, key, origin) for key in MLA_KEYS}
    experts, top_k = _int(cfg, "n_routed_experts", origin, 2), _int(cfg, "num_experts_per_tok", origin)
    groups, topk_group = _int(cfg, "n_group", origin), _int(cfg, "topk_group", origin)
    if experts % groups or experts // groups < 2 or topk_group > groups or top_k > topk_group * (experts // groups):
        raise ToolchainError(f"{origin}: n_routed_experts {experts} in n_group {groups} with topk_group {topk_group} "
                             f"and num_experts_per_tok {top_k}",
                             "the groups must split the experts evenly, two or more each (a group scores by its "
                             "top two), topk_group <= n_group, and the chosen groups hold num_experts_per_tok experts")
    scale = _value(cfg, "routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ToolchainError(f"{origin}: routed_scaling_factor must be a positive number, got {scale!r}")
    if mla["qk_rope_head_dim"] % 2:
        raise ToolchainError(f"{origin}: qk_rope_head_dim {mla['qk_rope_head_dim']} is odd (rope rotates pairs)")
    width = _int(cfg, "moe_intermediate_size", origin)
    extras = {"mla": mla, "first_k_dense_replace": _int(cfg, "first_k_dense_replace", origin, 0),
              "n_group": groups, "topk_group": topk_group, "routed_scaling_factor": float(scale),
              "rope_interleave": bool(_value(cfg, "rope_interleave")),
              "num_nextn_predict_layers": _int(cfg, "num_nextn_predict_layers", origin, 0),
              "shared_expert_gate": False}  # DeepseekV3MoE adds its shared experts ungated
    return dataclasses.replace(
        params, num_key_value_heads=params.num_attention_heads,
        head_size=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],  # the q/k head (qk_head_dim)
        num_experts=experts, top_k=top_k, moe_normalization="renormalize", moe_intermediate_size=width,
        shared_expert_size=width * _int(cfg, "n_shared_experts", origin), extras_json=json.dumps(extras, sort_keys=True))


def extras(params: Any) -> dict:
    return json.loads(params.extras_json or "{}")


def config_extra(params: Any) -> dict:
    """The checkpoint config.json's DeepSeek fields: swiglu experts and the `moe` section as every MoE family
    writes them, and a `deepseek_v3` section (this toolchain's own, read by engine/cpu/mla.py) with the MLA ranks,
    the dense layers, the routing groups and the expert widths."""
    e = extras(params)
    section = {**e["mla"], "first_k_dense_replace": e["first_k_dense_replace"], "n_group": e["n_group"],
               "topk_group": e["topk_group"], "routed_scaling_factor": e["routed_scaling_factor"],
               "rope_interleave": e["rope_interleave"], "moe_intermediate_size": params.moe_intermediate_size,
               "shared_expert_intermediate_size": params.shared_expert_size}
    return {"hidden_act": "swiglu", "moe": moe.config_section(params), "deepseek_v3": section}


def ignore(params: Any, hf_name: str) -> bool:
    """The multi-token-prediction layers: model.layers.{num_hidden_layers + i}.* for i < num_nextn_predict_layers."""
    prefix = "model.layers."
    if not hf_name.startswith(prefix):
        return False
    index = hf_name[len(prefix):].split(".", 1)[0]
    mtp = extras(params).get("num_nextn_predict_layers", 0)
    return index.isdigit() and params.num_hidden_layers <= int(index) < params.num_hidden_layers + mtp


# config.json's quant_method (what convert passes) and the stored view's format name (what plan's check passes)
STORED_FORMATS = ("fp8", "fp8_block")


def quantization(params: Any, method: str, kv_cache: str, stored: str | None = None) -> Refusal | None:
    """Only the released checkpoints' own format: a stored FP8 block-scale checkpoint (quantization_config
    quant_method "fp8" with weight_block_size, which quant/view.py stored_format reads and refuses in any block but
    128x128) imported as stored; nothing is computed (no calibration or quantizer runs for MLA or these experts)."""
    if stored is not None and stored not in STORED_FORMATS:
        what = f"a pre-quantized checkpoint ({stored})"
    elif method != "none":
        what = f"quantization {method}"
    elif kv_cache != "none":
        what = f"quantization.kv_cache {kv_cache}"
    else:
        return None
    return Refusal(f"{what} on {params.architecture} is not supported by convert yet",
                   "import the FP8 block-scale checkpoint as stored, or convert the bfloat16 one, with "
                   "quantization.method none and kv_cache none")


FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    rows=ROWS,
    defaults=DEFAULTS,
    config_extra=config_extra,
    normalize=normalize,
    quantization=quantization,
    decoder=Decoder(mla=True, shared_expert_gate=False),
    ignore=ignore,
    mtp_rows=MTP_ROWS,
    engine_refusal=("TensorRT-LLM 1.2.1's engine path does not build DeepseekV3ForCausalLM (MODEL_MAP in "
                    "tensorrt_llm/models/__init__.py has DeepseekV2ForCausalLM and no V3; V3 runs on the PyTorch "
                    "backend, _torch/models/modeling_deepseekv3.py)"),
)
