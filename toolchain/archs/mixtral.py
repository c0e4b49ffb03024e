"""Mixtral: HF MixtralForCausalLM -> TensorRT-LLM checkpoint with `architecture: "MixtralForCausalLM"`,
which MODEL_MAP sends to the Llama implementation (TensorRT-LLM tensorrt_llm/models/__init__.py) and the
Llama converter converts (tensorrt_llm/models/llama/convert.py at 04a2cacb, `if moe_config.has_moe()`).

Attention and norms are Llama's. The MLP of every layer is a mixture of experts:
- router: `block_sparse_moe.gate.weight` [E, H] -> `mlp.router.weight`, kept float32 ("Router should
  never be quantized") and whole on every rank (MixtureOfExperts builds it as RowLinear(tp_size=1,
  dtype float32): tensorrt_llm/layers/moe.py at 03961722);
- experts: `block_sparse_moe.experts.{e}.w1/w3` [I, H] are stacked over the rank's experts and
  concatenated as [w3; w1] into `mlp.fc.weight` [E_r, 2 I/moe_tp, H] (w3 the linear half, w1 the
  activated one: "The left matrix is a linear projection (no activation applied), the right matrix is
  the gating value", MixtureOfExperts.init_experts), `w2` [H, I] into `mlp.proj.weight` [E_r, H, I/moe_tp].
config.json carries `hidden_act: "swiglu"` and the `moe` section (num_experts from num_local_experts,
top_k from num_experts_per_tok, normalization RENORMALIZE: tensorrt_llm/models/llama/config.py at
04100fd0, `if hf_config.model_type in ["mixtral", ...]`).

The LLM-API path serves the HF checkpoint as it is: the PyTorch backend registers MixtralForCausalLM
(tensorrt_llm/_torch/models/modeling_mixtral.py at 000a01de, `@register_auto_model`) with
RenormalizeMoeRoutingMethod(top_k) and its gate Linear in the model dtype (not float32, as the engine
path's router is), and shards the experts by the same Mapping (LLM()'s moe_expert_parallel_size,
moe_tensor_parallel_size).

Quantized: the formats archs/moe.py EXPERT_METHODS lists; every other is refused at plan and convert
(archs/moe.py quantization_refusal).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from toolchain.archs import moe
from toolchain.archs.common import Family, Row, Shard
from toolchain.archs.llama import L, T, llama_rows
from toolchain.archs.params import as_window
from toolchain.errors import ToolchainError

E = f"{L}.block_sparse_moe.experts.{{expert}}"

MOE_ROWS = (
    Row(f"{L}.block_sparse_moe.gate.weight", f"{T}.mlp.router.weight", Shard.REPLICATE, dtype="float32",
        shape=("E", "H")),
    Row(f"{E}.w3.weight", f"{T}.mlp.fc.weight", Shard.EXPERT_FC, part="w3", shape=("I", "H")),
    Row(f"{E}.w1.weight", f"{T}.mlp.fc.weight", Shard.EXPERT_FC, part="w1", shape=("I", "H")),
    Row(f"{E}.w2.weight", f"{T}.mlp.proj.weight", Shard.EXPERT_PROJ, shape=("H", "I")),
)

# transformers' MixtralConfig defaults for keys a config.json may omit.
MIXTRAL_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "max_position_embeddings": 4096 * 32,
    "hidden_act": "silu",
})
DEFAULT_EXPERTS, DEFAULT_TOP_K = 8, 2  # MixtralConfig's num_local_experts, num_experts_per_tok


def normalize(cfg: dict, params, origin: str):
    experts = cfg.get("num_local_experts", DEFAULT_EXPERTS)
    top_k = cfg.get("num_experts_per_tok", DEFAULT_TOP_K)
    # One expert is no mixture: upstream converts it as a dense MLP (MoeConfig.has_moe: num_experts > 1).
    for key, value, least in (("num_local_experts", experts, 2), ("num_experts_per_tok", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ToolchainError(f"{origin}: {key} must be an integer >= {least}, got {value!r}")
    if top_k > experts:
        raise ToolchainError(f"{origin}: num_experts_per_tok {top_k} exceeds num_local_experts {experts}")
    if params.hidden_act != "silu":
        # upstream writes "swiglu" for every mixtral, i.e. SiLU-gated experts
        raise ToolchainError(f"{origin}: MixtralForCausalLM with hidden_act {params.hidden_act!r}",
                             "TensorRT-LLM builds Mixtral experts as swiglu (silu-gated) only")
    return dataclasses.replace(params, num_experts=experts, top_k=top_k, moe_normalization="renormalize",
                               sliding_window=as_window(cfg.get("sliding_window"), origin))


def config_extra(params) -> dict:
    return {"hidden_act": "swiglu", "moe": moe.config_section(params)}


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    rows=moe.with_experts(llama_rows(), *MOE_ROWS),
    defaults=MIXTRAL_DEFAULTS,
    config_extra=config_extra,
    normalize=normalize,
    quantization=moe.quantization_refusal,
)
