"""Qwen mixtures of experts: HF Qwen2MoeForCausalLM (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and Qwen3MoeForCausalLM
(Qwen3-30B-A3B, Qwen3-235B-A22B) -> TensorRT-LLM checkpoints with the HF `architecture`, which MODEL_MAP sends to
QWenForCausalLM (tensorrt_llm/models/__init__.py: 'Qwen2MoeForCausalLM': QWenForCausalLM, 'Qwen3MoeForCausalLM':
QWenForCausalLM) and the Qwen converter converts (tensorrt_llm/models/qwen/convert.py at 0428c188,
convert_hf_qwen, `if moe_config and moe_config.has_moe()`).

Qwen2-MoE's attention and norms are Qwen2's (q/k/v biases, no o_proj bias). Every layer's MLP is a mixture
of experts plus one shared expert:
- router: `mlp.gate.weight` [E, H] -> `mlp.router.weight`, float32, whole on every rank (get_weight(...,
  torch.float32), "Router should never be quantized"), as Mixtral's;
- experts: `mlp.experts.{e}.up_proj` (w3, the linear half) and `gate_proj` (w1, the activated half) stacked
  into `mlp.fc.weight` [E_r, 2 I_e/moe_tp, H] as [w3; w1], `down_proj` into `mlp.proj.weight`
  [E_r, H, I_e/moe_tp]; split over moe_ep and moe_tp like Mixtral's (archs/moe.py), I_e being
  moe_intermediate_size (QWenDecoderLayer: `intermediate_size = config.moe_intermediate_size` for qwen2_moe,
  tensorrt_llm/models/qwen/model.py);
- shared expert: `mlp.shared_expert.up_proj` and `gate_proj` each split over tp along dim 0 and fused per
  rank as [up; gate] into `mlp.shared_expert.fc.weight` [2 S/tp, H]; `down_proj` split over tp along dim 1
  into `mlp.shared_expert.proj.weight` [H, S/tp] (convert.py: `split(..., mapping.tp_size, mapping.tp_rank,
  dim=0)` and `torch.concat([shared_expert_up_proj, shared_expert_gate], dim=-2)`), S being
  shared_expert_intermediate_size. It is a dense MLP over all tp ranks, not expert-parallel (SharedMoE in
  tensorrt_llm/layers/moe.py builds it as MLP(ffn_hidden_size=shared_expert_intermediate_size,
  hidden_act swiglu, tp_size=tp_size));
- shared expert gate: `mlp.shared_expert_gate.weight` [1, H] kept whole on every rank in the model dtype
  (RowLinear(hidden_size, 1, tp_size=1) in SharedMoE; get_weight(..., dtype) in convert.py, never
  quantized; QuantConfig's default exclude list names `*shared_expert_gate`). The layer's output is
  experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x), all-reduced over tp once (SharedMoE.forward).

config.json (QWenConfig.from_hugging_face, tensorrt_llm/models/qwen/config.py at 0428c188): qwen_type
"qwen2_moe", hidden_act "swiglu", intermediate_size the HF one (the dense width, unused when every layer is
a mixture), moe_intermediate_size and moe_shared_expert_intermediate_size as extra PretrainedConfig fields,
and the `moe` section (num_experts, top_k from num_experts_per_tok).

Routing normalisation: HF's Qwen2MoeTopKRouter takes the softmax over every expert, then the top k, and divides
them by their sum only when `norm_topk_prob` (transformers models/qwen2_moe/modeling_qwen2_moe.py). Upstream's
QWenConfig writes ExpertScaleNormalizationMode.NONE whatever norm_topk_prob says; QWenConfig reads the mode
back from the checkpoint's `moe` dict (`MoeConfig.from_dict(moe)`), so writing RENORMALIZE for a
norm_topk_prob checkpoint keeps the engine equal to HF. Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B ship
norm_topk_prob false, which is NONE, as upstream writes: MixtureOfExperts.default_routing computes
topk(softmax(logits in float32)), the k probabilities as they are (tensorrt_llm/layers/moe.py).

The `moe` section stays the five keys every stored MoeConfig accepts (archs/moe.py config_section): newer
MoeConfigs add a shared_expert_intermediate_size field, which QWenDecoderLayer fills from the top-level
moe_shared_expert_intermediate_size before building SharedMoE, and the older ones would refuse the key in
MoeConfig.from_dict (`cls(**config)`).

Qwen3-MoE is Qwen3's attention (no biases, per-head q/k RMSNorm: convert.py converts q_norm/k_norm `if qwen_type
in ('qwen3', 'qwen3_moe')`, QWenDecoderLayer builds Attention(qk_layernorm=True) for both) with the same routed
experts, moe_intermediate_size wide (QWenDecoderLayer: `elif self.config.qwen_type in ('qwen2_moe', 'qwen3_moe'):
intermediate_size = config.moe_intermediate_size`, and plain MOE: "Qwen3 MoE uses standard MOE without shared
expert"; read in the stored model.py that also builds Qwen3.5, newer than 04a2cacb, whose decoder still used
intermediate_size for every type but qwen2_moe). Qwen3-30B-A3B's config.json sets norm_topk_prob true, so it is
written RENORMALIZE where upstream's own converter (NONE in every stored qwen/config.py) would route unlike HF.

That layout is this toolchain's, and the CPU engine runs it (tests/test_moe_qwen.py holds it to transformers), but
TensorRT-LLM 1.2.1's trtllm-build does not build it: the 1.2-era tensorrt_llm/models/qwen/model.py (04a2cacb)
sizes the experts by `intermediate_size` for every qwen_type but qwen2_moe and builds its Attention without q/k
norms, and examples/models/core/qwen/README.md runs Qwen3 (Qwen3-30B-A3B, Qwen3-235B-A22B) "with the PyTorch
backend" only. So the engine path refuses Qwen3-MoE (`engine_refusal`, the arch.engine-path check) on target
trtllm and on target cpu, its stand-in here; the LLM-API path serves it (targets llmapi and llmapi-cpu, whose
stand-in converts it with these tables without that check).

Refused: decoder_sparse_step other than 1 and non-empty mlp_only_layers (dense layers among the mixtures: the
converter above turns every layer into one), qkv_bias false (QWenConfig writes attn_bias true for every
qwen2_moe) or attention_bias true on Qwen3-MoE (attn_bias false for qwen3_moe), a Qwen3-MoE sliding window,
and, as for every MoE family here, the quantization formats archs/moe.py EXPERT_METHODS does not list
(quantization_refusal, the families' `quantization`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from toolchain.archs import moe
from toolchain.archs.common import Family, Row, Shard
from toolchain.archs.llama import L, T, llama_rows
from toolchain.archs.qwen import QWEN_DECODER, QWEN_DEFAULTS, uniform_window
from toolchain.errors import ToolchainError

E = f"{L}.mlp.experts.{{expert}}"
S = f"{L}.mlp.shared_expert"

ROUTED_ROWS = (
    Row(f"{L}.mlp.gate.weight", f"{T}.mlp.router.weight", Shard.REPLICATE, dtype="float32", shape=("E", "H")),
    Row(f"{E}.up_proj.weight", f"{T}.mlp.fc.weight", Shard.EXPERT_FC, part="w3", shape=("EI", "H")),
    Row(f"{E}.gate_proj.weight", f"{T}.mlp.fc.weight", Shard.EXPERT_FC, part="w1", shape=("EI", "H")),
    Row(f"{E}.down_proj.weight", f"{T}.mlp.proj.weight", Shard.EXPERT_PROJ, shape=("H", "EI")),
)
SHARED_ROWS = (
    Row(f"{S}.up_proj.weight", f"{T}.mlp.shared_expert.fc.weight", Shard.GATED_FC, part="w3", shape=("SI", "H")),
    Row(f"{S}.gate_proj.weight", f"{T}.mlp.shared_expert.fc.weight", Shard.GATED_FC, part="w1", shape=("SI", "H")),
    Row(f"{S}.down_proj.weight", f"{T}.mlp.shared_expert.proj.weight", Shard.ROW, shape=("H", "SI")),
    Row(f"{L}.mlp.shared_expert_gate.weight", f"{T}.mlp.shared_expert_gate.weight", Shard.REPLICATE,
        shape=("1", "H")),
)

# transformers' Qwen2MoeConfig / Qwen3MoeConfig defaults for keys a config.json may omit
# (models/qwen2_moe/configuration_qwen2_moe.py, models/qwen3_moe/configuration_qwen3_moe.py).
QWEN2_MOE_DEFAULTS = MappingProxyType({**QWEN_DEFAULTS, "intermediate_size": 5632})
QWEN3_MOE_DEFAULTS = MappingProxyType({**QWEN_DEFAULTS, "intermediate_size": 6144})
HF_MOE_DEFAULTS = {
    "qwen2_moe": MappingProxyType({"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                   "shared_expert_intermediate_size": 5632}),
    "qwen3_moe": MappingProxyType({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}),
}
_EVERY_LAYER = "only checkpoints whose every layer is a mixture of experts convert (TensorRT-LLM's Qwen converter)"


# transformers 5 saves Qwen3MoeConfig's num_experts as num_local_experts (its attribute_map); released
# checkpoints spell num_experts, and AutoConfig, which upstream's QWenConfig reads through, answers both.
ALIASES = {"num_experts": "num_local_experts"}


def _int_at_least(cfg: dict, kind: str, key: str, least: int, origin: str) -> int:
    value = cfg.get(key, cfg.get(ALIASES.get(key, key), HF_MOE_DEFAULTS[kind][key]))
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ToolchainError(f"{origin}: {key} must be an integer >= {least}, got {value!r}")
    return value


def _experts(cfg: dict, params, kind: str, origin: str):
    """What both Qwen MoE families share: the routed experts, their normalisation, every layer a mixture."""
    experts = _int_at_least(cfg, kind, "num_experts", 2, origin)  # one expert is a dense MLP upstream (has_moe)
    top_k = _int_at_least(cfg, kind, "num_experts_per_tok", 1, origin)
    if top_k > experts:
        raise ToolchainError(f"{origin}: num_experts_per_tok {top_k} exceeds num_experts {experts}")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ToolchainError(f"{origin}: decoder_sparse_step {cfg.get('decoder_sparse_step', 1)!r} and "
                             f"mlp_only_layers {cfg.get('mlp_only_layers')!r} leave dense layers between the "
                             "mixtures", _EVERY_LAYER)
    if params.hidden_act != "silu":
        raise ToolchainError(f"{origin}: {params.architecture} with hidden_act {params.hidden_act!r}",
                             f"TensorRT-LLM builds {kind} experts as swiglu (silu-gated) only")
    # HF's norm_topk_prob defaults to false in both configs
    norm = bool(cfg.get("norm_topk_prob", False))
    return dataclasses.replace(params, num_experts=experts, top_k=top_k,
                               moe_normalization="renormalize" if norm else "none",
                               moe_intermediate_size=_int_at_least(cfg, kind, "moe_intermediate_size", 1, origin))


def _qwen2_moe(cfg: dict, params, origin: str):
    if cfg.get("qkv_bias", True) is not True:
        raise ToolchainError(f"{origin}: Qwen2MoeForCausalLM with qkv_bias {cfg['qkv_bias']!r}",
                             "TensorRT-LLM builds every qwen2_moe attention with q/k/v biases; only qkv_bias true "
                             "checkpoints convert")
    params = _experts(cfg, params, "qwen2_moe", origin)
    return dataclasses.replace(
        params, attention_bias=True, sliding_window=uniform_window(cfg, params, origin),
        shared_expert_size=_int_at_least(cfg, "qwen2_moe", "shared_expert_intermediate_size", 1, origin))


def _qwen3_moe(cfg: dict, params, origin: str):
    if params.attention_bias:
        raise ToolchainError(f"{origin}: Qwen3MoeForCausalLM with attention_bias=true",
                             "QWenConfig writes attn_bias false for every qwen3_moe; only attention_bias=false "
                             "checkpoints convert")
    if cfg.get("use_sliding_window"):
        raise ToolchainError(f"{origin}: Qwen3MoeForCausalLM with use_sliding_window true",
                             "only full-attention Qwen3-MoE checkpoints convert")
    return dataclasses.replace(_experts(cfg, params, "qwen3_moe", origin), qk_layernorm=True)


def _extra(kind: str):
    def extra(params) -> dict:
        # QWenConfig writes both widths for every Qwen type, 0 where HF has no such key (qwen3_moe's shared expert)
        return {"qwen_type": kind, "seq_length": params.max_position_embeddings, "hidden_act": "swiglu",
                "moe_intermediate_size": params.moe_intermediate_size,
                "moe_shared_expert_intermediate_size": params.shared_expert_size, "moe": moe.config_section(params)}
    return extra


QWEN2_MOE = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    rows=moe.with_experts(llama_rows(qkv_bias=True, dense_bias=False), *ROUTED_ROWS, *SHARED_ROWS),
    defaults=QWEN2_MOE_DEFAULTS,
    config_extra=_extra("qwen2_moe"),
    normalize=_qwen2_moe,
    quantization=moe.quantization_refusal,
    decoder=QWEN_DECODER,
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    rows=moe.with_experts(llama_rows(qkv_bias=False, dense_bias=False, qk_norm=True), *ROUTED_ROWS),
    defaults=QWEN3_MOE_DEFAULTS,
    config_extra=_extra("qwen3_moe"),
    normalize=_qwen3_moe,
    quantization=moe.quantization_refusal,
    decoder=QWEN_DECODER,
    duplicates_kv_block_scales=True,  # Qwen3MoeHfWeightMapper lists weight_scale_inv
    engine_refusal=("TensorRT-LLM 1.2.1's engine path does not build Qwen3-MoE (tensorrt_llm/models/qwen/model.py "
                    "sizes its experts by intermediate_size and has no q/k norms; examples/models/core/qwen/README.md "
                    "runs Qwen3 MoE on the PyTorch backend only)"),
)
