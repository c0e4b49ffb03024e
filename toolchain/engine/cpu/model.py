"""The forward pass over rank shards, as the ranks of a real deployment would run it.

Pipeline stages run in order; within a stage every TP rank's shard computes
its part one after another in this process: column-parallel pieces (q/k/v
heads, MLP columns, lm_head vocab rows) stay per rank, row-parallel outputs
(attention dense, MLP proj) are summed across ranks as the all-reduce would
sum them, and their bias is added once afterwards. With `comm` (ranks.py) this
process holds one rank's shard only, and the sums, gathers and the hand-over
between stages go to the other rank processes instead.

One forward call runs a batch of `Chunk`s: each is a run of new tokens for one
request (a prompt or a piece of it when in context, one token when decoding).
Their tokens are concatenated so every linear is a single matmul over the
batch. Attention is batched too: new keys and values are written into the
paged pool (kv_cache.py) at each token's slot, then one scaled-dot-product call
covers the decoding requests and one the context chunks, each reading its
requests' keys through their block tables, padded and masked to the longest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolchain.engine.cpu.config import ModelDims
from toolchain.engine.cpu.kv_cache import BlockTable, KvCacheManager
from toolchain.engine.cpu.linear import as_columns, gemm_columns, on_columns
from toolchain.engine.cpu.comm import Comm
from toolchain.engine.cpu.mla import MlaAttention, rotary as mla_rotary
from toolchain.engine.cpu import native
from toolchain.engine.cpu.sinks import attend_with_sinks
from toolchain.engine.cpu.step_tables import additive_mask, slot_matrix
from toolchain.engine.cpu.llama4 import chunk_mask
from toolchain.engine.cpu.lora import LoraBatch, LoraCache
from toolchain.engine.cpu.rope import Rotary, apply_rotary, apply_rotary_interleaved
from toolchain.engine.cpu.weights import RankShard
from toolchain.quant.kv_cache import dequantize_kv, quantize_kv


@dataclass
class Chunk:
    table: BlockTable
    tokens: list[int]  # new tokens, written at positions table.length, table.length + 1, ...
    logits: int = 1
    """Trailing positions whose logits are wanted: 1 to sample the next token, 1 + draft length to
    verify draft tokens, len(tokens) for every position (forward_logits), 0 for a context chunk
    short of the prompt's end."""
    parents: list[int] | None = None
    """A draft tree (Medusa): the chunk index of each token's parent, -1 for the first. Each token
    sits at the position of its depth and attends to the cache and its own ancestors only."""
    want_hidden: bool = False
    hidden: torch.Tensor | None = None
    """With want_hidden, forward sets the final-normed hidden states of the logits rows (Medusa heads' input)."""
    want_states: bool = False
    states: torch.Tensor | None = None
    """With want_states, forward sets every row's final-normed hidden state, what the model hands an MTP layer
    (mtp.py); for `mtp_forward`, the caller sets the main model's at the chunk's positions."""
    lora: int | None = None
    """The LoRA task id whose adapter applies to this chunk's rows (engine/cpu/lora.py); None: the base model."""
    want_argmax: bool = False
    argmax: int | None = None
    """With want_argmax, forward sets the argmax of the chunk's last logits row, from one argmax over the step's rows
    (greedy sampling batched on a tensor instead of one call per request)."""


