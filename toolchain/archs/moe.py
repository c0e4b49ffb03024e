"""Mixture-of-experts facts every MoE family shares: how expert parallelism is derived and checked,
which rank holds which experts, and the checkpoint config.json's `moe` section.

Read from TensorRT-LLM's source (the stored versions named by commit; none is the 1.2.1 tag itself, see
toolchain/upstream/facts/mapping.json's note):
- tensorrt_llm/mapping.py at b35ac1b6, MappingBase.__init__: moe_tp_size and moe_ep_size default to -1;
  both unset gives moe_tp = tp and moe_ep = 1, one unset is derived as tp // (the other), and
  "moe_tp_size * moe_ep_size * moe_cluster_size must equal to moe_world_size" (moe_world_size = tp_size
  with cp 1) is a ValueError. moe_tp_rank = tp_rank // moe_ep_size, moe_ep_rank = tp_rank % moe_ep_size,
  and ep_experts gives rank r the contiguous experts [r * E/ep, (r + 1) * E/ep).
- tensorrt_llm/layers/moe.py at 03961722, MixtureOfExperts.__init__: "Number of experts ... is not a
  multiple of EP size" and "FFN Hidden Size ... is not a multiple of TP size" (moe_tp) are ValueErrors;
  MoeConfig holds num_experts, top_k, normalization_mode (ExpertScaleNormalizationMode NONE 0,
  RENORMALIZE 1, SPARSE_MIXER 2), sparse_mixer_epsilon 0.01 and tp_mode 0, and to_dict is asdict.
"""

from __future__ import annotations

from typing import Any

from toolchain.archs.common import Refusal, Row

# ExpertScaleNormalizationMode (tensorrt_llm/layers/moe.py): how the top-k routing weights are scaled.
# "renormalize": softmax over every expert, top-k, divided by their sum (what HF Mixtral computes; upstream's
# OOTB path does top-k on the logits then softmax over the k, the same numbers, as the maintainers answered when
# TensorRT-LLM PR #2752 proposed NONE for Mixtral, closed unmerged). "none": the softmax
# probabilities of the k as they are (Qwen2-MoE's norm_topk_prob false).
NORMALIZATION = {"none": 0, "renormalize": 1}
SPARSE_MIXER_EPSILON = 0.01  # MoeConfig's default, written as upstream's asdict would


def moe_sizes(tp: int, moe_tp: int | None, moe_ep: int | None) -> tuple[int, int]:
    """(moe_tp, moe_ep) as upstream's Mapping derives them from the ones given (None: not given).
    The product may differ from tp here; `mapping_problems` says so."""
    if moe_tp is None and moe_ep is None:
        return tp, 1
    if moe_tp is None:
        return tp // moe_ep if moe_ep else tp, moe_ep or 1
    if moe_ep is None:
        return moe_tp, tp // moe_tp
    return moe_tp, moe_ep


def mapping_problems(tp: int, moe_tp: int | None, moe_ep: int | None) -> list[str]:
    """What upstream's Mapping refuses about these sizes, before the model is known."""
    mtp, mep = moe_sizes(tp, moe_tp, moe_ep)
    if mtp * mep == tp:
        return []
    if moe_tp is not None and moe_ep is not None:
        what = f"moe_tp={moe_tp} x moe_ep={moe_ep} = {moe_tp * moe_ep}"
    else:
        key, value = ("moe_tp", moe_tp) if moe_tp is not None else ("moe_ep", moe_ep)
        what = f"{key}={value} does not divide it"
    return [f"parallelism.tp={tp}: {what}; moe_tp x moe_ep must equal tp (TensorRT-LLM's Mapping)"]


def model_problems(params: Any, tp: int, moe_tp: int | None, moe_ep: int | None) -> list[str]:
    """Mapping problems, then what the experts of this model refuse (MixtureOfExperts.__init__)."""
    problems = mapping_problems(tp, moe_tp, moe_ep)
    if problems:
        return problems
    mtp, mep = moe_sizes(tp, moe_tp, moe_ep)
    if not params.is_moe:
        if (moe_tp, moe_ep) != (None, None) and (mtp, mep) != (tp, 1):
            return [f"parallelism.moe_tp/moe_ep apply to mixture-of-experts models; {params.architecture} is "
                    "dense"]
        return []
    if params.num_experts % mep:
        return [f"moe_ep={mep} does not divide num_experts={params.num_experts}"]
    if params.expert_size % mtp:
        return [f"moe_tp={mtp} does not divide the expert {_width_key(params)}={params.expert_size}"]
    if params.shared_expert_size % tp:
        # the shared expert is a dense MLP split over all of tp, not over moe_tp (SharedMoE's MLP(tp_size=tp))
        return [f"tp={tp} does not divide shared_expert_intermediate_size={params.shared_expert_size}"]
    return []


