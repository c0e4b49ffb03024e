"""Llama family: HF LlamaForCausalLM -> TensorRT-LLM LLaMAForCausalLM checkpoint.

Names and shard rules from reference §2.1 and §3. `llama_rows` is
parametrised on the bias switches so Mistral (same table) and Qwen2 (q/k/v
bias only, no o_proj bias) can reuse it.
"""

from __future__ import annotations

from types import MappingProxyType

from toolchain.archs.common import Family, Row, Shard, Stage

L = "model.layers.{layer}"
T = "transformer.layers.{layer}"


def llama_rows(qkv_bias_when: str | None = "attention_bias",
               dense_bias_when: str | None = "attention_bias") -> tuple[Row, ...]:
    return (
        Row("model.embed_tokens.weight", "transformer.vocab_embedding.weight", Shard.EMBEDDING, stage=Stage.FIRST,
            shape=("V", "H")),
        Row(f"{L}.input_layernorm.weight", f"{T}.input_layernorm.weight", Shard.REPLICATE, shape=("H",)),
        Row(f"{L}.self_attn.q_proj.weight", f"{T}.attention.qkv.weight", Shard.QKV, part="q", shape=("Q", "H")),
        Row(f"{L}.self_attn.k_proj.weight", f"{T}.attention.qkv.weight", Shard.QKV, part="k", shape=("KV", "H")),
        Row(f"{L}.self_attn.v_proj.weight", f"{T}.attention.qkv.weight", Shard.QKV, part="v", shape=("KV", "H")),
        Row(f"{L}.self_attn.q_proj.bias", f"{T}.attention.qkv.bias", Shard.QKV, part="q", when=qkv_bias_when,
            shape=("Q",)),
        Row(f"{L}.self_attn.k_proj.bias", f"{T}.attention.qkv.bias", Shard.QKV, part="k", when=qkv_bias_when,
            shape=("KV",)),
        Row(f"{L}.self_attn.v_proj.bias", f"{T}.attention.qkv.bias", Shard.QKV, part="v", when=qkv_bias_when,
            shape=("KV",)),
        Row(f"{L}.self_attn.o_proj.weight", f"{T}.attention.dense.weight", Shard.ROW, shape=("H", "Q")),
        # Row-parallel bias: added once after the all-reduce, so every rank holds all of it (§3.1).
        Row(f"{L}.self_attn.o_proj.bias", f"{T}.attention.dense.bias", Shard.REPLICATE, when=dense_bias_when,
            shape=("H",)),
        Row(f"{L}.post_attention_layernorm.weight", f"{T}.post_layernorm.weight", Shard.REPLICATE, shape=("H",)),
        # Naming trap (§2.1): GatedMLP computes proj(act(fc(x)) * gate(x)), so the
        # activated branch `fc` is HF gate_proj and `gate` is HF up_proj.
        Row(f"{L}.mlp.gate_proj.weight", f"{T}.mlp.fc.weight", Shard.COLUMN, shape=("I", "H")),
        Row(f"{L}.mlp.up_proj.weight", f"{T}.mlp.gate.weight", Shard.COLUMN, shape=("I", "H")),
        Row(f"{L}.mlp.down_proj.weight", f"{T}.mlp.proj.weight", Shard.ROW, shape=("H", "I")),
        Row(f"{L}.mlp.gate_proj.bias", f"{T}.mlp.fc.bias", Shard.COLUMN, when="mlp_bias", shape=("I",)),
        Row(f"{L}.mlp.up_proj.bias", f"{T}.mlp.gate.bias", Shard.COLUMN, when="mlp_bias", shape=("I",)),
        Row(f"{L}.mlp.down_proj.bias", f"{T}.mlp.proj.bias", Shard.REPLICATE, when="mlp_bias", shape=("H",)),
        Row("model.norm.weight", "transformer.ln_f.weight", Shard.REPLICATE, stage=Stage.LAST, shape=("H",)),
        # Always written, even when tied (§1.1: the safest choice; §3.4).
        Row("lm_head.weight", "lm_head.weight", Shard.VOCAB, stage=Stage.LAST,
            tied_from="model.embed_tokens.weight", shape=("V", "H")),
        # Checkpoints saved by older transformers carry the RoPE buffer; the engine
        # recomputes it from rotary_base, so it is dropped rather than rejected.
        Row(f"{L}.self_attn.rotary_emb.inv_freq", None, Shard.DROP),
    )


# transformers' LlamaConfig defaults, for the optional keys a config.json may omit.
LLAMA_DEFAULTS = MappingProxyType({
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
})

FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    rows=llama_rows(),
    defaults=LLAMA_DEFAULTS,
)
