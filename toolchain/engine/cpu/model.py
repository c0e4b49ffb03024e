"""The forward pass over rank shards, as the ranks of a real deployment would run it.

Pipeline stages run in order; within a stage every TP rank's shard computes
its part one after another in this process: column-parallel pieces (q/k/v
heads, MLP columns, lm_head vocab rows) stay per rank, row-parallel outputs
(attention dense, MLP proj) are summed across ranks as the all-reduce would
sum them, and their bias is added once afterwards.

One forward call runs a batch of `Chunk`s: each is a run of new tokens for one
request (its whole prompt when prefilling, one token when decoding). Their
tokens are concatenated so every linear is a single matmul over the batch;
attention runs per request against that request's own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolchain.engine.cpu.config import ModelDims
from toolchain.engine.cpu.rope import Rotary, apply_rotary
from toolchain.engine.cpu.weights import RankShard
from toolchain.quant.kv_cache import dequantize_kv, quantize_kv, storage_dtype


# kv_cache_quant_algo -> what the cache stores (TensorRT-LLM tensorrt_llm/quantization/quantize_by_modelopt.py):
# x / scale as int8 or e4m3.
KV_KINDS = {"INT8": "int8", "FP8": "fp8"}


class KVCache:
    """One request's keys and values: per global layer and TP rank, [kv_heads_per_rank, capacity, head].

    With an INT8/FP8 KV cache the tensors hold the quantized values (int8 or
    float8_e4m3fn) and are read back with the layer's kv_cache_scaling_factor."""

    def __init__(self, d: ModelDims, capacity: int):
        shape = (d.kv_heads_per_rank, capacity, d.head_size)
        self.kind = KV_KINDS.get(d.kv_cache_quant_algo)
        dtype = storage_dtype(self.kind) if self.kind else torch.float32
        self.k = [[torch.empty(shape, dtype=dtype) for _ in range(d.tp)] for _ in range(d.num_layers)]
        self.v = [[torch.empty(shape, dtype=dtype) for _ in range(d.tp)] for _ in range(d.num_layers)]
        self.capacity = capacity
        self.length = 0  # tokens already written (positions 0 .. length-1)


@dataclass
class Chunk:
    cache: KVCache
    tokens: list[int]
    all_logits: bool = False  # False: logits of the last token only (what sampling needs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def window_mask(past: int, n: int, window: int) -> torch.Tensor:
    """[n, past + n] keys visible to the n new queries at positions past..past+n-1:
    causal, and at most `window` of them, the query's own included (what
    TRT-LLM's max_attention_window and HF's sliding_window both mean)."""
    q = torch.arange(past, past + n)[:, None]
    key = torch.arange(past + n)[None, :]
    return (key <= q) & (q - key < window)


