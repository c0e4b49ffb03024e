"""Calibration statistics of Llama 4's text decoder layers, one layer at a time as calibration.py runs Llama's.

transformers' Llama4TextDecoderLayer (models/llama4/modeling_llama4.py) differs from the Llama layer calibration.py
drives: its MLP is `feed_forward` (a dense SiLU-gated MLP, or Llama4TextMoe: router, stacked experts, shared expert),
rope layers attend within chunks and NoPE layers in full, each layer taking the mask of its `layer_types` entry
(Llama4TextModel.forward builds one with create_causal_mask, one with create_chunked_causal_mask), and the rope is
the complex `freqs_cis` of Llama4TextRotaryEmbedding. The layer itself applies the qk-norm and the NoPE layers'
temperature tuning (from the sequence length), so running it with the model's own masks reproduces the model.

Slots (LayerStats.inputs): "qkv" (q/k/v's input), "dense" (o_proj's), and per MLP kind: a dense layer's "mlp"
(gate/up's input) and "proj" (down's); a mixture-of-experts layer's "mlp" (the block's input, which feeds the
experts, scaled by the router score, and the shared expert) and "shared_proj" (the shared expert's down input),
with `expert_proj_amax` per expert: the largest |input of its down projection| over every calibration token, each
token taken through the expert at its own router score (Llama4TextMoe scales the expert's *input* by
sigmoid(logit)), as if routed there, so an expert the text rarely picks still gets a scale. The block's input amax
bounds every expert's scaled input (sigmoid < 1).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from toolchain.quant.calibration_stats import InputStats, LayerStats, Weights, finish_layer

MODEL_TYPE = "llama4_text"
KV_OUTPUTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # the KV amax: q, k and v outputs


def _stats(width: int, covariance: bool) -> InputStats:
    return InputStats(torch.zeros(width), torch.zeros(width),
                      torch.zeros(width, width, dtype=torch.float64) if covariance else None)


def _routed_amax(moe, x: torch.Tensor, st: LayerStats) -> None:
    """Every expert's down-projection input on every token, the token scaled by its sigmoid score for that expert
    (Llama4TextMoe.forward: `routed_in = hidden_states * router_scores`; Llama4TextExperts: gate_up_proj [E, H, 2I],
    the gate half first)."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    scores = torch.sigmoid(x @ moe.router.weight.float().T)  # [tokens, E]
    experts = moe.experts
    amax = []
    for e in range(experts.gate_up_proj.shape[0]):
        gate, up = ((x * scores[:, e:e + 1]) @ experts.gate_up_proj[e]).chunk(2, dim=-1)
        amax.append(float((experts.act_fn(gate) * up).abs().max()))
    st.expert_proj_amax = [max(a, b) for a, b in zip(st.expert_proj_amax, amax, strict=True)] \
        if st.expert_proj_amax else amax


def layer_stats(hf_dir, config, sequences: list[torch.Tensor], covariance: bool,
                progress: Callable[[str], None] | None) -> Iterator[LayerStats]:
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask

    # Llama4ForConditionalGeneration: its text model's config, its tensors under language_model.
    config, prefix = (config.get_text_config(), "language_model.") if config.model_type != MODEL_TYPE else (config, "")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    weights = Weights(hf_dir)
    base = model.model
    rotary = type(base.rotary_emb)(config=config)  # built on CPU: meta buffers hold no frequencies
    embed = weights.get(f"{prefix}model.embed_tokens.weight").float()
    hidden = [embed[s][None] for s in sequences]
    del embed
    makers = {"full_attention": create_causal_mask, "chunked_attention": create_chunked_causal_mask}
    per_seq = []
    for h in hidden:
        pos = torch.arange(h.shape[1])[None]
        masks = {kind: makers[kind](config=config, inputs_embeds=h, attention_mask=None, cache=None,
                                    position_ids=pos) for kind in set(config.layer_types)}
        per_seq.append((pos, masks, rotary(h, pos)))
    for i, layer in enumerate(base.layers):
        layer.to_empty(device="cpu")
        layer.load_state_dict(weights.prefixed(f"{prefix}model.layers.{i}."), strict=True)
        ff = layer.feed_forward
        moe = hasattr(ff, "experts")
        stats = LayerStats()
        watched = {"qkv": layer.self_attn.q_proj, "dense": layer.self_attn.o_proj}
        if moe:
            watched["shared_proj"] = ff.shared_expert.down_proj
        else:
            watched.update(mlp=ff.gate_proj, proj=ff.down_proj)
        hooks = []
        for slot, module in watched.items():
            stats.inputs[slot] = _stats(module.in_features, covariance)
            hooks.append(module.register_forward_pre_hook(lambda _m, args, s=stats.inputs[slot]: s.add(args[0])))
        if moe:
            stats.inputs["mlp"] = _stats(config.hidden_size, covariance)

            def experts_hook(m, args, st=stats) -> None:  # returns None: the block's input stays as it is
                st.inputs["mlp"].add(args[0])
                _routed_amax(m, args[0], st)
            hooks.append(ff.register_forward_pre_hook(experts_hook))

        def kv_hook(_m, _args, out, st=stats):
            st.qkv_amax = max(st.qkv_amax, float(out.detach().abs().max()))
        hooks += [layer.get_submodule(n).register_forward_hook(kv_hook) for n in KV_OUTPUTS]
        kind = config.layer_types[i]
        with torch.no_grad():
            hidden = [layer(h, attention_mask=masks[kind], position_ids=pos, position_embeddings=freqs)
                      for h, (pos, masks, freqs) in zip(hidden, per_seq, strict=True)]
        finish_layer(layer, hooks, i + 1, len(base.layers), progress)
        yield stats
