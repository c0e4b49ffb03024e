"""Multi-token prediction (DeepSeek-V3's MTP module) on the CPU engine: its weights and its drafts.

What speculative.mode mtp runs on the LLM API's CPU stand-in (target llmapi-cpu), as TensorRT-LLM's MTP worker does
with num_nextn_predict_layers 1 (_torch/speculative/mtp.py, MTPWorker; _torch/models/modeling_deepseekv3.py
DeepseekV3MTP; DeepSeek-V3 paper §2.2). The MTP layer sits after the main layers (global layer num_layers, pp 1)
and pairs each position t with the token after it:

    x_t = eh_proj([enorm(embed(token_{t+1})) ; hnorm(h_t)])

h_t being the main model's last hidden state at t after its final norm, what the model hands the MTP worker (the
hidden states TensorRT-LLM's DeepseekV3Model returns, normed by model.norm, which vLLM's and SGLang's MTP layers take
too; the paper's "representation given by the main model" does not say which, and its eq. 21 writes the hidden half
first, where eh_proj's name and those implementations put the embedding first: both as recalled, UNVERIFIED against
the source here). The decoder layer (MLA attention over its own KV cache layer, at the main model's positions, and the
mixture of experts) runs over x, and lm_head(shared_head.norm(out_t)) predicts token_{t+2}. The embedding and lm_head
are the main model's (the paper's shared embedding and output head). Its draft is the argmax (greedy drafting).

Each step (engine.py CpuEngine.step) the main model verifies the draft riding on the last token (Sequence.verify:
greedy output is the target's own, so lossless), then the MTP layer runs over every position whose next token is
now known, the accepted ones included, writing its cache entry there, and drafts from the last. A block reused
from the prefix cache brings the MTP entries of the request that filled it; only the drafts can differ by that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolchain.engine.cpu.linear import Linear
from toolchain.engine.cpu.qlinear import make_linear

NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
"""An MTP layer's own tensors under its layer prefix (archs/deepseek_v3.py MTP_ROWS), whole on every rank."""


@dataclass
class MtpShard:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Linear
    head_norm: torch.Tensor


def tensors(prefix: str, hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    shapes = {"eh_proj.weight": (hidden, 2 * hidden)}
    return {f"{prefix}.{name}": (shapes.get(name, (hidden,)), "float") for name in NAMES}


def load(t: dict[str, torch.Tensor], prefix: str) -> MtpShard:
    return MtpShard(t[f"{prefix}.enorm.weight"], t[f"{prefix}.hnorm.weight"],
                    make_linear(t, f"{prefix}.eh_proj", False, None), t[f"{prefix}.shared_head.norm.weight"])


def replicas(prefix: str, a: MtpShard | None, b: MtpShard | None) -> list[tuple[str, Any, Any]]:
    """The tensors every rank holds whole, paired for weights.check_replicas."""
    if a is None or b is None:
        return []
    return [(f"{prefix}.enorm.weight", a.enorm, b.enorm), (f"{prefix}.hnorm.weight", a.hnorm, b.hnorm),
            (f"{prefix}.eh_proj.weight", a.eh_proj.weight, b.eh_proj.weight),
            (f"{prefix}.shared_head.norm.weight", a.head_norm, b.head_norm)]


def positions_known(start: int, fed: int, accepted: int, tokens: int) -> int:
    """Positions from `start` whose next token is known after a step that fed `fed` tokens and accepted `accepted`
    draft tokens, for a sequence now `tokens` long: every fed or accepted one but a last whose successor was never
    emitted (the request ended on end_id)."""
    return max(0, min(fed + accepted, tokens - start - 1))
