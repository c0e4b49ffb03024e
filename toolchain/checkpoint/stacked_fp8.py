"""Llama 4's experts in FP8: one e4m3 tensor per layer and projection, written in the Hugging Face format for the
LLM-API path and imported back as stored for the CPU stand-in.

The layout (archs/llama4.py's docstring gives the upstream sources): a MoE layer stores feed_forward.experts.
gate_up_proj e4m3 [E, H, 2I] (gate half first) and down_proj e4m3 [E, I, H], transformers' bmm layout kept, beside
`<name>_weight_scale` and `<name>_input_scale`, each one float32 scalar for every expert of the layer (ModelOpt's
unified_export_hf._export_quantized_weight on Llama4TextExperts, quantizer_attr_names; read by TensorRT-LLM's
FP8QDQFusedMoEMethod in MoEWeightLoadingMode.FUSED_GATE_UP_PROJ without an expert index). The weight scale is the
amax of the whole stack / 448 (ModelOpt's per-tensor weight quantizer over the 3-D parameter); the input scales are
calibrated (quant/calibration_llama4.py): gate_up's over the block's input, which bounds every routed input
(Llama4TextMoe scales it by a sigmoid), down's over every expert's down input on every token.

Imported, each rank holds what every FP8 expert stack here holds (checkpoint/quantize.py, MOEWeightWrapper's FP8
layout): weight [E_r, out, in] e4m3 ([up; gate] per expert for fc, cut by sharding.split_stacked_experts), one
weights_scaling_factor per expert [E_r, 1] (here all the layer's one scale) and activation_scaling_factor [1].
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from toolchain.archs.common import STACKED_EXPERT_SHARDS, Shard
from toolchain.checkpoint import sharding
from toolchain.errors import ToolchainError
from toolchain.quant import fp8 as fp8_q

SCALES = ("_weight_scale", "_input_scale")


def is_stacked(row) -> bool:
    return row.shard in STACKED_EXPERT_SHARDS


def export_layer(out: dict[str, torch.Tensor], rows, layer: int, stats) -> None:
    """Quantize one MoE layer's stacked experts in `out` (HF name -> tensor) in place."""
    inputs = {Shard.STACKED_EXPERT_FC: float(stats.inputs["mlp"].amax.max()),
              Shard.STACKED_EXPERT_PROJ: max(stats.expert_proj_amax)}
    for row in rows:
        name = row.hf.replace("{layer}", str(layer))
        w, scale = fp8_q.quantize_fp8_weight(out[name].float())
        out[name], out[name + "_weight_scale"] = w, scale.reshape(())
        out[name + "_input_scale"] = fp8_q.fp8_scale(inputs[row.shard]).reshape(())


def hidden_scales(raw: dict[str, Any]) -> set[str]:
    """The scale tensors beside stacked e4m3 experts (hidden from the name tables, read by `write`)."""
    return {name + suffix for name, info in raw.items() if info.dtype == fp8_q.FP8_DTYPE
            and not name.endswith(".weight") for suffix in SCALES if name + suffix in raw}


def check_stored(raw: dict[str, Any], name: str, algo: str | None, where) -> None:
    """A stacked expert tensor stored quantized must be FP8 with its two scalar scales."""
    if algo != "FP8":
        raise ToolchainError(f"{where}: {name} is a stacked expert tensor stored as {algo}",
                             "Llama 4's stacked experts are imported in FP8 only; convert the unquantized model")
    for suffix in SCALES:
        got = raw.get(name + suffix)
        if got is None or tuple(got.shape) not in ((), (1,)):
            raise ToolchainError(f"{where}: {name} is stored quantized but has no scalar {name}{suffix}",
                                 "the checkpoint is not a ModelOpt Llama 4 FP8 export; re-export it")


def write(prefix: str, output, source: str, read: Callable[[str], torch.Tensor], tp: int, mapping,
          ranks: list[int]) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """rank -> [(name, tensor)] of one stacked expert output imported as stored (the e4m3 bytes are cut, never
    re-rounded: every expert of the layer shares the one weight scale)."""
    fc = output.row.shard is Shard.STACKED_EXPERT_FC
    weight = read(source)
    scale = read(source + "_weight_scale").float().reshape(1)
    act = read(source + "_input_scale").float().reshape(1)
    pieces = sharding.split_stacked_experts(weight.view(torch.uint8), fc, tp, mapping.moe_tp, mapping.moe_ep)
    return {rank: [(f"{prefix}.weight", piece.contiguous().view(fp8_q.FP8_DTYPE)),
                   (f"{prefix}.weights_scaling_factor", scale.expand(piece.shape[0], 1).contiguous()),
                   (f"{prefix}.activation_scaling_factor", act.clone())]
            for rank, piece in zip(ranks, pieces, strict=True)}


# The HF-format export's shared-input groups of a Llama 4 layer beyond attention's (hf_quant.GROUPS' shape: calibration
# slot, linears, the norm feeding them or None; the norm matters to AWQ only, which MoE exports refuse).
FEED_FORWARD_GROUPS = {
    "moe": (("mlp", ("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"), None),
            ("shared_proj", ("feed_forward.shared_expert.down_proj",), None)),
    "dense": (("mlp", ("feed_forward.gate_proj", "feed_forward.up_proj"), "post_attention_layernorm"),
              ("proj", ("feed_forward.down_proj",), None)),
}


def text_prefix(rows) -> str:
    """Where the text model's tensors sit: "" (Llama4ForCausalLM) or "language_model." (the multimodal checkpoint)."""
    return rows[0].hf.split("model.layers.")[0] if rows else ""


def kept(prefix: str) -> list[str]:
    """A multimodal checkpoint's modules the export keeps unquantized beyond hf_quant.ALWAYS_IGNORED: the text model's
    embedding and lm_head under their prefixed names, and the vision tower, written as stored (the PyTorch backend
    builds Llama4ForConditionalGeneration from the whole checkpoint; whether 1.2.1 reads the vision tower is
    UNVERIFIED, archs/llama4.py)."""
    if not prefix:
        return []
    return [f"{prefix}lm_head", f"{prefix}model.embed_tokens", "multi_modal_projector*", "vision_model*"]
