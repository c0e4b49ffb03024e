"""One rank's mixture-of-experts MLP: the router every rank holds in full and this rank's experts.

What the ranks hold is TensorRT-LLM's layout (checkpoint/sharding.py split_experts): experts divided
over moe_ep, each expert's width over moe_tp. Every rank routes every token (the router is replicated,
as MixtureOfExperts' RowLinear(tp_size=1) is upstream) and runs the tokens routed to its own experts,
each expert once per step over all its tokens; its output is a partial sum that is zero for tokens
routed elsewhere, and the all-reduce the dense MLP already uses sums the ranks' parts, which is how
upstream's MoE plugin combines tp and ep ranks (tensorrt_llm/layers/moe.py at 03961722: the plugin
output is allreduce'd over the tp group).

Routing follows HF's MixtralTopKRouter (transformers models/mixtral/modeling_mixtral.py): softmax over
all experts in float32, top-k, then divided by the sum of the k for "renormalize"
(ExpertScaleNormalizationMode.RENORMALIZE), or the k probabilities as they are for "none" (Qwen2-MoE's
norm_topk_prob false: Qwen2MoeTopKRouter).

A quantized checkpoint's experts run as its linears do (engine/cpu/qlinear.py): each expert of the stack is
one `Linear` of the stored format, built from its slice of the stacked tensors (`expert_linears`), so an
int8/int4 weight-only expert is quantized per output channel of that expert alone, as trtllm-build does
(weight_only_quantize on a batched matrix, tensorrt_llm/models/convert_utils.py), and an FP8 expert carries
its own weight scale. The router stays float32 in every format ("Router should never be quantized",
tensorrt_llm/models/llama/convert.py): a checkpoint whose exclude_modules would let trtllm-build quantize it
(or the shared_expert_gate) is refused at load as upstream's build refuses it (weights.py
check_kept_unquantized, quant/exclude.py).

Qwen2-MoE adds a shared expert every token runs, a dense swiglu MLP split over the tp ranks like any MLP,
scaled per token by sigmoid(shared_expert_gate(x)); the gate [1, H] is whole on every rank, so each rank
scales its partial sum and the same all-reduce completes it (SharedMoE.forward in tensorrt_llm/layers/moe.py:
routed_output + sigmoid(gate(x)) * shared_expert(x), then one allreduce).

DeepSeek-V3 routes by groups with sigmoid scores and a correction bias (routing.py, `grouped`) and adds its shared
expert unscaled (no gate: DeepseekV3MoE in transformers' modeling_deepseek_v3.py).
gpt-oss adds biases (archs/gpt_oss.py): the router's, added to its logits before the softmax (HF GptOssTopKRouter:
top-k of the biased logits, softmax over the k, which is this softmax, top-k and renormalisation), and the experts'
fc and proj biases, the proj one added before the routing weight (GptOssExperts.forward); every moe_tp slice of an
expert holds that whole bias, so only the ranks of moe_tp slice 0 add it (`proj_bias`) and the all-reduce adds it
once. Its experts' activation is the clamped SwiGLU (clamped_swiglu.py), given as `activation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from toolchain.engine.cpu.linear import Linear
from toolchain.engine.cpu.routing import GroupedRouting

RENORMALIZE = 1  # ExpertScaleNormalizationMode values (archs/moe.py NORMALIZATION)
# Llama 4's router (transformers models/llama4/modeling_llama4.py Llama4Router, Llama4TextMoe.forward): the sigmoid
# of each chosen expert's logit multiplies the token before that expert runs (SiLU-gated experts are not
# homogeneous, so this differs from scaling the output); its shared expert is added with no gate.
SIGMOID_INPUT = "sigmoid_input"


@dataclass
class Experts:
    router: torch.Tensor
    """[E, H] float32, every expert's routing row, the same on every rank."""
    fc: list[Linear]
    """Per expert of this rank, [w3 (linear); w1 (SiLU-activated)] rows of its moe_tp slice: out 2 I_r, in H."""
    proj: list[Linear]
    """Per expert, w2's columns of its moe_tp slice: out H, in I_r."""
    first: int
    """Global index of this rank's first expert (its experts are contiguous: Mapping.ep_experts)."""
    top_k: int
    normalization: int
    shared_fc: Linear | None = None
    """[2 S_r, H]: the shared expert's [up (linear); gate (SiLU-activated)] rows of this rank's tp slice."""
    shared_proj: Linear | None = None
    """[H, S_r]: the shared expert's down_proj columns of this rank's tp slice."""
    shared_gate: torch.Tensor | None = None
    """[1, H]: shared_expert_gate, whole on every rank; None adds the shared expert ungated (DeepSeek-V3, Llama 4)."""
    router_kind: str = "softmax"
    """archs/common.py Decoder.moe_router: "softmax", or "sigmoid_input" (Llama 4)."""
    grouped: GroupedRouting | None = None
    """DeepSeek-V3's grouped sigmoid routing (routing.py) in place of the softmax top-k."""
    score_bias: torch.Tensor | None = None
    """[E] float32: the grouped routing's e_score_correction_bias, whole on every rank."""
    router_bias: torch.Tensor | None = None
    """[E] float32: gpt-oss's router bias, the same on every rank."""
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """act(up, gate) of the experts; None: silu(gate) * up."""
    proj_bias: bool = True
    """Whether this rank adds the experts' proj bias (held whole by every moe_tp slice; added by slice 0 only)."""

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) of every token."""
        if self.grouped is not None and self.score_bias is not None:
            return self.grouped.route(h.float() @ self.router.T, self.score_bias, self.top_k)
        if self.router_kind == SIGMOID_INPUT:
            # Llama4Router: top-k of the logits, each one's sigmoid (the others' sigmoid(-inf) = 0)
            top, ids = (h @ self.router.T).topk(self.top_k, dim=-1)
            return torch.sigmoid(top.float()), ids
        logits = h @ self.router.T
        if self.router_bias is not None:
            logits = logits + self.router_bias
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalization == RENORMALIZE:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of the MLP output [N, H]: the weighted outputs of its experts."""
        weights, ids = self.route(h)
        out = torch.zeros_like(h)
        local = ids - self.first
        for e in range(len(self.fc)):
            tokens, slot = (local == e).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            x = h[tokens]
            weight = weights[tokens, slot, None].to(x.dtype)
            on_input = self.router_kind == SIGMOID_INPUT  # Llama4TextMoe scales the expert's input, not its output
            if on_input:
                x = x * weight
            up, gate = self.fc[e](x).chunk(2, dim=-1)
            act = F.silu(gate) * up if self.activation is None else self.activation(up, gate)
            y = self.proj[e](act, add_bias=self.proj_bias)
            out.index_add_(0, tokens, y if on_input else y * weight.to(y.dtype))
        if self.shared_fc is not None and self.shared_proj is not None:
            up, gate = self.shared_fc(h).chunk(2, dim=-1)
            shared = self.shared_proj(F.silu(gate) * up)
            out += shared if self.shared_gate is None else torch.sigmoid(h @ self.shared_gate.T) * shared
        return out


def expert_slices(tensors: dict[str, torch.Tensor], prefix: str, experts: int) -> list[dict[str, torch.Tensor]]:
    """The stacked tensors of `prefix` (mlp.fc or mlp.proj) as one dict per expert: each is cut per expert but
    the activation scale the experts share, which goes to each whole (weights.py expert_stack)."""
    mine = {n: t for n, t in tensors.items() if n.startswith(prefix + ".")}
    return [{n: t if n.endswith(".activation_scaling_factor") else t[e] for n, t in mine.items()}
            for e in range(experts)]
