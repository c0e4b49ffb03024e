"""Quantized linears in the checkpoint: which tensors each format writes, and
how they are computed and sharded (TensorRT-LLM tensorrt_llm/quantization/layers.py,
tensorrt_llm/quantization/quantize_by_modelopt.py, tensorrt_llm/models/convert_utils.py).

A quantized linear is quantized whole, before any split, exactly as ModelOpt
quantizes and then exports: per-tensor and shared parameters (FP8 scales,
SmoothQuant's activation scale, AWQ's search) need the full matrix. Each
resulting component is then split with the linear's own TP rule according to
its layout:

| component layout | QKV / column-parallel | row-parallel |
|---|---|---|
| `weight` (out, in) | like the fp weight | like the fp weight |
| `out_vec` (out,), `out_groups` (out, in/g) | like the weight's rows | (out,) full copy; (out, in/g) split on dim 1 |
| `in_vec` (in,) | full copy | split |
| `scalar` (1,) | full copy | full copy |
| `tiles` (ceil(out/t), ceil(in/t)) | each part's whole tiles under its rows' rule | the whole tiles of the rank's columns |

A `tiles` grid (FP8 block scales: one scale per t x t tile of the weight, Format.tile) is split exactly as the weight
is: each weight row (of a row-parallel linear, each column) is labelled with its tile, the labels split by the
weight's own rule (split_qkv's heads and duplicated KV heads included), and each rank takes the tiles its labels name,
in order, as TensorRT-LLM's fused loaders concatenate each part's per-rank grid (FP8BlockScalesLinearMethod,
tensorrt_llm/_torch/modules/linear.py). A rank holding part of a tile is refused; quant/recipe.py check_tiles refuses
such a split before any weight is read.

Formats written (`quant_algo`; each one's tensors, shapes and dtypes are its row's `stored` in
toolchain/quant/formats.py, which `planned` and `components` follow):
- W8A16 / W4A16: the fp weights as they are; trtllm-build quantizes them for
  the target GPU (preprocess_weights in tensorrt_llm/models/modeling_utils.py;
  the pre-quantized layout of `convert_checkpoint.py --use_weight_only` is
  interleaved per GPU architecture). The CPU engine quantizes them the same way
  at load.
- awq (per-group int4): packed int4 (out/2, in) int8, `weights_scaling_factor` (out, in/g),
  `prequant_scaling_factor` (in,); imports of AutoAWQ/GPTQ add `zero` instead of the
  prequant vector (lossless). trtllm-build's per-group int4 preprocessing (TensorRT-LLM
  tensorrt_llm/models/modeling_utils.py, preprocess_perlayer_weights) transposes the
  weight and `weights_scaling_factor` but leaves `zero` as stored, and the groupwise
  layers (tensorrt_llm/quantization/layers.py, WeightOnlyGroupwiseQuant*Linear) declare
  it `(in/g, out)` in the model dtype: so `zero` is split like the scales, then
  written transposed, in the model dtype.
- W8A8_SQ_PER_CHANNEL: int8 weight, per-channel and static activation scales, prequant.
- FP8: e4m3 weight, per-tensor weight and activation scales; q/k/v and fc/gate share them.
- NVFP4: packed e2m1 weight uint8 (out, in/2), e4m3 block scales (out, in/16) row-major (trtllm-build makes the
  interleaved copy itself: preprocess_perlayer_weights, tensorrt_llm/models/modeling_utils.py @0c8de69), the
  global weight scale `weights_scaling_factor_2` and the input scale `activation_scaling_factor`, both (1,):
  amax / (6 x 448) of the weights and of the calibrated input. q/k/v and fc/gate share one global and one input
  scale, their block scales recomputed against it, as ModelOpt's QKVConfig does (torch/export/model_config.py)
  and FP4Linear's postprocess expects ("Ckpt uses qkv max is guaranteed", tensorrt_llm/quantization/layers.py
  @2a9abd95). Each rank's input width must be whole blocks of 16 (quant/recipe.py check_blocks).
- Mixture-of-experts stacks (FP8, awq) carry the experts in front, [experts, ...], as MOEWeightWrapper takes
  them (the section "mixture-of-experts stacks" below).

ModelOpt Hugging Face-format checkpoints (FP8, per-group int4 AWQ; toolchain/checkpoint/hf_quant.py) are
imported as stored: `virtualize_modelopt` (toolchain/checkpoint/stored.py) shows the planner the fp model they
encode, and the quantizer reads each group's stored components instead of computing them (the view's `modelopt`), then
pads, splits and writes them exactly as it does what it computes.

Scale dtypes follow NVIDIA's exporter (the golden layouts): float32 scales,
prequant vectors in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from toolchain.archs import moe
from toolchain.archs.common import EXPERT_SHARDS, FUSED_SHARDS, STACKED_EXPERT_SHARDS, Shard
from toolchain.archs.layout import Layout
from toolchain.checkpoint import sharding, stacked_fp8
from toolchain.checkpoint.block_experts import stored_block_experts
from toolchain.checkpoint.hf_quant import engine_kv_scale, fuse_group, stored_linear
from toolchain.checkpoint.hf_reader import HFCheckpoint, TensorInfo
from toolchain.checkpoint.layout import Group, prepare, stage_ranks
from toolchain.errors import ToolchainError
from toolchain.quant import awq as awq_q
from toolchain.quant import formats
from toolchain.quant import fp4 as fp4_q
from toolchain.quant import fp8 as fp8_q
from toolchain.quant import prequantized as pre_q
from toolchain.quant import smoothquant as sq_q
from toolchain.quant.int_quant import pack_int4, unpack_int4
from toolchain.quant.kv_cache import kv_cache_scale
from toolchain.quant.recipe import LayoutPlan, is_excluded
from toolchain.quant.view import Prequantized, Quantization
from toolchain.targets import ENGINE

# TensorRT-LLM linear modules -> the calibration slot of their input (q/k/v share one, fc/gate another).
LINEARS = {"attention.qkv": "qkv", "attention.dense": "dense", "mlp.fc": "mlp", "mlp.gate": "mlp", "mlp.proj": "proj",
           # DeepSeek-V3 (archs/deepseek_v3.py), imported stored only: its latent projections share the hidden input
           # (TensorRT-LLM fuses them as fused_a), q_b and kv_b read their latents, the shared expert its own MLP's
           "attention.q_a_proj": "latent", "attention.kv_a_proj_with_mqa": "latent", "attention.q_b_proj": "q_latent",
           "attention.kv_b_proj": "kv_latent", "mlp.shared_expert.fc": "shared", "mlp.shared_expert.proj": "shared_proj"}
MLP_OUT = ("mlp.fc", "mlp.gate")    # their out dim is the intermediate size
MLP_IN = ("mlp.proj",)              # its in dim is
ALWAYS_EXCLUDED = ["lm_head", "transformer.vocab_embedding"]
F32, I8 = torch.float32, torch.int8
# formats.Tensor dtypes -> torch ("model": the checkpoint's float dtype, given per Quantizer).
TORCH_STORAGE = {"int8": I8, "uint8": torch.uint8, "fp8": fp8_q.FP8_DTYPE, "float32": F32, "float16": torch.float16}
KV_NAME = "transformer.layers.{layer}.attention.kv_cache_scaling_factor"


@dataclass
class Component:
    suffix: str
    layout: str                  # weight | out_vec | out_groups | in_vec | scalar | tiles
    parts: list[torch.Tensor]    # one per source for row-carrying layouts (q, k, v); else one
    dtype: torch.dtype


def linear_of(name: str) -> tuple[str, str, int] | None:
    """'transformer.layers.3.attention.qkv.weight' -> (module prefix, 'attention.qkv', 3), else None."""
    parts = name.split(".")
    if len(parts) not in (6, 7) or parts[:2] != ["transformer", "layers"] or parts[-1] != "weight":
        return None
    module = ".".join(parts[3:-1])
    return (name[: -len(".weight")], module, int(parts[2])) if module in LINEARS else None


@dataclass
class Quantizer:
    quantization: Quantization
    """The view (quant/view.py): what is written, and the source it is read from when stored."""
    nh: int
    nkv: int
    tp: int
    layers_per_stage: list[list[int]]
    layout: LayoutPlan
    intermediate: int
    dtype: torch.dtype
    stats: list | None = None   # calibration LayerStats per global layer, set before writing
    raw: dict[str, TensorInfo] = field(default_factory=dict)  # imports: the packed tensors behind the virtual weights
    kv_sources: dict[int, tuple[str, str]] = field(default_factory=dict)
    """ModelOpt imports with an FP8 KV cache: global layer -> its stored (k_scale, v_scale) names in `raw`."""
    mapping: Layout = Layout()
    """The checkpoint's split (Options.layout): its moe_tp x moe_ep say how FP8 expert stacks are split."""
    moe_exclude: tuple[str, ...] = ()
    """A mixture of experts: the globs that keep its router (and shared expert gate) unquantized
    (quant/exclude.py moe_exclusions), which a written list must carry since it replaces the default."""

    @property
    def imports(self) -> bool:
        """The quantized tensors are read from the checkpoint, not computed from fp weights."""
        return self.quantization.reads_stored

    # -- what is written ------------------------------------------------------------------

    @property
    def format(self) -> formats.Format:
        """The row of what is written: the spec's method, or an imported AutoAWQ/GPTQ int4 checkpoint."""
        return self.quantization.format

    @property
    def fmt(self) -> str | None:
        """The row's name when linears are stored quantized; None when the weights stay fp (none,
        W8A16/W4A16 option a)."""
        row = self.format
        return None if row.stored == formats.FP_WEIGHT else row.name

    @property
    def per_group(self) -> bool:
        return self.format.per_group

    @property
    def quant_algo(self) -> str | None:
        return self.format.quant_algo

    @property
    def group_size(self) -> int:
        return self.quantization.weight_group_size

    def config(self) -> dict:
        """config.json `quantization` (QuantConfig, TensorRT-LLM tensorrt_llm/models/modeling_utils.py).
        The exclude list replaces TensorRT-LLM's default, so it always names lm_head and the vocab
        embedding (per-channel weight-only modes would otherwise quantize the embedding), and for a
        mixture of experts its router and shared expert gate (`moe_exclude`: otherwise quantize_layers
        makes them quantized row linears whose scales no checkpoint holds); NVIDIA's exporter writes only
        "lm_head" because its formats never quantize embeddings. The spec's own globs come after these."""
        algo = self.quant_algo
        q: dict = {"quant_algo": algo, "kv_cache_quant_algo": self.quantization.kv_cache_quant_algo}
        if algo is not None:
            kept = ALWAYS_EXCLUDED + list(self.moe_exclude)
            q["exclude_modules"] = kept + [p for p in self.quantization.exclude_modules if p not in kept]
        if self.per_group:
            zero = self.quantization.imported is not None
            q.update(group_size=self.group_size, has_zero_point=zero, pre_quant_scale=not zero)
        elif self.format.group_size is not None:  # a block the format fixes (NVFP4's 16; QuantConfig's default is 128)
            q["group_size"] = self.format.group_size
        return q

    def global_layer(self, stage: int, local: int) -> int:
        return self.layers_per_stage[stage][local]

    def quantizes(self, name: str, stage: int) -> bool:
        lin = linear_of(name)
        if lin is None or self.fmt is None:
            return False
        prefix, _module, local = lin
        glob = prefix.replace(f"layers.{local}.", f"layers.{self.global_layer(stage, local)}.", 1)
        return not is_excluded(glob, self.quantization.exclude_modules)

    def padded_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-group int4 MLP linears are zero-padded to the intermediate size the engine expects
        (WeightOnlyGroupwiseQuantLinear, tensorrt_llm/quantization/layers.py)."""
        lin = linear_of(name)
        if lin is None or not self.per_group:
            return shape
        local = self.layout.padded_intermediate // self.tp
        if lin[1] in MLP_OUT:
            # a fused swiglu fc (Phi-3) holds both halves, each padded (Quantizer.pad pads each part)
            halves = 2 if shape[0] * self.tp == 2 * self.intermediate else 1
            return (halves * local, shape[1])
        if lin[1] in MLP_IN:
            return (shape[0], local)
        return shape

    def planned(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The tensors replacing fp weight `name` of per-rank `shape`."""
        out, inp = self.padded_shape(name, shape)
        prefix = name[: -len(".weight")]
        return [(f"{prefix}.{t.suffix}", t.dims(out, inp, self.group_size), self._torch_dtype(t.dtype))
                for t in self.format.stored]

    def _torch_dtype(self, kind: str) -> torch.dtype:
        return self.dtype if kind == "model" else TORCH_STORAGE[kind]

    def _components(self, values: dict[str, list[torch.Tensor]]) -> list[Component]:
        """One output's components in the order, layouts and dtypes of its row's `stored` tensors;
        `values`: suffix -> parts (one per source for row-carrying layouts)."""
        return [Component(t.suffix, t.layout, values[t.suffix], self._torch_dtype(t.dtype))
                for t in self.format.stored]

    def kv_planned(self, stage: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if self.quantization.kv_cache == "none":
            return []
        return [(KV_NAME.format(layer=i), (1,), F32) for i in range(len(self.layers_per_stage[stage]))]

    def kv_scale(self, stage: int, local: int, ckpt: HFCheckpoint | None = None) -> torch.Tensor:
        layer = self.global_layer(stage, local)
        if self.quantization.modelopt:
            if ckpt is None:
                raise ValueError("a stored import's KV-cache scales are read from its checkpoint: pass ckpt")
            k, v = (ckpt.read(self.raw[n]) for n in self.kv_sources[layer])
            return engine_kv_scale(k, v)
        return kv_cache_scale(self._stats(layer).qkv_amax, self.quantization.kv_cache)

    def _stats(self, layer: int):
        """The calibration LayerStats of a global layer."""
        if self.stats is None:  # the converter sets them after calibrating, before writing
            raise RuntimeError("Quantizer.stats is not set: calibrate before computing quantized tensors")
        return self.stats[layer]

    # -- computing ------------------------------------------------------------------------

    def components(self, module: str, layer: int, weights: list[list[torch.Tensor]] | None,
                   prefixes: list[list[str]], load) -> list[list[Component]]:
        """Per output (qkv: one with q, k, v; merged fc/gate: two), its full, unsplit components.
        `weights` (the fp sources) may be None for imports, which read their stored tensors."""
        pre = self.quantization.prequantized
        if pre is not None and self.quantization.imported:  # fmt imported_int4
            return [self._imported(pre, p, load) for p in prefixes]
        if self.quantization.modelopt:
            return self._stored(prefixes, load)
        self.format.check_implemented(ENGINE)  # a pending quantizer: refused, never written as another format
        if weights is None:
            raise ValueError(f"quantizing {module} of layer {layer} needs its fp weights")
        flat = [w for ws in weights for w in ws]
        slot = LINEARS[module]
        st = self._stats(layer).inputs[slot]
        compute = COMPUTED.get(self.format.quantizer)
        if compute is None:  # the row's quantizer (quant/formats.py) has no branch here
            raise ValueError(f"{module}: no quantizer computes format {self.format.name} "
                             f"(quantizer {self.format.quantizer!r})")
        return self._regroup(compute(self, flat, st), [len(ws) for ws in weights])

    def _awq(self, flat: list[torch.Tensor], st) -> list[list[Component]]:
        lins, _ = awq_q.quantize_awq(flat, st.absmean, st.cov, self.group_size, search=self.quantization.search,
                                     clip=self.quantization.search,
                                     rounding=self.quantization.rounding if self.quantization.search else "nearest")
        return [self._components({"weight": [lin.weight], "weights_scaling_factor": [lin.weights_scaling_factor],
                                  "prequant_scaling_factor": [lin.prequant_scaling_factor]}) for lin in lins]

    def _smoothquant(self, flat: list[torch.Tensor], st) -> list[list[Component]]:
        sq_lins = sq_q.quantize_sq(flat, st.amax, self.quantization.alpha if self.quantization.search else None)
        return [self._components({"weight": [lin.weight], "weights_scaling_factor": [lin.weights_scaling_factor],
                                  "activation_scaling_factor": [lin.activation_scaling_factor],
                                  "prequant_scaling_factor": [lin.prequant_scaling_factor]})
                for lin in sq_lins]

    def _fp8(self, flat: list[torch.Tensor], st) -> list[list[Component]]:
        # q/k/v must share one weight scale (FP8Linear); fc and gate preferably do, and here they do.
        qs, wscale = fp8_q.quantize_fp8_shared(flat)
        ascale = fp8_q.fp8_scale(st.amax.max())
        return [self._components({"weight": [q], "weights_scaling_factor": [wscale],
                                  "activation_scaling_factor": [ascale]}) for q in qs]

    def _nvfp4(self, flat: list[torch.Tensor], st) -> list[list[Component]]:
        parts, shared, ascale = fp4_q.quantize_nvfp4_fused(flat, st.amax)
        return [self._components({"weight": [packed], "weights_scaling_factor": [blocks],
                                  "weights_scaling_factor_2": [shared.reshape(1)],
                                  "activation_scaling_factor": [ascale.reshape(1)]}) for packed, blocks in parts]

    @staticmethod
    def _regroup(per_source: list[list[Component]], counts: list[int]) -> list[list[Component]]:
        """Per-source components -> per output (q, k, v become the parts of one output's components)."""
        out, at = [], 0
        for n in counts:
            group = per_source[at:at + n]
            merged = []
            for i, comp in enumerate(group[0]):
                parts = [c[i].parts[0] for c in group] if comp.layout in formats.ROW_LAYOUTS else comp.parts
                merged.append(Component(comp.suffix, comp.layout, parts, comp.dtype))
            out.append(merged)
            at += n
        return out

    def _imported(self, pq: Prequantized, prefixes: list[str], load) -> list[Component]:
        """AutoAWQ/GPTQ tensors of one output's sources -> signed int4 + scales + zero, losslessly."""
        ws, ss, zs = [], [], []
        g = self.group_size
        for p in prefixes:
            if pq.kind == "awq":
                q, z, s = pre_q.unpack_awq_gemm(load(p + ".qweight"), load(p + ".qzeros"), load(p + ".scales"))
            else:
                g_idx = load(p + ".g_idx") if p + ".g_idx" in self.raw else None
                try:
                    q, z, s = pre_q.unpack_gptq(load(p + ".qweight"), load(p + ".qzeros"), load(p + ".scales"),
                                                g_idx, g)
                except ValueError as err:
                    raise ToolchainError(f"{p}: {err}", "re-quantize the model with desc_act false") from None
            signed, scales, zero = pre_q.to_signed_with_zero(q, z, s)
            ws.append(signed)
            ss.append(scales)
            zs.append(zero)
        return self._components({"weight": ws, "weights_scaling_factor": ss, "zero": zs})

    def _stored(self, prefixes: list[list[str]], load) -> list[list[Component]]:
        """ModelOpt HF-format tensors of one shared-input group -> per output, the components the
        engine path computes, as stored: FP8 parts brought to the group's one weight and activation
        scale (the fused GEMM has one), AWQ's one prequant vector (ones where the exporter folded it
        into the norm). The int4 weight is unpacked because `finish` packs after the split."""
        algo = self.quant_algo
        if algo is None:  # fmt is None then: no linear is quantized, so none comes here
            raise ValueError("a stored import without a quant_algo has no quantized linears")
        flat = [p for ps in prefixes for p in ps]
        parts = [stored_linear(load, self.raw.__contains__, p, algo) for p in flat]
        fused = fuse_group(parts, algo, self.raw[flat[0] + ".weight"].shape[1], self.dtype)
        # The int4 weight is unpacked here and packed again after the split (`finish`).
        comps = [self._components({s: [unpack_int4(t) if s == "weight" and self.per_group else t]
                                   for s, t in f.items()}) for f in fused]
        return self._regroup(comps, [len(ps) for ps in prefixes])

    def pad(self, module: str, comps: list[Component]) -> list[Component]:
        """Zero-pad per-group MLP components to the padded intermediate size
        (WeightOnlyGroupwiseQuantLinear): zero weights, unit scales and prequant (so nothing
        divides by zero), zero zero-points."""
        target = self.layout.padded_intermediate
        if not self.per_group or target == self.intermediate or module not in MLP_OUT + MLP_IN:
            return comps
        g, out = self.group_size, []
        for c in comps:
            fill = 0.0 if c.suffix in ("weight", "zero") else 1.0
            parts = []
            for t in c.parts:
                if module in MLP_OUT and c.layout in ("weight", "out_groups"):
                    t = torch.cat([t, torch.full((target - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)])
                elif module in MLP_IN and c.layout == "weight":
                    t = torch.cat([t, torch.full((t.shape[0], target - t.shape[1]), fill, dtype=t.dtype)], dim=1)
                elif module in MLP_IN and c.layout == "out_groups":
                    extra = target // g - t.shape[1]
                    t = torch.cat([t, torch.full((t.shape[0], extra), fill, dtype=t.dtype)], dim=1)
                elif module in MLP_IN and c.layout == "in_vec":
                    t = torch.cat([t, torch.full((target - t.shape[0],), fill, dtype=t.dtype)])
                parts.append(t)
            out.append(Component(c.suffix, c.layout, parts, c.dtype))
        return out

    def split(self, comp: Component, shard: Shard, weight: Component | None = None) -> list[torch.Tensor]:
        """One component's per-rank pieces under the linear's TP rule (table in the module docstring). `weight`: the
        linear's weight component, whose rows and columns a `tiles` grid covers."""
        tp = self.tp
        if comp.layout == "tiles":
            if weight is None:
                raise ValueError(f"{comp.suffix}: a tile grid is split by the rows and columns of its weight: pass it")
            return self._split_tiles(comp, shard, weight)
        if comp.layout == "scalar":
            return [comp.parts[0]] * tp
        if comp.layout == "in_vec":
            t = comp.parts[0]
            return list(t.chunk(tp)) if shard is Shard.ROW and tp > 1 else [t] * tp
        if shard in (Shard.QKV, Shard.FUSED_QKV):
            return sharding.split_qkv(*comp.parts, nh=self.nh, nkv=self.nkv, tp=tp)
        if shard in (Shard.GATED_FC, Shard.FUSED_GATE_UP):  # parts (up, gate): per rank [up_r; gate_r] (sharding.split_gated_fc)
            up, gate = (sharding.split_column(t, tp) for t in comp.parts)
            return [torch.cat([u, g]) for u, g in zip(up, gate, strict=True)]
        (t,) = comp.parts
        if shard is Shard.COLUMN:
            return sharding.split_column(t, tp)
        if shard is Shard.REPLICATE:  # DeepSeek-V3's latent projections, whole on every rank
            return [t] * tp
        if comp.layout == "out_vec":
            return [t] * tp
        return sharding.split_row(t, tp)

    def _split_tiles(self, comp: Component, shard: Shard, weight: Component) -> list[torch.Tensor]:
        """A `tiles` grid's per-rank pieces (the module docstring): each weight row, or a row-parallel weight's column,
        labelled with its tile's index in the parts' stacked grid, the labels split as the weight is."""
        tile = self.format.tile
        if tile is None:
            raise ValueError(f"{comp.suffix}: format {self.format.name} has no tiles")
        grid, dim, labels, at = torch.cat(comp.parts), 0, [], 0
        if shard is Shard.ROW:  # the input columns are cut; every rank keeps all the grid's rows
            (w,) = weight.parts
            dim, labels = 1, [torch.arange(grid.shape[1]).repeat_interleave(tile)[: w.shape[1]].reshape(1, -1)]
        else:
            for g, w in zip(comp.parts, weight.parts, strict=True):
                labels.append((torch.arange(g.shape[0]) + at).repeat_interleave(tile)[: w.shape[0]].reshape(-1, 1))
                at += g.shape[0]
        whole = torch.bincount(torch.cat([t.flatten() for t in labels]), minlength=grid.shape[dim])
        pieces = []
        for rank, held in enumerate(self.split(Component("tile labels", "weight", labels, torch.int64), shard)):
            tiles, counts = torch.unique_consecutive(held.flatten(), return_counts=True)
            if not torch.equal(counts, whole[tiles]):
                raise ToolchainError(f"{comp.suffix}: rank {rank} of tp {self.tp} would hold part of a {tile}x{tile} "
                                     f"tile of {self.format.name}'s scale grid, which scales the whole tile",
                                     "use another parallelism.tp, or quantization.method fp8")
            pieces.append(grid.index_select(dim, tiles))
        return pieces

    def finish(self, comp: Component, piece: torch.Tensor) -> torch.Tensor:
        if comp.suffix == "weight" and self.per_group:
            return pack_int4(piece.contiguous())
        if comp.suffix == "zero":  # split as (out, in/g) like the scales, stored as the layer declares it
            return piece.t().to(comp.dtype).contiguous()
        return piece.to(comp.dtype).contiguous()

    # -- the plan and the writer ----------------------------------------------------------

    def handles(self, group: Group) -> bool:
        return all(self.quantizes(o.name, o.stage) for o in group.outputs)

    # -- mixture-of-experts stacks (FP8, AWQ) -----------------------------------------------
    # MOEWeightWrapper (TensorRT-LLM tensorrt_llm/layers/moe.py at c388fec7) holds an FP8 stack as weight
    # [experts, out, in] e4m3, weights_scaling_factor [experts, 1] (fc: w3 and w1 of an expert share the larger
    # of their two scales, the weights requantized to it) and one activation_scaling_factor [1] for the stack,
    # "max input range": the largest of the experts' input scales. The experts' input statistics come from
    # calibration running every expert on every token (quant/calibration.py _expert_amax).

    @staticmethod
    def is_experts(group: Group) -> bool:
        return group.outputs[0].row.shard in EXPERT_SHARDS + STACKED_EXPERT_SHARDS

    # AWQ (per-group W4A16, MOEWeightWrapper's has_per_group_scaling branch) is stored as the dense awq linear is,
    # with the experts in front: weight [experts, out/2, in] int8 (two int4 rows per byte), weights_scaling_factor
    # [experts, out, in/g] and prequant_scaling_factor [experts, in]. trtllm-build's preprocess_perlayer_weights
    # (tensorrt_llm/models/modeling_utils.py at c388fec7, W4A16_AWQ) transposes the last two axes of the int8
    # weight and of the scales, which gives the wrapper's weight [experts, in, out/4] (after
    # preprocess_weights_for_mixed_gemm) and weights_scaling_factor [experts, in/g, out], and keeps row 0 of a 2-D
    # prequant ("MoE experts share the same scaling factor") as the wrapper's (1, in): so every row is the one
    # vector the stack's scale search found (awq.quantize_awq_experts). Zero points stay off (has_zero_point
    # false, as for dense awq).

    def _expert_planned(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        prefix = name[: -len(".weight")]
        if self.format.quantizer == "awq" or self._stored_block_experts:
            experts, out, inp = shape
            return [(f"{prefix}.{t.suffix}", (experts, *t.dims(out, inp, self.group_size)),
                     self._torch_dtype(t.dtype)) for t in self.format.stored]
        if self.format.quantizer != "fp8":
            raise ValueError(f"{name}: expert stacks are written quantized in fp8 or awq only, not {self.fmt}")
        return [(f"{prefix}.weight", shape, fp8_q.FP8_DTYPE), (f"{prefix}.weights_scaling_factor", (shape[0], 1), F32),
                (f"{prefix}.activation_scaling_factor", (1,), F32)]

    @property
    def _stored_block_experts(self) -> bool:
        """Expert stacks imported as a DeepSeek-V3 checkpoint stores them: FP8 block scales read, not computed."""
        return self.quantization.modelopt and self.format.quantizer == "fp8_block"

    def _write_experts(self, group: Group, ckpt: HFCheckpoint) -> dict[int, list[tuple[str, torch.Tensor]]]:
        if self._stored_block_experts:
            o = group.outputs[0]
            return stored_block_experts(_linear(o.name)[0], o, group.sources, lambda n: ckpt.read(self.raw[n]),
                                        self.raw.__contains__, self.format, self.tp, self.mapping)
        o = group.outputs[0]
        prefix, _, local = _linear(o.name)
        if stacked_fp8.is_stacked(o.row):  # Llama 4's experts: read as stored, never computed here
            self._check_stacked(o)
            return stacked_fp8.write(prefix, o, group.sources[0], lambda n: ckpt.read(self.raw[n]), self.tp,
                                     self.mapping, stage_ranks(o.stage, self.tp))
        stats = self._stats(self.global_layer(o.stage, local))
        ws = [prepare(ckpt.load(s), o.row, torch.float32, s) for s in group.sources]
        fc = o.row.shard is Shard.EXPERT_FC
        count = len(ws) // 2 if fc else len(ws)
        # per expert its tensors: fc (w3_e, w1_e), sources being every w3 then every w1 (layout.build_groups)
        mine = [(ws[e], ws[count + e]) if fc else (ws[e],) for e in range(count)]
        if self.format.quantizer == "awq":
            return self._write_awq_experts(o, prefix, stats, mine, fc)
        if self.format.quantizer != "fp8":  # as _expert_planned: no silent FP8 for another row
            raise ValueError(f"{o.name}: expert stacks are written quantized in fp8 or awq only, not {self.fmt}")
        scales = [fp8_q.fp8_scale(torch.stack([t.abs().max() for t in ts]).max()) for ts in mine]
        # float32 copies of the e4m3 values split exactly; each rank's piece is cast back below
        q = [[fp8_q.to_fp8(t, scales[e]).float() for t in ts] for e, ts in enumerate(mine)]
        act = fp8_q.fp8_scale(stats.inputs["mlp"].amax.max() if fc else max(stats.expert_proj_amax))
        moe_tp, moe_ep = self.mapping.moe_tp, self.mapping.moe_ep
        if fc:  # a rank's fc is [w3_e; w1_e] of each of its experts, both cut along the expert width
            w3 = sharding.split_experts([ts[0] for ts in q], self.tp, moe_tp, moe_ep, dim=0)
            w1 = sharding.split_experts([ts[1] for ts in q], self.tp, moe_tp, moe_ep, dim=0)
            pieces = [torch.stack([torch.cat([a, b]) for a, b in zip(r3, r1, strict=True)])
                      for r3, r1 in zip(w3, w1, strict=True)]
        else:
            pieces = [torch.stack(r) for r in sharding.split_experts([ts[0] for ts in q], self.tp, moe_tp, moe_ep,
                                                                    dim=1)]
        out: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for tp_rank, (rank, piece) in enumerate(zip(stage_ranks(o.stage, self.tp), pieces, strict=True)):
            held = moe.rank_experts(count, moe_ep, tp_rank)
            out[rank] = [(f"{prefix}.weight", piece.to(fp8_q.FP8_DTYPE).contiguous()),
                         (f"{prefix}.weights_scaling_factor", torch.stack([scales[e] for e in held]).contiguous()),
                         (f"{prefix}.activation_scaling_factor", act.clone())]
        return out

    def _write_awq_experts(self, o, prefix: str, stats, mine: Sequence[tuple[torch.Tensor, ...]],
                           fc: bool) -> dict[int, list[tuple[str, torch.Tensor]]]:
        """An expert stack in per-group int4 (the layout above): fc's experts share the MoE block's input, proj's
        each its own (every expert calibrated on every token: quant/calibration.py _expert_amax)."""
        if fc:
            shared = stats.inputs["mlp"]
            inputs = [(shared.absmean, shared.cov)] * len(mine)
        else:
            inputs = [(st.absmean, st.cov) for st in stats.expert_proj]
        r = self.quantization
        lins, _ = awq_q.quantize_awq_experts([list(ts) for ts in mine], inputs, self.group_size, search=r.search,
                                             clip=r.search, rounding=r.rounding if r.search else "nearest")
        moe_tp, moe_ep = self.mapping.moe_tp, self.mapping.moe_ep
        prequant = lins[0][0].prequant_scaling_factor
        if fc:  # a rank's fc is [w3_e; w1_e] of each of its experts, weight rows and scale rows cut alike
            def rows(get):
                w3 = sharding.split_experts([get(ls[0]) for ls in lins], self.tp, moe_tp, moe_ep, dim=0)
                w1 = sharding.split_experts([get(ls[1]) for ls in lins], self.tp, moe_tp, moe_ep, dim=0)
                return [[torch.cat([a, b]) for a, b in zip(r3, r1, strict=True)] for r3, r1 in zip(w3, w1, strict=True)]
            weights, scales = rows(lambda lin: lin.weight), rows(lambda lin: lin.weights_scaling_factor)
            pre = [[prequant] * len(w) for w in weights]
        else:  # proj's input (its columns, its groups, its prequant entries) is what moe_tp cuts
            weights = sharding.split_experts([ls[0].weight for ls in lins], self.tp, moe_tp, moe_ep, dim=1)
            scales = sharding.split_experts([ls[0].weights_scaling_factor for ls in lins], self.tp, moe_tp, moe_ep,
                                            dim=1)
            pre = sharding.split_experts([prequant] * len(lins), self.tp, moe_tp, moe_ep, dim=0)
        out: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for rank, w, sc, pq in zip(stage_ranks(o.stage, self.tp), weights, scales, pre, strict=True):
            out[rank] = [(f"{prefix}.weight", torch.stack([pack_int4(t.contiguous()) for t in w])),
                         (f"{prefix}.weights_scaling_factor", torch.stack(sc).to(F32).contiguous()),
                         (f"{prefix}.prequant_scaling_factor", torch.stack(pq).to(self.dtype).contiguous())]
        return out

    def merge_mlp(self, groups: list[Group]) -> list[Group]:
        """fc (HF gate_proj) and gate (HF up_proj) share one input, so their shared
        parameters (AWQ scales, SmoothQuant smoothing and activation scale, FP8
        scales) need both weights: read them as one group, sources in output order."""
        if self.fmt is None or self.quantization.imported:  # imports keep each linear's own tensors
            return groups
        out: list[Group] = []
        for g in groups:
            prev = out[-1] if out else None
            lin, plin = linear_of(g.outputs[0].name), prev and linear_of(prev.outputs[0].name)
            if (prev is not None and lin and plin and len(g.outputs) == len(prev.outputs) == 1
                    and plin[1] == "mlp.fc" and lin[1] == "mlp.gate" and plin[2] == lin[2]
                    and prev.outputs[0].stage == g.outputs[0].stage and self.handles(prev) and self.handles(g)):
                out[-1] = Group(sources=prev.sources + g.sources, outputs=prev.outputs + g.outputs)
            else:
                out.append(g)
        return out

    def _check_stacked(self, o) -> None:
        if stacked_fp8.is_stacked(o.row) and not (self.quantization.modelopt and self.format.quantizer == "fp8"):
            raise ToolchainError(f"{o.name}: Llama 4's stacked experts are quantized by the LLM-API path's FP8 "
                                 "export only", "use target llmapi (or llmapi-cpu) with quantization.method fp8")

    def plan_group(self, group: Group, fp_shapes: dict[tuple[int, str], tuple[int, ...]]) -> dict[int, list]:
        """rank -> [(name, shape, dtype)] for a quantized group, from its outputs' fp per-rank shapes."""
        self._check_stacked(group.outputs[0])
        out: dict[int, list] = {}
        plan = self._expert_planned if self.is_experts(group) else self.planned
        for o in group.outputs:
            for rank in stage_ranks(o.stage, self.tp):
                out.setdefault(rank, []).extend(plan(o.name, fp_shapes[(rank, o.name)]))
        return out

    def write_group(self, group: Group, ckpt: HFCheckpoint) -> dict[int, list[tuple[str, torch.Tensor]]]:
        """rank -> [(name, tensor)] for a quantized group: quantize whole, split each component."""
        if self.is_experts(group):
            return self._write_experts(group, ckpt)
        o0 = group.outputs[0]
        _, module, local = _linear(o0.name)
        layer = self.global_layer(o0.stage, local)
        # q/k/v, and a shared expert's up and gate (one fc [up_r; gate_r] a rank), are the sources of one output
        per_output = ([list(group.sources)] if o0.row.shard in (Shard.QKV, Shard.GATED_FC)
                      else [[s] for s in group.sources])
        prefixes = [[s[: -len(".weight")] for s in srcs] for srcs in per_output]
        weights = None
        fused = o0.row.shard in FUSED_SHARDS
        if fused and self.imports:
            raise ToolchainError(f"{o0.name}: a pre-quantized checkpoint with fused projections "
                                 f"({group.sources[0]}) is not imported",
                                 "convert the unquantized model with quantization.method set instead")
        if not self.imports:
            rows = [o0.row] if o0.row.shard in (Shard.QKV, Shard.GATED_FC) else [o.row for o in group.outputs]
            weights = [[prepare(ckpt.load(s), row, torch.float32, s) for s in srcs]
                       for row, srcs in zip(rows, per_output, strict=False)]
            if fused:  # one fused source -> its projections, quantized as q/k/v (or fc/gate) are
                (w,), = weights
                weights = [list(sharding.unfuse_qkv(w, nh=self.nh, nkv=self.nkv)
                                if o0.row.shard is Shard.FUSED_QKV else sharding.gated_halves(w))]
        comps = self.components(module, layer, weights, prefixes, lambda n: ckpt.read(self.raw[n]))
        result: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for o, cs in zip(group.outputs, comps, strict=False):
            prefix, mod, _ = _linear(o.name)
            padded = self.pad(mod, cs)
            weight = next(c for c in padded if c.layout == "weight")
            for comp in padded:
                for rank, piece in zip(stage_ranks(o.stage, self.tp), self.split(comp, o.row.shard, weight),
                                       strict=False):
                    result.setdefault(rank, []).append((f"{prefix}.{comp.suffix}", self.finish(comp, piece)))
        return result


# A row's `quantizer` (quant/formats.py) -> the method computing its tensors from fp weights and calibration
# statistics; "imported" rows are read (Quantizer._imported), "trtllm-build" and "none" rows write fp weights.
COMPUTED = {"awq": Quantizer._awq, "smoothquant": Quantizer._smoothquant, "fp8": Quantizer._fp8,
            "nvfp4": Quantizer._nvfp4}


def _linear(name: str) -> tuple[str, str, int]:
    """linear_of for a name that must be a quantized linear (a group the quantizer handles)."""
    lin = linear_of(name)
    if lin is None:
        raise ValueError(f"{name} is not a linear the quantizer handles")
    return lin
