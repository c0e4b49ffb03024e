"""Llama family (Llama 2, 3, 3.1, 3.2): HF LlamaForCausalLM -> TensorRT-LLM
LLaMAForCausalLM checkpoint.

Names and shard rules follow TensorRT-LLM tensorrt_llm/models/llama/convert.py and
tensorrt_llm/models/convert_utils.py. `llama_rows` is
parametrised on the bias switches and the q/k norms so Mistral (same table),
Qwen2 (q/k/v bias only, no o_proj bias) and Qwen3 (per-head q/k RMSNorm)
reuse it. Llama 3.1/3.2's `llama3` RoPE needs nothing here: params.py
normalises every rope type, and small Llama 3.2 models' tied embeddings are
the lm_head row's `tied_from`.
"""

from __future__ import annotations

from types import MappingProxyType

from toolchain.archs.common import Family, Row, Shard, Stage
from toolchain.errors import ToolchainError

L = "model.layers.{layer}"
T = "transformer.layers.{layer}"


def _switch(flag: bool | str) -> tuple[bool, str | None]:
    """(row present, its `when`) for a bias switch: True always, False never,
    a string names the ArchParams flag that enables it."""
    if isinstance(flag, bool):
        return flag, None
    return True, flag


def llama_rows(qkv_bias: bool | str = "attention_bias", dense_bias: bool | str = "attention_bias",
               qk_norm: bool = False) -> tuple[Row, ...]:
    qkv_on, qkv_when = _switch(qkv_bias)
    dense_on, dense_when = _switch(dense_bias)
    qkv_bias_rows = (
        Row(f"{L}.self_attn.q_proj.bias", f"{T}.attention.qkv.bias", Shard.QKV, part="q", when=qkv_when,
            shape=("Q",)),
        # k/v biases are split and duplicated per head exactly like their weights when
        # tp > nkv (TensorRT-LLM issue #2200: the Qwen2 converter crash was biases left out).
        Row(f"{L}.self_attn.k_proj.bias", f"{T}.attention.qkv.bias", Shard.QKV, part="k", when=qkv_when,
            shape=("KV",)),
        Row(f"{L}.self_attn.v_proj.bias", f"{T}.attention.qkv.bias", Shard.QKV, part="v", when=qkv_when,
            shape=("KV",)),
    ) if qkv_on else ()
    # Row-parallel bias: added once after the all-reduce, so every rank holds all of it
    # (RowLinear in tensorrt_llm/layers/linear.py).
    dense_bias_rows = (
        Row(f"{L}.self_attn.o_proj.bias", f"{T}.attention.dense.bias", Shard.REPLICATE, when=dense_when,
            shape=("H",)),
    ) if dense_on else ()
    # TensorRT-LLM's Attention(qk_layernorm=True, layernorm_share=True) holds one
    # RmsNorm(head_size) per q and k, shared by every head, so every rank gets
    # the full (head_size,) vector (tensorrt_llm/layers/attention.py).
    qk_norm_rows = (
        Row(f"{L}.self_attn.q_norm.weight", f"{T}.attention.q_layernorm.weight", Shard.REPLICATE, shape=("HD",)),
        Row(f"{L}.self_attn.k_norm.weight", f"{T}.attention.k_layernorm.weight", Shard.REPLICATE, shape=("HD",)),
    ) if qk_norm else ()
    return (
        Row("model.embed_tokens.weight", "transformer.vocab_embedding.weight", Shard.EMBEDDING, stage=Stage.FIRST,
            shape=("V", "H")),
        Row(f"{L}.input_layernorm.weight", f"{T}.input_layernorm.weight", Shard.REPLICATE, shape=("H",)),
        Row(f"{L}.self_attn.q_proj.weight", f"{T}.attention.qkv.weight", Shard.QKV, part="q", shape=("Q", "H")),
        Row(f"{L}.self_attn.k_proj.weight", f"{T}.attention.qkv.weight", Shard.QKV, part="k", shape=("KV", "H")),
        Row(f"{L}.self_attn.v_proj.weight", f"{T}.attention.qkv.weight", Shard.QKV, part="v", shape=("KV", "H")),
        *qkv_bias_rows,
        *qk_norm_rows,
        Row(f"{L}.self_attn.o_proj.weight", f"{T}.attention.dense.weight", Shard.ROW, shape=("H", "Q")),
        *dense_bias_rows,
        Row(f"{L}.post_attention_layernorm.weight", f"{T}.post_layernorm.weight", Shard.REPLICATE, shape=("H",)),
        # Naming trap (GatedMLP, tensorrt_llm/layers/mlp.py): it computes proj(act(fc(x)) * gate(x)), so the
        # activated branch `fc` is HF gate_proj and `gate` is HF up_proj.
        Row(f"{L}.mlp.gate_proj.weight", f"{T}.mlp.fc.weight", Shard.COLUMN, shape=("I", "H")),
        Row(f"{L}.mlp.up_proj.weight", f"{T}.mlp.gate.weight", Shard.COLUMN, shape=("I", "H")),
        Row(f"{L}.mlp.down_proj.weight", f"{T}.mlp.proj.weight", Shard.ROW, shape=("H", "I")),
        Row(f"{L}.mlp.gate_proj.bias", f"{T}.mlp.fc.bias", Shard.COLUMN, when="mlp_bias", shape=("I",)),
        Row(f"{L}.mlp.up_proj.bias", f"{T}.mlp.gate.bias", Shard.COLUMN, when="mlp_bias", shape=("I",)),
        Row(f"{L}.mlp.down_proj.bias", f"{T}.mlp.proj.bias", Shard.REPLICATE, when="mlp_bias", shape=("H",)),
        Row("model.norm.weight", "transformer.ln_f.weight", Shard.REPLICATE, stage=Stage.LAST, shape=("H",)),
        # Always written, even when tied (the safest choice), padded like TensorRT-LLM's lm_head
        # (tensorrt_llm/_utils.py, pad_vocab_size).
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

def _no_window(cfg: dict, params, origin: str):
    # LlamaConfig has no sliding window; a config.json that sets one is another
    # family mislabelled, and silently dropping the window would change outputs.
    if cfg.get("sliding_window") is not None:
        raise ToolchainError(f"{origin}: LlamaForCausalLM with sliding_window={cfg['sliding_window']}",
                             "a windowed model should declare its own architecture, e.g. MistralForCausalLM")
    return params


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    rows=llama_rows(),
    defaults=LLAMA_DEFAULTS,
    normalize=_no_window,
)
