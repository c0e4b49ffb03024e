"""A model's own multi-token-prediction layers in the memory plan (speculative.mode mtp).

TensorRT-LLM's MTPDecodingConfig loads the checkpoint's MTP layers beside the model (_torch/models/
modeling_deepseekv3.py DeepseekV3MTP; checkpoint/mtp.py converts them for the CPU stand-in): each is a whole decoder
layer, of the kind its index gives it (a mixture of experts in DeepSeek-V3, whose dense layers come first), split
over the ranks as the others are, plus eh_proj [H, 2H] and three norms (enorm, hnorm, shared_head.norm) whole on
every rank; the embedding and lm_head are the main model's. Each layer keeps its own KV cache, one more layer per
token (the CPU engine's pool holds it as layer num_hidden_layers; that TensorRT-LLM's KV cache manager adds the MTP
layers to num_layers the same way is UNVERIFIED). They sit with the last stage; pipeline parallelism with MTP is
refused upstream ("PP + MTP combination is not supported").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolchain.archs.params import ArchParams
from toolchain.plan.memory import rank_weights

OWN_NORMS = 3  # enorm, hnorm, shared_head.norm


def weight_bytes(p: ArchParams, layers: int, *, dt_bytes: int, stored: bool = False, **common: Any) -> int:
    """Bytes of `layers` MTP layers on one rank: the decoder layers as rank_weights counts layers num_hidden_layers..
    (the difference a model with them counted in makes at pp 1), eh_proj and the norms in the model dtype."""
    if not layers:
        return 0
    at = {**common, "pp_rank": 0, "pp": 1, "dt_bytes": dt_bytes, "stored": stored}
    longer = dataclasses.replace(p, num_hidden_layers=p.num_hidden_layers + layers)
    decoder = rank_weights(longer, **at).total - rank_weights(p, **at).total
    h = p.hidden_size
    return decoder + layers * (2 * h * h + OWN_NORMS * h) * dt_bytes
