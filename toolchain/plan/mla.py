"""Multi-head latent attention (DeepSeek-V3) in the memory plan: its projections per rank and its KV cache.

Weights (transformers 5.25 DeepseekV3Attention; the split is convert's, archs/deepseek_v3.py): q_a_proj
[q_lora_rank, H] and kv_a_proj_with_mqa [kv_lora_rank + qk_rope_head_dim, H] whole on every rank with their two
norms, q_b_proj [heads/tp x (qk_nope + qk_rope), q_lora_rank] and kv_b_proj [heads/tp x (qk_nope + v_head),
kv_lora_rank] split by head, o_proj [H, heads/tp x v_head] split by its head-major columns.

KV cache: TensorRT-LLM's PyTorch backend allocates an MLA model's cache as CacheType.SELFKONLY with num_kv_heads=1
and head_dim = kv_lora_rank + qk_rope_head_dim over num_hidden_layers (_torch/pyexecutor/_util.py, `if
is_mla(config)`; notes i36-facts §3.5): one latent per token per layer, keys only, the same on every tp rank (one
head cannot be split), so it is not divided by tp. DeepSeek-V3: 61 x 576 x 2 B = 70,272 B per token in bf16.
"""

from __future__ import annotations

from toolchain.archs.params import ArchParams


def linear_shapes(p: ArchParams, tp: int) -> list[tuple[str, int, int]]:
    """(name, out, in) of one layer's attention linears on one rank, the widest per-head one first."""
    m, h, heads = p.mla or {}, p.hidden_size, p.num_attention_heads // tp
    return [("q_b", heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]), m["q_lora_rank"]),
            ("q_a", m["q_lora_rank"], h),
            ("kv_a", m["kv_lora_rank"] + m["qk_rope_head_dim"], h),
            ("kv_b", heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]),
            ("dense", h, heads * m["v_head_dim"])]


def norm_values(p: ArchParams) -> int:
    """Values of one layer's latent norms (q_a_layernorm, kv_a_layernorm), whole on every rank."""
    m = p.mla or {}
    return m["q_lora_rank"] + m["kv_lora_rank"]


def kv_values_per_token(p: ArchParams) -> int:
    """Values one token's cache holds per layer: the latent and the shared rope key."""
    m = p.mla or {}
    return m["kv_lora_rank"] + m["qk_rope_head_dim"]