def tree_tables(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth of each node and the ancestor-or-self matrix [n, n] of a tree given by parent
    indices (each parent before its child)."""
    n = len(parents)
    depth = torch.zeros(n, dtype=torch.int64)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if not 0 <= p < i:
                raise ValueError(f"tree node {i} has parent {p}; parents must come first")
            depth[i] = depth[p] + 1
            anc[i] |= anc[p]
    return depth, anc


class _Group:
    """Requests attended to in one call: their padded query rows, key slots and masks."""

    def __init__(self, rows: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]],
                 slots: torch.Tensor | None = None):
        # rows: (index of the first new token in the batch, new tokens n, cached length before, key slots [past+n],
        # ancestor matrix of a draft tree or None). `slots` [B, keys] (step_tables.slot_matrix) instead of each
        # row's own: the rows' slot entries are then unused.
        self.batch = len(rows)
        self.q_len = max(r[1] for r in rows)
        keys = max(r[2] + r[1] for r in rows)
        self._trees = [(b, n, past, anc) for b, (_, n, past, _, anc) in enumerate(rows) if anc is not None]
        if slots is None:
            slots = torch.zeros(self.batch, keys, dtype=torch.int64)  # padding reads slot 0, masked out
            for b, (_, n, past, own, _) in enumerate(rows):
                if own is not None:
                    slots[b, : past + n] = own
        self.slots = slots
        firsts = [r[0] for r in rows]
        # Decoding requests one token each, consecutive in the batch (the step puts them first): their queries
        # and outputs are a slice of the batch's rows, no gather or scatter.
        self.span = ((firsts[0], firsts[0] + self.batch) if self.q_len == 1 and not self._trees
                     and firsts == list(range(firsts[0], firsts[0] + self.batch)) else None)
        # Each decoding row's keys, its new one included (native.paged_decode_attention reads them in place).
        self.lengths = torch.tensor([r[2] + r[1] for r in rows], dtype=torch.int64) if self.span else None
        if self.q_len == 1:
            q_index = torch.tensor(firsts, dtype=torch.int64)[:, None]
            valid = torch.ones(self.batch, 1, dtype=torch.bool)
            q_pos = torch.tensor([r[2] for r in rows], dtype=torch.int64)[:, None]
        else:
            q_index = torch.zeros(self.batch, self.q_len, dtype=torch.int64)
            valid = torch.zeros(self.batch, self.q_len, dtype=torch.bool)
            q_pos = torch.full((self.batch, self.q_len), -1, dtype=torch.int64)
            for b, (first, n, past, _, _) in enumerate(rows):
                q_index[b, :n] = torch.arange(first, first + n)
                valid[b, :n] = True
                q_pos[b, :n] = torch.arange(past, past + n)
        # The pool slot each new token is written at, in the order of `tokens`.
        self.write = (slots.gather(1, q_pos).reshape(-1) if self.q_len == 1
                      else torch.cat([slots[b, past:past + n] for b, (_, n, past, _, _) in enumerate(rows)]))
        self.flat_slots = self.slots.reshape(-1)
        self.q_index = q_index.reshape(-1)
        self.valid = valid.reshape(-1)
        self.tokens = self.q_index if self.q_len == 1 else self.q_index[self.valid]
        self._q_pos = q_pos[:, :, None]
        self._key = torch.arange(keys)[None, None, :]
        self._pad = ~valid
        self._masks: dict[tuple[int | None, int | None], torch.Tensor] = {}
        self._additive: dict[tuple[int | None, int | None], torch.Tensor] = {}
        # One fresh context (nothing cached, no padding): plain causal attention, which SDPA runs
        # with its fused kernel instead of materialising a mask (2x faster at 2k tokens).
        self.fresh = self.batch == 1 and rows[0][2] == 0

    def plain_causal(self, window: int | None, chunk: int | None = None) -> bool:
        return self.fresh and (window is None or window >= self.q_len) and (chunk is None or chunk >= self.q_len)

    def mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """[B, 1, q_len, keys]: each query sees its request's keys up to its own position and
        at most `window` of them, its own included (what TRT-LLM's max_attention_window and
        HF's sliding_window both mean), and with `chunk` only those of its own chunk (Llama 4, llama4.py)."""
        if (window, chunk) not in self._masks:
            m = self._key <= self._q_pos  # only the request's own keys: slots past its length sit beyond q_pos
            if window is not None:
                m = m & (self._q_pos - self._key < window)
            if chunk is not None:
                m = m & chunk_mask(self._q_pos, self._key, chunk)
            for b, n, past, anc in self._trees:  # a tree node sees the cache and its ancestors
                m[b, :n, past:past + n] = anc
            m[:, :, 0] |= self._pad  # a padded query row sees one key, so softmax stays finite
            self._masks[(window, chunk)] = m.unsqueeze(1)
        return self._masks[(window, chunk)]

    def additive_mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """`mask` as SDPA's float mask, made once per step (step_tables.additive_mask)."""
        if (window, chunk) not in self._additive:
            self._additive[(window, chunk)] = additive_mask(self.mask(window, chunk))
        return self._additive[(window, chunk)]


@dataclass
class _Batch:
    write: torch.Tensor  # pool slot of every new token
    groups: list[_Group]  # decoding requests, then context chunks
    kv: KvCacheManager
    positions: torch.Tensor | None = None  # each new token's position (Llama 4's temperature tuning reads it)
    lora: LoraBatch | None = None  # the chunks' LoRA adapters and their rows; None when no chunk names one


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as raw bytes: torch's CPU index_copy_/index_select have no float8 kernels."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)): transformers' LlamaRMSNorm's operations in its order. In float32,
    torch's own rms_norm computes exactly these (bit for bit, tests/test_engine_cpu_step_tables.py) in one call and
    fewer temporaries, which matters more than the arithmetic right after a matmul has swept the caches."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    kernels = native.ops()  # one pass instead of eight calls (csrc/layer_ops.cpp); equal to float32 rounding
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Model:
    def __init__(self, d: ModelDims, stages: list[list[RankShard]], comm: Comm | None = None):
        """`stages[p]`: the shards of pipeline stage p this process holds, TP ranks in order; empty for
        a stage other rank processes hold (with `comm`)."""
        self.d = d
        self.stages = stages
        self.comm = comm
        self.lora: LoraCache | None = None  # set by the engine when it serves LoRA adapters
        self.rotary = Rotary(d.head_size, d.rotary_base, d.rotary_scaling)
        # Multi-head latent attention (DeepSeek-V3) rotates only its rope head, with YaRN where configured.
        self.mla = MlaAttention(d.mla, d.norm_epsilon) if d.mla is not None else None
        if d.mla is not None:
            self.rotary = mla_rotary(d.mla, d.rotary_base)
        # Gemma 3's local layers rotate with their own base and the same scaling (a second table,
        # Attention.create_attention_const_params in tensorrt_llm/layers/attention.py).
        self.rotary_local = (Rotary(d.head_size, d.rotary_base_local, d.rotary_scaling)
                             if d.rotary_base_local is not None else None)
        # Gemma 2 scales by query_pre_attn_scalar (q_scaling in tensorrt_llm/models/gemma/model.py).
        self.scale = (d.query_pre_attn_scalar or d.head_size) ** -0.5
        # Global index of each stage's first layer: caches are indexed globally.
        self.layer_offset = [d.stage_layers(p).start for p in range(d.pp)]
        # KV-cache scales by (global layer, tp rank); empty for an fp cache.
        self.kv_scales = {(self.layer_offset[p] + i, s.tp_rank): layer.kv_scale
                          for p, shards in enumerate(stages) for s in shards
                          for i, layer in enumerate(s.layers) if layer.kv_scale is not None}
        # Decode attention straight from the pool (csrc/paged_attention.cpp) where this host builds it; None: torch's.
        self.kernels = native.ops()

    def use_unit_kv_scales(self) -> None:
        """Quantize the KV cache with scale 1.0 instead of the checkpoint's calibrated ones: what
        TensorRT-LLM's PyTorch backend does with an FP8 KV cache (see toolchain/llmapi/cpu_llm.py)."""
        self.kv_scales = {key: torch.ones_like(scale) for key, scale in self.kv_scales.items()}

    # -- the stages ---------------------------------------------------------

    def forward(self, chunks: list[Chunk], kv: KvCacheManager) -> list[torch.Tensor | None]:
        """Run the chunks; per chunk the logits of its last `logits` positions [logits, V], or None
        for 0. Writes their K/V into `kv` but leaves every table's length as it
        was: the caller commits after sampling, so a failed step can be retried."""
        rows, ids, batch, (cos, sin), local_tables = self._prepare(chunks, kv)

        x: torch.Tensor | None = None
        for pp_rank, shards in enumerate(self.stages):
            if not shards:
                continue
            if pp_rank == 0:
                x = self._embed(shards, ids)
                if self.d.inter_layernorms:  # Gemma: embedding x sqrt(hidden_size) (GemmaModel.forward)
                    x = x * math.sqrt(self.d.hidden_size)
            elif x is None:  # this rank process starts at a later stage
                x = self._comm.recv_hidden(len(ids), self.d.hidden_size)
            for local in range(len(self.d.stage_layers(pp_rank))):  # an MTP layer after them runs in mtp_forward
                layer = self.layer_offset[pp_rank] + local
                tables = local_tables if self.d.is_local(layer) else (cos, sin)
                x = self._attention_block(shards, local, layer, x, batch, *tables)
                x = self._mlp_block(shards, local, x, layer, batch.lora)
            if pp_rank + 1 < len(self.stages) and not self.stages[pp_rank + 1]:
                self._comm.send_hidden(x)
        final_norm = self.stages[-1][0].part("final_norm") if self.stages[-1] else None
        for c, (s, e) in zip(chunks, rows, strict=True):
            if c.want_states and x is not None and final_norm is not None:
                c.states = rms_norm(x[s:e], final_norm, self.d.norm_epsilon)
        return self._logits(chunks, rows, x, final_norm)

    def mtp_forward(self, chunks: list[Chunk], kv: KvCacheManager) -> list[torch.Tensor | None]:
        """The first multi-token-prediction layer (mtp.py) over chunks whose `tokens` are the tokens after their
        positions and whose `states` hold the main model's final-normed hidden states there: writes its cache entries and
        returns, per chunk, the logits of its last `logits` rows (each predicting the token two ahead)."""
        rows, ids, batch, (cos, sin), _local = self._prepare(chunks, kv)
        shards, eps = self.stages[-1], self.d.norm_epsilon
        layer = self.d.num_layers  # local and global at pp 1; its cache layer follows the main ones
        w = shards[0].layers[layer].mtp
        if w is None or any(c.states is None for c in chunks):
            raise RuntimeError("mtp_forward needs an MTP layer and each chunk's hidden states")
        embedded = rms_norm(self._embed(shards, ids), w.enorm, eps)
        hidden = rms_norm(torch.cat([c.states for c in chunks if c.states is not None]), w.hnorm, eps)
        x = w.eh_proj(torch.cat([embedded, hidden], dim=-1))
        x = self._attention_block(shards, layer, layer, x, batch, cos, sin)
        x = self._mlp_block(shards, layer, x)
        return self._logits(chunks, rows, x, w.head_norm)

    def _prepare(self, chunks: list[Chunk], kv: KvCacheManager):
        """Each chunk's rows in the batch, the token ids, the attention batch and the rope tables (global, local).
        Built from Python lists into a few tensors for the whole batch (step_tables.py says why)."""
        rows: list[tuple[int, int]] = []
        groups: tuple[list[tuple], list[tuple]] = ([], [])  # decoding requests, context chunks
        tables: tuple[list[list[int]], list[list[int]]] = ([], [])
        positions: list[int] = []
        lengths: list[int] = []  # each token's request length after this step (longrope picks by it)
        ids: list[int] = []
        first = 0
        for c in chunks:
            past, n = c.table.length, len(c.tokens)
            if n == 0 or len(c.table.blocks) * kv.tokens_per_block < past + n:
                raise RuntimeError(f"chunk of {n} tokens at {past} has no KV blocks reserved for it")
            anc = None
            if c.parents is not None:
                depth, anc = tree_tables(c.parents)
                positions += (past + depth).tolist()
            else:
                positions += range(past, past + n)
            lengths += [past + n] * n
            ids += c.tokens
            groups[n != 1].append((first, n, past, None, anc))
            tables[n != 1].append(c.table.blocks)
            rows.append((first, first + n))
            first += n
        made = [_Group(g, slot_matrix(t, [r[2] + r[1] for r in g], kv.tokens_per_block))
                for g, t in zip(groups, tables, strict=True) if g]
        write = made[0].write
        if len(made) > 1 or made[0].span != (0, first):  # each group's tokens at their rows of the batch
            write = torch.empty(first, dtype=torch.int64)
            for g in made:
                write[g.tokens] = g.write
        pos = torch.tensor(positions, dtype=torch.int64)
        batch = _Batch(write, made, kv, pos)
        if self.lora is not None:
            batch.lora = self.lora.batch([c.lora for c in chunks], rows)
        length = torch.tensor(lengths, dtype=torch.int64)
        cos, sin = self.rotary.tables(pos, length)
        local_tables = self.rotary_local.tables(pos, length) if self.rotary_local is not None else (cos, sin)
        return rows, torch.tensor(ids, dtype=torch.int64), batch, (cos, sin), local_tables

    def _logits(self, chunks: list[Chunk], rows: list[tuple[int, int]], x: torch.Tensor | None,
                final_norm: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Per chunk the logits of its last `logits` rows of `x` through `final_norm` and the lm_head."""
        wanted: list[int] = []
        for c, (s, e) in zip(chunks, rows, strict=False):
            wanted.extend(range(e - min(c.logits, e - s), e))
        last = self.stages[-1]
        h = logits = None
        if wanted and last and x is not None and final_norm is not None:
            # Every row wanted (a decode step): the rows themselves, not a gathered copy.
            h = rms_norm(x if len(wanted) == x.shape[0] else x[wanted], final_norm, self.d.norm_epsilon)
            logits = self._lm_head(last, h)
            if self.d.final_softcap:  # Gemma 2 (DecoderModelForCausalLM.forward): tanh(l / c) * c
                logits = torch.tanh(logits / self.d.final_softcap) * self.d.final_softcap
        if self.comm is not None:
            logits = self.comm.logits_to_leader(logits, len(wanted), self.d.vocab_size)
        if logits is None:  # no logits wanted, or a rank process that ends before the last stage
            return [None] * len(chunks)
        out: list[torch.Tensor | None] = []
        at = 0
        top = logits.argmax(-1).tolist() if any(c.want_argmax for c in chunks) else None
        for c, (s, e) in zip(chunks, rows, strict=False):
            n = min(c.logits, e - s)
            out.append(logits[at:at + n] if n else None)
            if c.want_hidden:
                c.hidden = h[at:at + n] if n and h is not None else None
            if c.want_argmax and top is not None and n:
                c.argmax = top[at + n - 1]
            at += n
        return out

    @property
    def _comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError("a pipeline stage is missing from this process and no rank group holds it")
        return self.comm

    def _tp_sum(self, total: torch.Tensor) -> torch.Tensor:
        return total if self.comm is None else self.comm.tp_sum(total.contiguous())

    def _tp_cat(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.comm is None else self.comm.tp_cat(part)

    def medusa_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Each Medusa head's logits [heads, rows, V] from final-normed hidden states [rows, H]:
        residual SiLU layers, then the head's own lm_head, every linear column-parallel with its
        output gathered (tensorrt_llm/models/medusa/model.py, MedusaLayer and MedusaHead)."""
        shards = self.stages[-1]
        out = []
        for i in range(self.d.medusa_heads):
            x = h
            for layer in range(self.d.medusa_layers):
                x = x + F.silu(torch.cat([s.part("medusa")[i][0][layer](x) for s in shards], dim=-1))
            out.append(torch.cat([s.part("medusa")[i][1](x) for s in shards], dim=-1)[:, : self.d.vocab_size])
        return torch.stack(out)

    def _embed(self, shards: list[RankShard], ids: torch.Tensor) -> torch.Tensor:
        d = self.d
        if not d.use_parallel_embedding:
            return shards[0].part("embedding")[ids]  # full copy on each rank (replicas checked at load)
        if d.embedding_sharding_dim == 1:
            # Hidden dim split: each rank looks up its columns; the all-gather concatenates them.
            return self._tp_cat(torch.cat([s.part("embedding")[ids] for s in shards], dim=-1))
        # Vocab dim split: each rank answers for its rows, zeros elsewhere; the all-reduce sums.
        rows = d.padded_vocab // d.tp
        out = torch.zeros(0)
        for i, s in enumerate(shards):
            local = ids - s.tp_rank * rows
            mine = (local >= 0) & (local < rows)
            part = s.part("embedding")[local.clamp(0, rows - 1)] * mine.unsqueeze(-1)
            out = part if i == 0 else out + part
        return self._tp_sum(out)

    def _lm_head(self, shards: list[RankShard], h: torch.Tensor) -> torch.Tensor:
        # Column-parallel over the padded vocab: concatenate the slices, drop the padding.
        head = shards[0].part("lm_head")
        if len(shards) == 1 and self.comm is None and on_columns(h.shape[0], head):
            # float32, few rows: logits as a transposed view of the columns' product, no [rows, vocab] copy;
            # argmax and sampling read them as they lie (linear.columns).
            return head.columns(as_columns(h)).t()[: h.shape[0], : self.d.vocab_size]
        if len(shards) == 1:  # one slice: no copy of [rows, vocab] through cat
            return self._tp_cat(head(h))[:, : self.d.vocab_size]
        return self._tp_cat(torch.cat([s.part("lm_head")(h) for s in shards], dim=-1))[:, : self.d.vocab_size]

    # -- one decoder layer ------------------------------------------------------

    def _attention_block(self, shards, local, layer, x, batch, cos, sin) -> torch.Tensor:
        d = self.d
        h = rms_norm(x, shards[0].layers[local].input_norm, d.norm_epsilon)
        if self.mla is not None:  # DeepSeek-V3 (mla.py): each rank's heads through its o_proj columns, summed
            parts = [s.layers[local].dense(self.mla(s.layers[local].mla, h, cos, sin, batch.kv.k[layer, s.tp_rank],
                                                    batch), add_bias=False) for s in shards]
            return x + self._tp_sum(sum(parts[1:], parts[0]))
        nq, nkv, hd = d.heads_per_rank, d.kv_heads_per_rank, d.head_size
        total = None
        for s in shards:
            w = s.layers[local]
            assert w.qkv is not None  # every attention but MLA's has one
            qkv = w.qkv(h)
            if batch.lora is not None:
                batch.lora.add_qkv(qkv, h, layer, s.tp_rank, nq * hd, nkv * hd)
            q = qkv[:, : nq * hd].view(-1, nq, hd)
            k = qkv[:, nq * hd: (nq + nkv) * hd].view(-1, nkv, hd)
            v = qkv[:, (nq + nkv) * hd:].view(-1, nkv, hd)
            if w.q_norm is not None:  # qk_layernorm (Qwen3, Gemma 3): per-head RMSNorm before RoPE
                q, k = rms_norm(q, w.q_norm, d.norm_epsilon), rms_norm(k, w.k_norm, d.norm_epsilon)
            if d.llama4 is not None:  # rope or NoPE by layer, q/k norm after the rotation, temperature tuning
                q, k = d.llama4.position_qk(layer, q, k, cos, sin, batch.positions, d.norm_epsilon)
            elif d.rope_interleaved:
                q, k = apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)
            elif w.q_norm is None:  # q and k heads side by side in qkv: one rotation for both, element by element
                qk = apply_rotary(qkv[:, : (nq + nkv) * hd].view(-1, nq + nkv, hd), cos, sin)
                q, k = qk[:, :nq], qk[:, nq:]
            else:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            attn = self._attend(q, k, v, batch, layer, s.tp_rank, w.sinks)
            if batch.lora is not None:  # row-parallel: this rank's input columns, into its partial sum
                part = w.dense(attn, add_bias=False)
                batch.lora.add(part, attn, layer, s.tp_rank, "attn_dense")
            elif on_columns(attn.shape[0], w.dense):  # float32, few rows: on columns, read back as a transposed view
                part = w.dense.columns(as_columns(attn), add_bias=False).t()[: attn.shape[0]]
            else:
                part = w.dense(attn, add_bias=False)
            total = part if total is None else total + part
        assert total is not None
        total = self._tp_sum(total)
        bias = shards[0].layers[local].dense.bias
        out = total + bias if bias is not None else total
        if d.inter_layernorms:  # Gemma 2: post_layernorm normalises the attention output before the residual
            out = rms_norm(out, shards[0].layers[local].post_norm, d.norm_epsilon)
        return _residual(x, out)

    def _attend(self, q, k, v, batch: "_Batch", layer, tp_rank, sinks=None) -> torch.Tensor:
        kv = batch.kv
        k_pool, v_pool = kv.k[layer, tp_rank], kv.v[layer, tp_rank]
        scale = self.kv_scales[(layer, tp_rank)] if kv.kind else None
        rows, width = q.shape[0], q.shape[1] * q.shape[2]
        whole = len(batch.groups) == 1 and batch.groups[0].span == (0, rows)  # one decode group: its output is `out`
        window = self.d.attention_window(layer)
        chunk = self.d.llama4.chunk_of(layer) if self.d.llama4 is not None else None
        # Decode rows of a float32 pool without sinks, soft-capping or chunks: read in place (csrc/paged_attention.cpp)
        kernels = (self.kernels if scale is None and sinks is None and chunk is None and not self.d.attn_softcap
                   and k_pool.dtype == q.dtype == torch.float32 else None)
        if kernels is not None and whole:  # the whole step: the kernel writes the new keys and values too
            g = batch.groups[0]
            return kernels.paged_decode_attention(q, k_pool, v_pool, g.slots, g.lengths, self.scale, window or 0,
                                                  k, v, batch.write)
        if scale is not None and kv.kind is not None:
            k, v = quantize_kv(k, scale, kv.kind), quantize_kv(v, scale, kv.kind)
        _bytes(k_pool).index_copy_(0, batch.write, _bytes(k))
        _bytes(v_pool).index_copy_(0, batch.write, _bytes(v))
        out = None if whole else torch.empty(rows, width)
        for g in batch.groups:
            if kernels is not None and g.span is not None:
                assert out is not None  # a decode group beside context chunks: its rows of `out`
                out[g.span[0]:g.span[1]] = kernels.paged_decode_attention(q[g.span[0]:g.span[1]], k_pool, v_pool,
                                                                          g.slots, g.lengths, self.scale, window or 0)
                continue
            shape = (g.batch, g.slots.shape[1], *k_pool.shape[1:])
            keys = _bytes(k_pool).index_select(0, g.flat_slots).view(k_pool.dtype).view(shape)  # [B, S, heads, head]
            values = _bytes(v_pool).index_select(0, g.flat_slots).view(v_pool.dtype).view(shape)
            if scale is not None:
                keys, values = dequantize_kv(keys, scale), dequantize_kv(values, scale)
            if g.span is not None:  # decoding rows, consecutive: a view of q
                query = q[g.span[0]:g.span[1]].reshape(g.batch, 1, *q.shape[1:]).transpose(1, 2)
            else:
                query = q[g.q_index].view(g.batch, g.q_len, *q.shape[1:]).transpose(1, 2)
            if sinks is not None:  # gpt-oss: a learned sink logit per head (sinks.py)
                o = attend_with_sinks(query, keys.transpose(1, 2), values.transpose(1, 2), g.mask(window, chunk),
                                      self.scale, sinks)
            elif self.d.attn_softcap:
                o = self._softcapped(query, keys.transpose(1, 2), values.transpose(1, 2), g.mask(window, chunk),
                                     self.d.attn_softcap)
            else:
                causal = g.plain_causal(window, chunk)
                o = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2),
                                                   attn_mask=None if causal else g.additive_mask(window, chunk),
                                                   is_causal=causal, scale=self.scale, enable_gqa=True)
            if whole:
                return o.transpose(1, 2).reshape(rows, width)
            assert out is not None
            if g.span is not None:
                out[g.span[0]:g.span[1]] = o.transpose(1, 2).reshape(g.batch, width)
            else:
                out[g.tokens] = o.transpose(1, 2).reshape(g.batch * g.q_len, -1)[g.valid]
        assert out is not None
        return out

    def _softcapped(self, query, keys, values, mask, cap: float) -> torch.Tensor:
        """Attention with soft-capped scores (Gemma 2's attn_logit_softcapping, TensorRT-LLM's max_attn_value):
        tanh(s / c) * c after scaling, before the mask; SDPA has no such hook, so the scores are materialised.
        query [B, heads, q, hd], keys/values [B, kv_heads, S, hd], mask [B, 1, q, S] (True: attend)."""
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        scores = torch.tanh(query @ keys.transpose(-1, -2) * self.scale / cap) * cap
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return weights @ values

    def _mlp_block(self, shards, local, x, layer: int = 0, lora: LoraBatch | None = None) -> torch.Tensor:
        first = shards[0].layers[local]
        gemma = self.d.inter_layernorms  # Gemma 2: pre/post_feedforward_layernorm around a GELU-gated MLP
        pre = first.pre_ff_norm if gemma and first.pre_ff_norm is not None else first.post_norm
        h = rms_norm(x, pre, self.d.norm_epsilon)
        act = _gelu_tanh if self.d.hidden_act == "gelu" else F.silu
        total = None
        cols = None
        for s in shards:
            w = s.layers[local]
            if w.experts is not None:  # mixture of experts: this rank's experts' part (moe.py)
                part = w.experts(h)
            elif w.gate is None:  # one swiglu fc [up; gate] (Phi-3): silu(second half) * first half
                up, gate = w.fc(h).chunk(2, dim=-1)
                part = w.proj(F.silu(gate) * up, add_bias=False)
            elif lora is not None:  # gate_proj (fc) and up_proj (gate) deltas before the product, down_proj's after
                fc, gate = w.fc(h), w.gate(h)
                lora.add(fc, h, layer, s.tp_rank, "mlp_h_to_4h")
                lora.add(gate, h, layer, s.tp_rank, "mlp_gate")
                inner = act(fc) * gate
                part = w.proj(inner, add_bias=False)
                lora.add(part, inner, layer, s.tp_rank, "mlp_4h_to_h")
            elif on_columns(h.shape[0], w.fc, w.gate, w.proj):  # float32, few rows: on columns throughout, one
                # transposed view at the end
                cols = as_columns(h) if cols is None else cols
                inner = _act_(act, w.fc.columns(cols)).mul_(w.gate.columns(cols))
                part = w.proj.columns(gemm_columns(inner), add_bias=False).t()[: h.shape[0]]
            else:  # in place on the fresh matmul outputs: the same values, two [rows, inter] allocations fewer
                part = w.proj(_act_(act, w.fc(h)).mul_(w.gate(h)), add_bias=False)
            total = part if total is None else total + part
        assert total is not None
        total = self._tp_sum(total)
        bias = first.proj.bias if first.proj is not None else None
        out = total + bias if bias is not None else total
        if gemma and first.post_ff_norm is not None:
            out = rms_norm(out, first.post_ff_norm, self.d.norm_epsilon)
        return _residual(x, out)


def _residual(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x + out: into the block's own fresh output where it lies in rows, else (a transposed view of a product on
    columns) a new tensor in x's layout; the same sums either way."""
    return out.add_(x) if out.is_contiguous() else x + out


def _act_(act, x: torch.Tensor) -> torch.Tensor:
    """`act(x)`, written into x where the activation can (SiLU)."""
    return F.silu(x, inplace=True) if act is F.silu else act(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's `gelu` (functional.py: the tanh approximation), HF's gelu_pytorch_tanh."""
    return F.gelu(x, approximate="tanh")
