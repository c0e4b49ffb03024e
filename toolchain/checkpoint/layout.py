"""The conversion plan: which HF tensors are read together, what each rank
file receives, and with which shape and dtype, computed from safetensors
headers alone (sharding runs on meta tensors).

The same `shard_group` runs on meta tensors here and on real tensors in the
writer, so the plan and the written files cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from toolchain.archs.common import (EXPERT_SHARDS, STACKED_EXPERT_SHARDS, TRANSFORMS, Family, Match, NameTable, Row, Shard, Stage,
                                    expected_shape, trt_name)
from toolchain.archs.layout import Layout
from toolchain.archs.params import ArchParams
from toolchain.checkpoint import expert_stacks, sharding
from toolchain.checkpoint.sharding import split_experts
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.errors import ToolchainError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A row's own dtype (Row.dtype): a float one, or stored bytes kept as they are (gpt-oss's MXFP4 blocks and scales).
ROW_DTYPES = {**TORCH_DTYPES, "uint8": torch.uint8}


@dataclass(frozen=True)
class Options:
    tp: int
    pp: int
    dtype: str
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0
    moe_tp: int | None = None
    """Mixture-of-experts sizes as the spec gives them (None: derived, archs/layout.py Layout.moe_tp/moe_ep)."""
    moe_ep: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def layout(self) -> Layout:
        """The split these options ask for, as one value (archs/layout.py)."""
        return Layout(self.tp, self.pp, self.moe_tp, self.moe_ep, self.use_parallel_embedding,
                      self.embedding_sharding_dim)


@dataclass(frozen=True)
class Output:
    row: Row
    name: str
    """TensorRT-LLM name with the stage-local layer index."""
    stage: int


@dataclass
class Group:
    """HF tensors read together (q/k/v of one layer, or one tensor) and what they become."""

    sources: tuple[str, ...]
    outputs: list[Output] = field(default_factory=list)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Plan:
    family: Family
    params: ArchParams
    options: Options
    config: dict
    groups: list[Group]
    ranks: list[list[PlannedTensor]]
    dropped: list[str]
    config_only: bool = False
    """Planned from config.json alone (no weights present): shapes from the family table."""
    quant: Any = None
    """The `checkpoint.quantize.Quantizer` of a quantized conversion (None: every tensor unquantized, as
    tensorrt_llm/models/llama/convert.py writes it)."""
    medusa: Any = None
    """The `checkpoint.medusa.MedusaHeads` added to a MedusaForCausalLM checkpoint, or None."""
    eagle: Any = None
    """(`checkpoint.eagle.EagleDraft`, `EagleShape`) added to an EagleForCausalLM checkpoint, or None."""

    def rank_bytes(self, rank: int) -> int:
        return sum(t.nbytes for t in self.ranks[rank])

    @property
    def total_bytes(self) -> int:
        return sum(self.rank_bytes(r) for r in range(len(self.ranks)))

    def stage_layers(self, rank: int) -> list[int]:
        """Global decoder-layer indices held by `rank` (its pipeline stage's share)."""
        return sharding.pp_layers(self.params.num_hidden_layers, self.options.pp)[rank // self.options.tp]

    def describe(self) -> dict:
        """JSON-friendly view: per rank, tensor name -> [shape, dtype, bytes]."""
        return {f"rank{r}": {t.name: [list(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes] for t in tensors}
                for r, tensors in enumerate(self.ranks)}


def stage_ranks(stage: int, tp: int) -> list[int]:
    return [sharding.rank_of(stage, t, tp) for t in range(tp)]


def prepare(t: torch.Tensor, row: Row, dtype: torch.dtype, hf: str) -> torch.Tensor:
    """Apply the row's transform and cast to the checkpoint dtype (the row's own, where it names one)."""
    if row.dtype is not None:
        dtype = ROW_DTYPES[row.dtype]
    if row.transform is not None:
        t = TRANSFORMS[row.transform](t)
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if dtype == torch.float16 and t.device.type != "meta" and t.is_floating_point():
        # A bf16/fp32 weight beyond fp16 range would silently become inf.
        if bool(torch.isinf(out).any()) and not bool(torch.isinf(t).any()):
            raise ToolchainError(f"{hf} overflows float16 (max |w| = {t.abs().max().item():.3g} > 65504)",
                                 "set model.dtype to bfloat16 or float32")
    return out


def shard_group(group: Group, tensors: dict[str, torch.Tensor], params: ArchParams,
                opts: Options) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """Rank -> [(TensorRT-LLM name, tensor)] for one group; `tensors` holds the
    prepared (transformed, cast) sources."""
    tp = opts.tp
    out: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for o in group.outputs:
        shard = o.row.shard
        if shard is Shard.QKV:
            q, k, v = (tensors[name] for name in group.sources)
            pieces = sharding.split_qkv(q, k, v, nh=params.num_attention_heads,
                                        nkv=params.num_key_value_heads, tp=tp)
        elif shard in EXPERT_SHARDS:
            moe_tp, moe_ep = opts.layout.moe_tp, opts.layout.moe_ep
            sources = [tensors[name] for name in group.sources]
            if shard is Shard.EXPERT_FC:
                # sources are w3 of every expert, then w1 (build_groups); a rank's fc is [w3_e; w1_e] of each of its
                # experts, both cut along the expert width (convert.py: torch.concat([w3, w1], dim=-2) after the split)
                half = len(sources) // 2
                w3 = split_experts(sources[:half], tp, moe_tp, moe_ep, dim=0)
                w1 = split_experts(sources[half:], tp, moe_tp, moe_ep, dim=0)
                pieces = [torch.stack([torch.cat([a, b]) for a, b in zip(w3_r, w1_r, strict=True)])
                          for w3_r, w1_r in zip(w3, w1, strict=True)]
            else:  # w2 [H, I] per expert: its input, the expert width, is what moe_tp splits
                pieces = [torch.stack(r) for r in split_experts(sources, tp, moe_tp, moe_ep, dim=1)]
        elif shard in STACKED_EXPERT_SHARDS:  # every expert of the layer in one HF tensor (Llama 4)
            (src,) = (tensors[name] for name in group.sources)
            pieces = sharding.split_stacked_experts(src, shard is Shard.STACKED_EXPERT_FC, tp, opts.layout.moe_tp,
                                                    opts.layout.moe_ep)
        elif shard is Shard.GATED_FC:
            # up then gate (build_groups), each cut like a column-parallel weight; a rank's fc is [up_r; gate_r]
            # (tensorrt_llm/models/qwen/convert.py: torch.concat([up, gate], dim=-2) after split(..., dim=0))
            up, gate = (sharding.split_column(tensors[name], tp) for name in group.sources)
            pieces = [torch.cat([a, b]) for a, b in zip(up, gate, strict=True)]
        else:
            (src,) = (tensors[name] for name in group.sources)
            if shard is Shard.COLUMN:
                pieces = sharding.split_column(src, tp)
            elif shard is Shard.ROW:
                pieces = sharding.split_row(src, tp)
            elif shard is Shard.FUSED_QKV:
                pieces = sharding.split_fused_qkv(src, nh=params.num_attention_heads,
                                                  nkv=params.num_key_value_heads, tp=tp)
            elif shard is Shard.FUSED_GATE_UP:
                pieces = sharding.split_gated_fc(src, tp)
            elif shard is Shard.STACKED_GATE_UP:
                pieces = expert_stacks.split_gate_up(src, tp, opts.layout.moe_tp, opts.layout.moe_ep)
            elif shard is Shard.STACKED_DOWN:
                pieces = expert_stacks.split_down(src, tp, opts.layout.moe_tp, opts.layout.moe_ep)
            elif shard is Shard.STACKED_GATE_UP_ROWS:
                pieces = expert_stacks.split_gate_up_rows(src, tp, opts.layout.moe_tp, opts.layout.moe_ep)
            elif shard is Shard.STACKED_DOWN_ROWS:
                pieces = expert_stacks.split_down_rows(src, tp, opts.layout.moe_tp, opts.layout.moe_ep)
            elif shard is Shard.REPLICATE:
                pieces = [src] * tp
            elif shard is Shard.VOCAB:
                pieces = sharding.split_vocab(src, tp)
            elif shard is Shard.EMBEDDING:
                pieces = sharding.split_embedding(src, tp, parallel=opts.use_parallel_embedding,
                                                  dim=opts.embedding_sharding_dim)
            else:
                raise ValueError(f"no shard rule {shard} for {o.name}")
        for rank, piece in zip(stage_ranks(o.stage, tp), pieces, strict=False):
            out.setdefault(rank, []).append((o.name, piece))
    return out


def _stage_of(row: Row, layer: int | None, layer_stage: dict[int, tuple[int, int]], pp: int) -> tuple[int, int | None]:
    if row.placement is Stage.LAYER:
        if layer is None:  # NameTable gives every per-layer row its layer number
            raise ValueError(f"per-layer row {row.hf} matched without a layer number")
        return layer_stage[layer]
    return (0 if row.placement is Stage.FIRST else pp - 1), None


def _check_shape(name: str, row: Row, shape: tuple[int, ...], params: ArchParams) -> None:
    """A weight whose shape disagrees with config.json would otherwise fail deep
    inside a reshape; name it instead (shapes are compared after the transform)."""
    want = expected_shape(row, params)
    if want is None:
        return
    got = shape
    if row.transform is not None:
        got = tuple(TRANSFORMS[row.transform](torch.empty(shape, device="meta")).shape)
    if got != want:
        raise ToolchainError(f"{name} has shape {list(got)} but config.json implies {list(want)}",
                             "the weights do not match config.json (sizes, heads, head_dim)")


def build_groups(family: Family, params: ArchParams, ckpt: HFCheckpoint,
                 opts: Options) -> tuple[list[Group], list[str]]:
    """Match every HF tensor to a table row, check nothing required is missing,
    and group the sources in write order. Returns (groups, dropped HF names)."""
    table = NameTable(family, params)
    present = ckpt.tensors
    matches: dict[str, Match] = {}
    unmatched, dropped = [], []
    for name in present:
        m = table.match(name)
        if m is None:
            unmatched.append(name)
        elif m.row.shard is Shard.DROP:
            dropped.append(name)
        else:
            matches[name] = m
    if unmatched:
        raise table.unmatched_error(sorted(unmatched), str(ckpt.directory))

    layer_stage = {layer: (s, local) for s, layers in enumerate(sharding.pp_layers(params.num_hidden_layers, opts.pp))
                   for local, layer in enumerate(layers)}
    row_index = {row: i for i, row in enumerate(table.rows)}
    groups: dict[tuple, Group] = {}
    order: dict[tuple, tuple] = {}
    tied_alias: list[tuple[Row, str]] = []
    for name, m in table.expected():
        if name not in present:
            if m.row.tied_from and params.tie_word_embeddings and m.row.tied_from in present:
                tied_alias.append((m.row, m.row.tied_from))
                continue
            raise ToolchainError(f"{ckpt.directory}: required tensor {name} is missing",
                                 "the checkpoint is incomplete or does not match its config.json")
        _check_shape(name, m.row, present[name].shape, params)
        stage, local = _stage_of(m.row, m.layer, layer_stage, opts.pp)
        key: tuple  # the group's key in `groups` and `order`
        if m.row.shard is Shard.QKV:
            key = ("qkv", m.row.trt, m.layer)
        elif m.row.shard in EXPERT_SHARDS:
            key = ("experts", m.row.trt, m.layer)
        elif m.row.shard is Shard.GATED_FC:
            key = ("gated", m.row.trt, m.layer)
        else:
            key = ("one", name)
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(sources=())
            if m.layer is not None:
                sort_layer = m.layer
            else:
                sort_layer = -1 if m.row.placement is Stage.FIRST else params.num_hidden_layers
            order[key] = (sort_layer, row_index[m.row])
            group.outputs.append(Output(m.row, trt_name(m.row, local), stage))
        group.sources += (name,)
    for row, source in tied_alias:
        # Tied lm_head: one more output of the group that already reads the embedding.
        stage, _ = _stage_of(row, None, layer_stage, opts.pp)
        group = groups.get(("one", source))
        if group is None:  # the tied source is not itself a table row: read it on its own
            group = groups[("one", source)] = Group(sources=(source,))
            order[("one", source)] = (params.num_hidden_layers, len(row_index))
        group.outputs.append(Output(row, trt_name(row, None), stage))
    for key, group in groups.items():
        if key[0] == "qkv":
            parts = {matches[s].row.part: s for s in group.sources}
            group.sources = (parts["q"], parts["k"], parts["v"])
        elif key[0] == "experts":
            # every expert in order; an fc group's w3 sources before its w1 sources (MOEWeightWrapper's
            # "fc": w3 of the experts + w1 of the experts, tensorrt_llm/layers/moe.py)
            group.sources = tuple(sorted(group.sources, key=lambda s: (matches[s].row.part != "w3",
                                                                        matches[s].expert)))
        elif key[0] == "gated":
            group.sources = tuple(sorted(group.sources, key=lambda s: matches[s].row.part != "w3"))
    return [groups[k] for k in sorted(groups, key=order.__getitem__)], dropped


def build_plan(family: Family, params: ArchParams, ckpt: HFCheckpoint, opts: Options, config: dict,
               quant: Any = None) -> Plan:
    """Plan every rank file from headers only: no weight is read. With a
    quantizer, its linears are planned in their quantized layout instead."""
    groups, dropped = build_groups(family, params, ckpt, opts)
    if quant is not None:
        groups = quant.merge_mlp(groups)
    dtype = TORCH_DTYPES[opts.dtype]
    ranks: list[list[PlannedTensor]] = [[] for _ in range(opts.world_size)]
    for group in groups:
        if quant is not None and quant.handles(group):
            fp = {}
            for sub in _per_output(group):
                metas = {s: prepare(ckpt.meta(s), sub.outputs[0].row, dtype, s) for s in sub.sources}
                for rank, items in shard_group(sub, metas, params, opts).items():
                    fp.update({(rank, n): tuple(t.shape) for n, t in items})
            for rank, items in quant.plan_group(group, fp).items():
                ranks[rank].extend(PlannedTensor(n, shape, dt) for n, shape, dt in items)
            continue
        row = group.outputs[0].row
        metas = {s: prepare(ckpt.meta(s), row, dtype, s) for s in group.sources}
        for rank, items in shard_group(group, metas, params, opts).items():
            ranks[rank].extend(PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in items)
    if quant is not None:
        for rank in range(opts.world_size):
            ranks[rank].extend(PlannedTensor(n, s, dt) for n, s, dt in quant.kv_planned(rank // opts.tp))
    return Plan(family, params, opts, config, groups, ranks, dropped, quant=quant)


def _per_output(group: Group) -> list[Group]:
    """A merged group (fc and gate read together) as one group per output; others unchanged."""
    if len(group.outputs) == 1 or group.outputs[0].row.shard is Shard.QKV:
        return [group]
    return [Group(sources=(s,), outputs=[o]) for s, o in zip(group.sources, group.outputs, strict=False)]