class Model:
    def __init__(self, d: ModelDims, stages: list[list[RankShard]]):
        self.d = d
        self.stages = stages
        self.rotary = Rotary(d.head_size, d.rotary_base, d.rotary_scaling)
        self.scale = d.head_size ** -0.5
        # Global index of each stage's first layer: caches are indexed globally.
        self.layer_offset = [d.stage_layers(p).start for p in range(d.pp)]
        # KV-cache scales by (global layer, tp rank); empty for an fp cache.
        self.kv_scales = {(self.layer_offset[p] + i, s.tp_rank): layer.kv_scale
                          for p, shards in enumerate(stages) for s in shards
                          for i, layer in enumerate(s.layers) if layer.kv_scale is not None}

    # -- the stages ---------------------------------------------------------

    def forward(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Run the chunks; returns per chunk logits [V] (last token) or [n, V] (all_logits)."""
        for c in chunks:
            if c.cache.length + len(c.tokens) > c.cache.capacity:
                raise RuntimeError(f"KV cache overflow: {c.cache.length}+{len(c.tokens)} > {c.cache.capacity}")
        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
        positions = torch.cat([torch.arange(c.cache.length, c.cache.length + len(c.tokens)) for c in chunks])
        spans, start = [], 0
        for c in chunks:
            spans.append((start, start + len(c.tokens)))
            start += len(c.tokens)
        cos, sin = self.rotary.tables(positions)

        x = self._embed(self.stages[0], ids)
        for pp_rank, shards in enumerate(self.stages):
            for local in range(len(shards[0].layers)):
                layer = self.layer_offset[pp_rank] + local
                x = self._attention_block(shards, local, layer, x, chunks, spans, cos, sin)
                x = self._mlp_block(shards, local, x)

        rows = []
        for c, (s, e) in zip(chunks, spans):
            rows.extend(range(s, e) if c.all_logits else [e - 1])
        logits = self._lm_head(self.stages[-1], x[rows])
        for c in chunks:  # only now: a failed forward leaves every cache as it was
            c.cache.length += len(c.tokens)
        out, at = [], 0
        for c, (s, e) in zip(chunks, spans):
            n = e - s if c.all_logits else 1
            out.append(logits[at:at + n] if c.all_logits else logits[at])
            at += n
        return out

    def _embed(self, shards: list[RankShard], ids: torch.Tensor) -> torch.Tensor:
        d = self.d
        if not d.use_parallel_embedding:
            return shards[0].embedding[ids]  # full copy on each rank (replicas checked at load)
        if d.embedding_sharding_dim == 1:
            # Hidden dim split: each rank looks up its columns; the all-gather concatenates them.
            return torch.cat([s.embedding[ids] for s in shards], dim=-1)
        # Vocab dim split: each rank answers for its rows, zeros elsewhere; the all-reduce sums.
        rows = d.padded_vocab // d.tp
        out = None
        for s in shards:
            local = ids - s.tp_rank * rows
            mine = (local >= 0) & (local < rows)
            part = s.embedding[local.clamp(0, rows - 1)] * mine.unsqueeze(-1)
            out = part if out is None else out + part
        return out

    def _lm_head(self, shards: list[RankShard], x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, shards[0].final_norm, self.d.norm_epsilon)
        # Column-parallel over the padded vocab: concatenate the slices, drop the padding.
        return torch.cat([s.lm_head(h) for s in shards], dim=-1)[:, : self.d.vocab_size]

    # -- one decoder layer ------------------------------------------------------

    def _attention_block(self, shards, local, layer, x, chunks, spans, cos, sin) -> torch.Tensor:
        d = self.d
        h = rms_norm(x, shards[0].layers[local].input_norm, d.norm_epsilon)
        nq, nkv, hd = d.heads_per_rank, d.kv_heads_per_rank, d.head_size
        total = None
        for s in shards:
            w = s.layers[local]
            qkv = w.qkv(h)
            q = qkv[:, : nq * hd].view(-1, nq, hd)
            k = qkv[:, nq * hd: (nq + nkv) * hd].view(-1, nkv, hd)
            v = qkv[:, (nq + nkv) * hd:].view(-1, nkv, hd)
            if w.q_norm is not None:  # qk_layernorm (Qwen3): per-head RMSNorm before RoPE
                q, k = rms_norm(q, w.q_norm, d.norm_epsilon), rms_norm(k, w.k_norm, d.norm_epsilon)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            attn = self._attend(q, k, v, chunks, spans, layer, s.tp_rank)
            part = w.dense(attn, add_bias=False)
            total = part if total is None else total + part
        bias = shards[0].layers[local].dense.bias
        return x + (total + bias if bias is not None else total)

    def _attend(self, q, k, v, chunks, spans, layer, tp_rank) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
        window = self.d.attention_window(layer)
        for c, (s, e) in zip(chunks, spans):
            n, past = e - s, c.cache.length
            kc, vc = c.cache.k[layer][tp_rank], c.cache.v[layer][tp_rank]
            kind = c.cache.kind
            if kind is None:
                kc[:, past:past + n] = k[s:e].transpose(0, 1)
                vc[:, past:past + n] = v[s:e].transpose(0, 1)
            else:
                scale = self.kv_scales[(layer, tp_rank)]
                kc[:, past:past + n] = quantize_kv(k[s:e].transpose(0, 1), scale, kind)
                vc[:, past:past + n] = quantize_kv(v[s:e].transpose(0, 1), scale, kind)
                kc, vc = dequantize_kv(kc[:, : past + n], scale), dequantize_kv(vc[:, : past + n], scale)
            mask, causal = None, False
            if window is not None and past + n > window:
                mask = window_mask(past, n, window)
            elif n > 1 and past == 0:
                causal = True
            elif n > 1:  # new tokens after a cached prefix: token i sees positions <= past + i
                mask = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1).unsqueeze(0), kc[:, : past + n].unsqueeze(0), vc[:, : past + n].unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1).reshape(n, -1)
        return out

    def _mlp_block(self, shards, local, x) -> torch.Tensor:
        h = rms_norm(x, shards[0].layers[local].post_norm, self.d.norm_epsilon)
        total = None
        for s in shards:
            w = s.layers[local]
            part = w.proj(F.silu(w.fc(h)) * w.gate(h), add_bias=False)
            total = part if total is None else total + part
        bias = shards[0].layers[local].proj.bias
        return x + (total + bias if bias is not None else total)