def _width_key(params: Any) -> str:
    """The config.json key that holds the experts' width."""
    return "moe_intermediate_size" if params.moe_intermediate_size else "intermediate_size"


def fitting_sizes(params: Any, tp: int) -> str:
    """The hint after a refusal: the (moe_tp, moe_ep) pairs that split this model at this tp."""
    if not params.is_moe:
        return "remove parallelism.moe_tp and parallelism.moe_ep"
    if params.shared_expert_size % tp:
        return "use a parallelism.tp that divides shared_expert_intermediate_size"
    fits = [(t, tp // t) for t in range(1, tp + 1) if tp % t == 0 and params.expert_size % t == 0
            and params.num_experts % (tp // t) == 0]
    shown = ", ".join(f"moe_tp {t} with moe_ep {e}" for t, e in fits)
    return f"at tp {tp} use {shown}" if fits else "use another parallelism.tp"


def with_experts(dense_rows: tuple[Row, ...], *expert_rows: Row) -> tuple[Row, ...]:
    """A MoE family's rows: its dense sibling's rows without the MLP, plus the router and experts in its place
    (Mixtral after Llama, Qwen2/3-MoE after Qwen2/3: the attention and norms are the same tensors)."""
    return tuple(r for r in dense_rows if ".mlp." not in r.hf) + expert_rows


# What the stacked experts can be quantized to, per spec method (the rest is refused by `quantization_refusal`).
# Weight-only: the checkpoint keeps the experts in float and trtllm-build quantizes each [E, out, in] stack per
# expert per output channel (TensorRT-LLM tensorrt_llm/models/convert_utils.py at 9b3c7124,
# weight_only_quantize: a weight of dim > 2 is transposed on its last two axes and
# symmetric_quantize_last_axis_of_batched_matrix gives per_channel_scale [E, out]; weight_only_quantize_dict
# matches 'fc.weight'/'proj.weight', never 'router.weight', and excludes '*shared_expert_gate.weight').
# FP8: the stacks quantized per expert with one activation scale per stack (checkpoint/quantize.py, after
# MOEWeightWrapper in tensorrt_llm/layers/moe.py at c388fec7). AWQ: per-group int4 stacks with one prequant vector
# per stack (the same wrapper's has_per_group_scaling branch; checkpoint/quantize.py). A shared expert (Qwen2-MoE)
# is not written in fp8 or awq yet (its calibration slots are not collected): `quantization_refusal` says so.
EXPERT_METHODS = ("none", "int8_wo", "int4_wo", "fp8", "awq")
NOT_WITH_SHARED_EXPERT = ("fp8", "awq")
KV_CACHES = ("none", "int8", "fp8")


# Methods TensorRT-LLM's MoE has no path for: MixtureOfExperts (tensorrt_llm/layers/moe.py at c388fec7) quantizes
# experts as FP8 QDQ, NVFP4, per-group int4 or weight-only (MOEWeightWrapper.__init__, forward_experts), with no
# branch for SmoothQuant's int8 activations (no per-channel activation scale or smoother tensor is declared).
UPSTREAM_UNSUPPORTED = {"smoothquant": "TensorRT-LLM's MixtureOfExperts has no SmoothQuant (W8A8) experts"}


def quantization_refusal(params: Any, method: str, kv_cache: str, stored: str | None = None) -> Refusal | None:
    """Why a mixture-of-experts model cannot be quantized as asked (None: supported, or a dense model).
    `stored` names the format of a checkpoint that is quantized already (imports keep no expert layout yet)."""
    if not params.is_moe:
        return None
    methods = [m for m in EXPERT_METHODS[1:] if not (m in NOT_WITH_SHARED_EXPERT and params.shared_expert_size)]
    hint = (f"use quantization.method {' or '.join(methods)} with kv_cache {' or '.join(KV_CACHES)}, "
            "or convert the model unquantized")
    if method in UPSTREAM_UNSUPPORTED and not stored:
        return Refusal(f"quantization {method} on {params.architecture}: {UPSTREAM_UNSUPPORTED[method]}", hint)
    if stored:
        what = f"a pre-quantized checkpoint ({stored})"
    elif method not in EXPERT_METHODS:
        what = f"quantization {method}"
    elif kv_cache not in KV_CACHES:
        what = f"quantization.kv_cache {kv_cache}"
    elif method in NOT_WITH_SHARED_EXPERT and params.shared_expert_size:
        what = f"quantization {method} of a shared expert"
    else:
        return None
    return Refusal(f"{what} on {params.architecture} is not supported yet", hint)


def per_group_problem(params: Any, group: int, moe_tp: int) -> str | None:
    """Why per-group int4 (awq) experts cannot be cut at this moe_tp (None: they can). Each rank's proj holds
    I/moe_tp input columns in whole groups (weights_scaling_factor [experts, in/g, out] in MOEWeightWrapper,
    tensorrt_llm/layers/moe.py at c388fec7) and its fc 2 I/moe_tp output rows packed two per byte; the experts
    are never zero-padded as a dense MLP is (MixtureOfExperts takes the expert width as it is)."""
    if not params.is_moe:
        return None
    width = params.expert_size // moe_tp
    if width % group or width % 2:
        return (f"per-group int4 experts: the expert {_width_key(params)} per rank ({params.expert_size} / "
                f"moe_tp {moe_tp} = {width}) is not a multiple of the group size {group}")
    return None


def tile_problem(params: Any, tile: int, tp: int, moe_tp: int) -> str | None:
    """Why FP8 block-scale experts (DeepSeek-V3's, imported as stored: checkpoint/block_experts.py) cannot be cut at
    this tp / moe_tp (None: they can). Each rank's fc concatenates w3's and w1's grids, and the shared expert's fc
    up's and gate's, as TensorRT-LLM's fused gate/up loaders do, so each part's rows per rank are whole tiles."""
    if not params.is_moe:
        return None
    width = params.expert_size // moe_tp
    if width % tile:
        return (f"FP8 block-scale experts: the expert {_width_key(params)} per rank ({params.expert_size} / moe_tp "
                f"{moe_tp} = {width}) is not whole {tile}x{tile} tiles")
    if params.shared_expert_size and (params.shared_expert_size // tp) % tile:
        return (f"FP8 block-scale experts: the shared expert's width per rank ({params.shared_expert_size} / tp {tp} "
                f"= {params.shared_expert_size // tp}) is not whole {tile}x{tile} tiles")
    return None


def block_problem(params: Any, block: int, moe_tp: int) -> str | None:
    """Why experts stored in blocks of `block` input channels (MXFP4's 32, one E8M0 scale each) cannot be cut at this
    moe_tp (None: they can): each rank's proj takes I/moe_tp input columns and their scales, and its fc I/moe_tp rows
    of gate and of up, so the width per rank must be whole blocks (TensorRT-LLM's MXFP4 MoE loads the scales sliced
    with the weight, notes/i35-facts.md section 6.3)."""
    width = params.expert_size // moe_tp
    if params.is_moe and width % block:
        return (f"the expert {_width_key(params)} per rank ({params.expert_size} / moe_tp {moe_tp} = {width}) is not "
                f"whole blocks of {block}")
    return None


def rank_experts(num_experts: int, moe_ep: int, tp_rank: int) -> range:
    """The experts a TP rank holds (Mapping.ep_experts with moe_ep_rank = tp_rank % moe_ep)."""
    per = num_experts // moe_ep
    ep_rank = tp_rank % moe_ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def moe_tp_rank(tp_rank: int, moe_ep: int) -> int:
    """Which slice of each expert's width a TP rank holds (Mapping.moe_tp_rank, moe_cluster 1)."""
    return tp_rank // moe_ep


def config_section(params: Any) -> dict:
    """config.json's `moe`: MoeConfig.to_dict() (asdict) of this model."""
    return {"num_experts": params.num_experts, "top_k": params.top_k,
            "normalization_mode": NORMALIZATION[params.moe_normalization],
            "sparse_mixer_epsilon": SPARSE_MIXER_EPSILON, "tp_mode": 0}
