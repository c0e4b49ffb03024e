"""What attention costs per layer in the performance model, family by family: how many cached tokens a layer's
query sees at most (sliding windows, Llama 4's chunks), the FLOPs of one (query, cached token) pair under
multi-head latent attention, and a query span's reads and pairs under such a cap (`Span`).

Sinks (gpt-oss) add one logit per head to each softmax denominator, with no value: heads FLOPs per query token
against 4 x heads x head_size per cached token, so they are not counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from toolchain.archs.params import ArchParams

# ------------------------------------------------------------------------------------------- caps per layer


def layer_caps(p: ArchParams, layers: range) -> tuple[tuple[int | None, int], ...]:
    """A stage's layers grouped by the most cached tokens one query attends to: ((cap, layers), ...), None for
    full attention; () when every layer attends in full.

    - Per-layer windows (Gemma 2/3, gpt-oss: runtime_defaults.max_attention_window, one per layer, which their
      normalize writes and the memory plan's `window_share` reads): a sliding layer attends to its last `window`
      tokens and keeps only those (TensorRT-LLM's max_attention_window, a cyclic KV cache per window).
    - One window for every layer (`sliding_window`, as memory.sequence_tokens caps a sequence with it).
    - Llama 4's chunked layers (the rope layers, `no_rope_layers` 1, with attention_chunk_size C): a query at
      position t attends to the positions of its own chunk up to itself, (t mod C) + 1 keys, so at most C, and
      reads at most that many cached tokens. C is taken as the cap: exact below C tokens of context (every
      published mix but 32k), an upper bound above (the mean past the first chunk is about C / 2). NoPE layers
      attend in full."""
    if not len(layers):
        return ()
    windows = p.layer_windows
    extras = json.loads(p.extras_json or "{}")
    chunk, rope = extras.get("attention_chunk_size"), extras.get("no_rope_layers")
    caps: list[int | None]
    if windows is not None:
        caps = [windows[i] for i in layers]
    elif chunk and rope and len(rope) == p.num_hidden_layers:
        caps = [chunk if rope[i] else None for i in layers]
    elif p.sliding_window:
        caps = [p.sliding_window for _ in layers]
    else:
        return ()
    if all(c is None or c >= p.max_position_embeddings for c in caps):
        return ()
    counts: dict[int | None, int] = {}
    for cap in caps:
        key = None if cap is None or cap >= p.max_position_embeddings else cap
        counts[key] = counts.get(key, 0) + 1
    return tuple(counts.items())


# ------------------------------------------------------------------------------------------- MLA's FLOPs


def pair_flops(p: ArchParams, heads: int) -> tuple[float, float]:
    """(generation, context) FLOPs of one query token against one cached token on one layer over `heads` heads
    (a multiply and an add per product).

    Multi-head attention: QK^T over head_size and PV over head_size, 4 x heads x head_size in both phases.

    Multi-head latent attention (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1.2 and its note on absorbing
    W^UK into W^Q and W^UV into W^O; DeepSeek-V3, arXiv 2412.19437, section 2.1.1; reasoned from those formulas,
    TensorRT-LLM's MLA kernels not read here):
    - generation runs the absorbed form: each head's query is carried into the latent space (q_nope x W^UK, a
      per-query-token product that equals kv_b_proj's FLOPs, which stage_cost already counts per token), then
      scores against the cached latent and the shared rope key, 2 x heads x (kv_lora_rank + qk_rope_head_dim),
      and sums the latents, 2 x heads x kv_lora_rank; the output leaves the latent space through W^UV (again
      kv_b_proj's other half, per query token);
    - context runs the plain form over the up-projected keys and values: 2 x heads x (qk_nope + qk_rope) for the
      scores and 2 x heads x v_head_dim for the sum; a chunk after cached tokens also up-projects their latents
      (`expand_flops`)."""
    m = p.mla
    if m is None:
        flops = 4.0 * heads * p.head_size
        return flops, flops
    generation = 2.0 * heads * (m["kv_lora_rank"] + m["qk_rope_head_dim"]) + 2.0 * heads * m["kv_lora_rank"]
    context = 2.0 * heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) + 2.0 * heads * m["v_head_dim"]
    return generation, context


def expand_flops(p: ArchParams, heads: int) -> float:
    """FLOPs per cached token per layer that a prompt chunk spends up-projecting the cached latent into its
    keys and values before the plain-form attention (kv_b_proj over the latent, 2 x heads x (qk_nope +
    v_head_dim) x kv_lora_rank); 0 without MLA. The new tokens' own up-projection is kv_b_proj's per-token
    FLOPs, counted with the linears. That the context phase reloads and expands the cached latent this way
    (rather than running the absorbed form) is UNVERIFIED against TensorRT-LLM's MLA module."""
    m = p.mla
    if m is None:
        return 0.0
    return 2.0 * heads * (m["qk_nope_head_dim"] + m["v_head_dim"]) * m["kv_lora_rank"]


# ------------------------------------------------------------------------------------------- a query span


@dataclass(frozen=True)
class Span:
    """`sequences` sequences, each running `tokens` query tokens after `start` cached tokens. A prompt chunk is
    causal (its j-th token sees start + j keys); a generation step's tokens (1, or 1 + the draft when it
    verifies) are each taken at the sequence's context, `start`, as step.generation_work counts them."""

    sequences: float
    start: float
    tokens: float
    causal: bool

    def scaled(self, factor: float) -> Span:
        return Span(self.sequences * factor, self.start, self.tokens, self.causal)

    def kv_read(self, cap: float | None) -> float:
        """Cached tokens the span reads per layer whose queries see at most `cap` tokens (None: all)."""
        return self.sequences * (self.start if cap is None else min(self.start, cap))

    def pairs(self, cap: float | None) -> float:
        """(query, key) pairs per layer under `cap`: for a causal chunk sum over j = 1..tokens of
        min(start + j, cap), the first k = cap - start of them uncapped."""
        if not self.causal:
            return self.sequences * self.tokens * (self.start if cap is None else min(self.start, cap))
        s, t = self.start, self.tokens
        k = t if cap is None else max(0.0, min(t, cap - s))
        return self.sequences * (k * s + k * (k + 1) / 2 + (t - k) * (cap or 0))
