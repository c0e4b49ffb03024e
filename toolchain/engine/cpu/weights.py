"""Load every rank's shard of the engine, strictly, the way trtllm-build does.

Each `rank{N}.safetensors` is kept as its own `RankShard` (never merged into
full matrices), so running the model over the shards proves every rank's
slice is right. A missing tensor or a wrong shape is an error that lists what
is wrong; a tensor the model does not use is ignored with a warning (the
build's strict load behaves the same way: TensorRT-LLM
tensorrt_llm/models/modeling_utils.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from toolchain.checkpoint.hf_reader import check_header
from toolchain.engine.cpu.config import ModelDims
from toolchain.engine.cpu import mla, mtp
from toolchain.engine.cpu.clamped_swiglu import clamped_swiglu
from toolchain.engine.cpu.kv_cache import available_memory_bytes
from toolchain.engine.cpu.linear import Linear, blocked_budget
from toolchain.engine.cpu.moe import Experts, expert_slices
from toolchain.engine.cpu.qlinear import make_linear
from toolchain.engine.cpu.qlinear import stored_tensors
from toolchain.errors import ToolchainError
from toolchain.quant import exclude
from toolchain.upstream import facts as upstream_facts

log = logging.getLogger(__name__)

EMBEDDING = "transformer.vocab_embedding.weight"
FINAL_NORM = "transformer.ln_f.weight"
LM_HEAD = "lm_head"
# Qwen2-MoE's shared expert and its gate, per layer (tensorrt_llm/models/qwen/convert.py)
SHARED_FC = "mlp.shared_expert.fc.weight"
SHARED_PROJ = "mlp.shared_expert.proj.weight"
SHARED_GATE = "mlp.shared_expert_gate.weight"
SCORE_BIAS = "mlp.router.e_score_correction_bias"  # DeepSeek-V3's routing correction bias (archs/deepseek_v3.py)


@dataclass
class LayerShard:
    """One decoder layer's slice held by one TP rank."""

    input_norm: torch.Tensor
    qkv: Linear | None   # None under multi-head latent attention, whose projections are `mla`
    dense: Linear        # row-parallel: its bias (full copy) is added once after the partial sums
    post_norm: torch.Tensor
    fc: Linear | None    # HF gate_proj: the activation is applied to it (None: a mixture-of-experts MLP)
    gate: Linear | None  # HF up_proj
    proj: Linear | None  # row-parallel, like dense
    experts: Experts | None = None  # mixture of experts: the router and this rank's experts
    q_norm: torch.Tensor | None = None  # qk_layernorm: RMSNorm weight over each q head (head_size,)
    k_norm: torch.Tensor | None = None
    kv_scale: torch.Tensor | None = None  # INT8/FP8 KV cache: the layer's scale (1,), the same on every rank
    pre_ff_norm: torch.Tensor | None = None   # inter_layernorms (Gemma 2): before the MLP
    post_ff_norm: torch.Tensor | None = None  # inter_layernorms: on the MLP output
    mla: mla.MlaShard | None = None  # DeepSeek-V3's latent projections (engine/cpu/mla.py)
    sinks: torch.Tensor | None = None  # attention_sinks (gpt-oss): this rank's q heads' sink logits, float32
    mtp: mtp.MtpShard | None = None  # a multi-token-prediction layer's own norms and eh_proj (engine/cpu/mtp.py)


@dataclass
class RankShard:
    rank: int
    tp_rank: int
    pp_rank: int
    layers: list[LayerShard]
    embedding: torch.Tensor | None = None   # first stage only
    final_norm: torch.Tensor | None = None  # last stage only
    lm_head: Linear | None = None           # last stage only: rows [Vp/T), padded vocab slice
    medusa: list[tuple[list[Linear], Linear]] | None = None
    """MedusaForCausalLM, last stage: per head its residual layers (column slices) and lm_head slice."""

    def part(self, name: str) -> Any:
        """A piece only some stages hold (embedding, final_norm, lm_head, medusa); an error elsewhere."""
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"rank {self.rank} (pipeline stage {self.pp_rank}) holds no {name}")
        return value


def _layer(i: int) -> str:
    return f"transformer.layers.{i}"


def held_layers(d: ModelDims, pp_rank: int) -> list[int]:
    """Global indices of the layers a stage's ranks hold: its share of the main ones, and on the last stage the
    multi-token-prediction layers after them (pp 1 only: config.py), at local indices that continue the count."""
    layers = list(d.stage_layers(pp_rank))
    if pp_rank == d.pp - 1:
        layers += range(d.num_layers, d.cache_layers)
    return layers


def _global(d: ModelDims, pp_rank: int, local: int) -> str:
    """A layer's TensorRT-LLM module prefix with its global index (what exclude_modules globs name)."""
    return _layer(held_layers(d, pp_rank)[local])


def expected_tensors(d: ModelDims, tp_rank: int, pp_rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor rank (tp_rank, pp_rank) must hold: shape and dtype kind ("float", "int8",
    "fp8"), per the stored format of each linear (TensorRT-LLM tensorrt_llm/models/llama/convert.py,
    tensorrt_llm/quantization/layers.py)."""
    H, T, hd = d.hidden_size, d.tp, d.head_size
    qkv_out = (d.heads_per_rank + 2 * d.kv_heads_per_rank) * hd
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    if pp_rank == 0:
        if not d.use_parallel_embedding:
            out[EMBEDDING] = ((d.vocab_size, H), "float")
        elif d.embedding_sharding_dim == 0:
            out[EMBEDDING] = ((d.padded_vocab // T, H), "float")
        else:
            out[EMBEDDING] = ((d.vocab_size, H // T), "float")
    for i, layer in enumerate(held_layers(d, pp_rank)):
        p = _layer(i)
        if layer >= d.num_layers:
            out.update(mtp.tensors(p, H))
        out[f"{p}.input_layernorm.weight"] = ((H,), "float")
        out[f"{p}.post_layernorm.weight"] = ((H,), "float")
        if d.inter_layernorms:
            out[f"{p}.pre_feedforward_layernorm.weight"] = ((H,), "float")
            out[f"{p}.post_feedforward_layernorm.weight"] = ((H,), "float")
        if d.qk_layernorm:  # one norm shared by every head, full on every rank
            out[f"{p}.attention.q_layernorm.weight"] = ((hd,), "float")
            out[f"{p}.attention.k_layernorm.weight"] = ((hd,), "float")
        if d.kv_cache_quant_algo is not None:
            out[f"{p}.attention.kv_cache_scaling_factor"] = ((1,), "float")
        if d.attention_sinks:  # split with the q heads (archs/gpt_oss.py)
            out[f"{p}.attention.sinks"] = ((d.heads_per_rank,), "float")
        moe_layer = d.is_moe_layer(layer)
        if moe_layer:
            out.update(_moe_tensors(d, p, _global(d, pp_rank, i), tp_rank))
        if d.mla is not None:
            out.update(mla.tensors(d.mla, p, H, d.heads_per_rank, _formats(d, _global(d, pp_rank, i))))
        for name, (out_f, in_f), bias in _linears(d, qkv_out, moe_layer):
            fmt = d.linear_format(f"{_global(d, pp_rank, i)}.{name}")
            if fmt == "int4_group" and name.startswith("mlp."):
                # per-group int4 MLP dims are stored padded (WeightOnlyGroupwiseQuantLinear)
                w = d.mlp_width // T
                out_f, in_f = (w * (out_f // (d.intermediate_size // T)), in_f) if name != "mlp.proj" else (out_f, w)
            # Row-parallel biases are full copies: their length is the full output, H.
            out.update(stored_tensors(f"{p}.{name}", out_f, in_f, bias, fmt, group=d.group_size,
                                      zero=d.has_zero_point, prequant=d.pre_quant_scale))
    if pp_rank == d.pp - 1:
        out[FINAL_NORM] = ((H,), "float")
        out[f"{LM_HEAD}.weight"] = ((d.padded_vocab // T, H), "float")
        for h in range(d.medusa_heads):
            for layer in range(d.medusa_layers):
                name = medusa_linear(h, layer)
                out.update(stored_tensors(name, H // T, H, True, d.linear_format(name), group=d.group_size,
                                          zero=d.has_zero_point, prequant=d.pre_quant_scale))
            out[f"{medusa_lm_head(h)}.weight"] = ((d.padded_vocab // T, H), "float")
    return out


def _formats(d: ModelDims, g: str) -> Callable[[str], str | None]:
    """The stored format of each linear of the layer whose global prefix is `g`, by its name after the prefix."""
    return lambda name: d.linear_format(f"{g}.{name}")


def medusa_linear(h: int, layer: int) -> str:
    """Module name of Medusa head h's residual layer (upstream facts: tensorrt_llm/models/medusa/model.py)."""
    return upstream_facts("medusa")["names"]["trt_linear"].format(h=h, l=layer, part="").rstrip(".")


def medusa_lm_head(h: int) -> str:
    return upstream_facts("medusa")["names"]["trt_lm_head"].format(h=h).removesuffix(".weight")


def _moe_tensors(d: ModelDims, p: str, g: str, tp_rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A mixture-of-experts MLP on one rank: the float32 router in full, its experts' stacked fc and
    proj (TensorRT-LLM tensorrt_llm/models/llama/convert.py; MOEWeightWrapper in tensorrt_llm/layers/moe.py),
    each in its stored format: every tensor a linear of that format stores, with the experts' count in front
    (`expert_stack`); the shared expert (Qwen2-MoE) as a dense MLP of the same format, its gate unquantized."""
    experts, width, H = d.num_experts // d.moe_ep, d.expert_size // d.moe_tp, d.hidden_size
    out: dict[str, tuple[tuple[int, ...], str]] = {f"{p}.mlp.router.weight": ((d.num_experts, H), "float")}
    if d.grouped_routing is not None:
        out[f"{p}.{SCORE_BIAS}"] = ((d.num_experts,), "float")
    if d.expert_bias:  # gpt-oss: a biased router and experts (fc bias [E_r, 2 I_r], proj bias [E_r, H])
        out[f"{p}.mlp.router.bias"] = ((d.num_experts,), "float")
    for name, (out_f, in_f) in (("mlp.fc", (2 * width, H)), ("mlp.proj", (H, width))):
        one = stored_tensors(f"{p}.{name}", out_f, in_f, d.expert_bias, d.linear_format(f"{g}.{name}"),
                             group=d.group_size)
        out.update({n: (expert_stack(n, shape, experts), kind) for n, (shape, kind) in one.items()})
    if d.shared_expert_size:  # Qwen2-MoE's shared expert, split over tp, and its gate, whole (archs/qwen_moe.py)
        shared = d.shared_expert_size // d.tp
        for name, (out_f, in_f) in ((SHARED_FC, (2 * shared, H)), (SHARED_PROJ, (H, shared))):
            module = name.removesuffix(".weight")
            out.update(stored_tensors(f"{p}.{module}", out_f, in_f, False, d.linear_format(f"{g}.{module}"),
                                      group=d.group_size))
        if d.shared_expert_gate:  # Llama 4's shared expert has none
            out[f"{p}.{SHARED_GATE}"] = ((1, H), "float")
    return out


def expert_stack(name: str, shape: tuple[int, ...], experts: int) -> tuple[int, ...]:
    """A stacked expert tensor's shape from one expert's: [experts, ...], except the activation scale the
    experts share, one per layer (MOEWeightWrapper, tensorrt_llm/layers/moe.py at c388fec7: FP8's
    weights_scaling_factor is (experts_per_node, 1), activation_scaling_factor (1,), the max of the experts')."""
    return shape if name.endswith(".activation_scaling_factor") else (experts, *shape)


def _linears(d: ModelDims, qkv_out: int, experts: bool):
    """The linears of one layer on one rank; a layer of `experts` has no dense MLP."""
    inter = d.intermediate_size // d.tp
    attention = [("attention.qkv", (qkv_out, d.hidden_size), d.attn_bias),
                 ("attention.dense", (d.hidden_size, d.heads_per_rank * d.head_size), d.dense_bias)]
    if d.mla is not None:  # the latent projections are mla.tensors; o_proj is attention.dense over v_head_dim
        attention = [("attention.dense", (d.hidden_size, d.heads_per_rank * d.mla.v_head_dim), d.dense_bias)]
    if experts:
        return attention
    if d.fused_mlp:  # one swiglu fc [up; gate] (Phi-3)
        return [*attention, ("mlp.fc", (2 * inter, d.hidden_size), d.mlp_bias),
                ("mlp.proj", (d.hidden_size, inter), d.mlp_bias)]
    return [*attention,
            ("mlp.fc", (inter, d.hidden_size), d.mlp_bias),
            ("mlp.gate", (inter, d.hidden_size), d.mlp_bias),
            ("mlp.proj", (d.hidden_size, inter), d.mlp_bias)]


def expected_shapes(d: ModelDims, tp_rank: int, pp_rank: int) -> dict[str, tuple[int, ...]]:
    return {n: shape for n, (shape, _) in expected_tensors(d, tp_rank, pp_rank).items()}


def _tied_lm_head(d: ModelDims, tensors: dict[str, torch.Tensor], tp_rank: int) -> torch.Tensor | None:
    """The lm_head slice derived from this rank's embedding, when the tied exemption applies
    (TensorRT-LLM tensorrt_llm/models/modeling_utils.py)."""
    emb = tensors.get(EMBEDDING)
    if emb is None or not d.tie_word_embeddings:
        return None
    rows = d.padded_vocab // d.tp
    if not d.use_parallel_embedding:
        padded = torch.cat([emb, emb.new_zeros(d.padded_vocab - d.vocab_size, emb.shape[1])])
        return padded[tp_rank * rows:(tp_rank + 1) * rows]
    if d.embedding_sharding_dim == 0:
        return emb  # the vocab-sharded embedding is exactly this rank's lm_head slice
    return None


KINDS = {"float": (torch.float32, torch.float16, torch.bfloat16), "int8": (torch.int8,), "uint8": (torch.uint8,),
         "fp8": (torch.float8_e4m3fn, torch.int8)}  # FP8 weights may be stored as an int8 view (FP8Linear)


def _read_rank(path: Path, wanted: dict[str, tuple[tuple[int, ...], str]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    tensors, extra = {}, []
    # 8 bytes read first: a header length over the safetensors limit or past the end of the file
    # is refused in one line naming the file (safe_open bounds it too, with a message naming neither).
    check_header(path, "rebuild the engine with `--force`")
    try:
        fh = safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors raises its own error type for a bad header
        raise ToolchainError(f"cannot read {path}: {err}", "rebuild the engine with `--force`") from None
    with fh:
        for name in fh.keys():
            if name not in wanted:
                extra.append(name)
                continue
            t = fh.get_tensor(name)
            kind = wanted[name][1]
            if t.dtype not in KINDS[kind]:
                raise ToolchainError(f"{path.name}: tensor {name} has dtype {t.dtype}, its format stores {kind}",
                                     "the checkpoint does not match its config.json quantization; reconvert")
            if kind == "float":
                t = t.to(torch.float32)  # compute in fp32 whatever the stored dtype
            elif kind == "fp8" and t.dtype == torch.int8:
                t = t.view(torch.float8_e4m3fn)
            tensors[name] = t.contiguous()
    return tensors, extra


def load_rank(engine_dir: Path, d: ModelDims, rank: int, kv_reserve: int = 0) -> RankShard:
    """One rank's shard. Its float32 weights get their oneDNN-blocked copies (linear.blocked) from the memory
    available once the rank's tensors are read, less `kv_reserve` (kv_cache.pool_reserve_bytes): the copies only
    speed the matmuls up, so they never take what the KV pool needs or more than the host has."""
    pp_rank, tp_rank = divmod(rank, d.tp)
    path = Path(engine_dir) / f"rank{rank}.safetensors"
    if not path.is_file():
        raise ToolchainError(f"engine rank file missing: {path} (world_size {d.world_size})",
                             "rebuild the engine with `toolchain build-engine --force`")
    wanted_kinds = expected_tensors(d, tp_rank, pp_rank)
    wanted = {n: shape for n, (shape, _) in wanted_kinds.items()}
    tensors, extra = _read_rank(path, wanted_kinds)
    check_kept_unquantized(d, path, set(tensors) | set(extra), pp_rank)
    head = f"{LM_HEAD}.weight"
    if head in wanted and head not in tensors:
        tied = _tied_lm_head(d, tensors, tp_rank)
        if tied is not None:
            tensors[head] = tied
    missing = [n for n in wanted if n not in tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ToolchainError(f"{path.name} lacks {len(missing)} required tensor(s): {shown}",
                             "the checkpoint does not match its config.json; reconvert and rebuild with --force")
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {shape})" for n, shape in wanted.items()
             if tuple(tensors[n].shape) != shape]
    if wrong:
        raise ToolchainError(f"{path.name}: shape mismatch: " + "; ".join(wrong[:5]),
                             "the checkpoint does not match its config.json (tp/pp, heads, vocab)")
    if extra:
        log.warning("%s: ignoring %d unused tensor(s): %s", path.name, len(extra), ", ".join(sorted(extra)[:5]))
    with blocked_budget(available_memory_bytes() - kv_reserve) as budget:
        shard = _assemble(d, tensors, rank, tp_rank, pp_rank)
    if budget.refused:
        log.warning("%s: %d weight(s) (%.1f GiB) keep the plain matmul at every batch size: their oneDNN copies "
                    "would not fit beside the KV pool", path.name, budget.refused, budget.refused_bytes / 2 ** 30)
    return shard


def check_kept_unquantized(d: ModelDims, path: Path, present: set[str], pp_rank: int) -> None:
    """The MoE router and Qwen2-MoE's shared_expert_gate run unquantized here, as TensorRT-LLM's default exclude
    list keeps them; whether this checkpoint keeps them is read from its own list the way upstream reads it
    (quant/exclude.py). Where quantize_layers would quantize one, trtllm-build declares a quantized row linear
    whose tensors PretrainedModel.load requires (tensorrt_llm/models/modeling_utils.py at 0c8de69a): a missing one
    (for W8A16/W4A16 a per_channel_scale the build's weight_only_quantize_dict never adds to a router) fails here
    in upstream's own words; one the checkpoint does hold is a quantized router or gate, which this engine does not
    run, nor a float module whose weight the build would quantize (the gate's under a list without
    '*shared_expert_gate.weight')."""
    if not d.is_moe or d.format is None:
        return
    missing: list[str] = []
    quantized: list[str] = []
    for i in range(len(d.stage_layers(pp_rank))):
        p, g = _layer(i), _global(d, pp_rank, i)
        for suffix in exclude.moe_modules(d.shared_expert_size > 0):
            local, fmt = f"{p}.{suffix}", d.linear_format(f"{g}.{suffix}")
            built = d.build_quantizes(f"{local}.weight")  # weight-only: the build adds its per_channel_scale
            if fmt is None:
                if built:
                    quantized.append(f"{local}.weight")
                continue
            need = set(stored_tensors(local, 1, d.hidden_size, False, fmt, group=d.group_size,
                                      zero=d.has_zero_point, prequant=d.pre_quant_scale))
            have = set(present)
            if d.format.weight_only:
                need.add(local + exclude.BUILD_SCALE)
                if built:
                    have.add(local + exclude.BUILD_SCALE)
            lack = sorted(need - have)
            if lack:
                missing += lack
            else:
                quantized.append(local)
    fix = ("name '*router' (and for a shared expert '*shared_expert_gate' and '*shared_expert_gate.weight') in "
           "quantization.exclude_modules, as `toolchain convert --force` writes it, or omit the list")
    if missing:
        shown = ", ".join(repr(n) for n in missing[:6]) + (f", ... ({len(missing)} in all)" if len(missing) > 6 else "")
        raise ToolchainError(f"{path.name}: Required but not provided tensors:{{{shown}}} (quantization.exclude_modules "
                             f"{list(d.exclude_modules)} leaves the MoE router or shared_expert_gate to quant_algo "
                             f"{d.quant_algo})", fix)
    if quantized:
        raise ToolchainError(f"{path.name}: quant_algo {d.quant_algo} with exclude_modules {list(d.exclude_modules)} "
                             f"quantizes {quantized[0]}" + (f" and {len(quantized) - 1} more" if len(quantized) > 1
                                                             else "")
                             + "; the CPU engine runs the MoE router and shared_expert_gate unquantized only", fix)


def _assemble(d: ModelDims, t: dict[str, torch.Tensor], rank: int, tp_rank: int, pp_rank: int) -> RankShard:
    layers = []
    for i, layer in enumerate(held_layers(d, pp_rank)):
        p, g = _layer(i), _global(d, pp_rank, i)

        def linear(name: str, bias: bool, p=p, g=g) -> Linear:
            return make_linear(t, f"{p}.{name}", bias, d.linear_format(f"{g}.{name}"), group=d.group_size)

        dense_mlp = not d.is_moe_layer(layer)
        layers.append(LayerShard(
            input_norm=t[f"{p}.input_layernorm.weight"],
            qkv=linear("attention.qkv", d.attn_bias) if d.mla is None else None,
            dense=linear("attention.dense", d.dense_bias),
            post_norm=t[f"{p}.post_layernorm.weight"],
            fc=linear("mlp.fc", d.mlp_bias) if dense_mlp else None,
            gate=linear("mlp.gate", d.mlp_bias) if dense_mlp and not d.fused_mlp else None,
            proj=linear("mlp.proj", d.mlp_bias) if dense_mlp else None,
            experts=None if dense_mlp else _experts(d, t, p, g, tp_rank),
            q_norm=t.get(f"{p}.attention.q_layernorm.weight") if d.qk_layernorm else None,
            k_norm=t.get(f"{p}.attention.k_layernorm.weight") if d.qk_layernorm else None,
            kv_scale=t.get(f"{p}.attention.kv_cache_scaling_factor"),
            pre_ff_norm=t.get(f"{p}.pre_feedforward_layernorm.weight"),
            post_ff_norm=t.get(f"{p}.post_feedforward_layernorm.weight"),
            mla=mla.load(t, p, _formats(d, g)) if d.mla is not None else None,
            sinks=t.get(f"{p}.attention.sinks"),
            mtp=mtp.load(t, p) if layer >= d.num_layers else None,
        ))
    shard = RankShard(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, layers=layers)
    shard.embedding = t.get(EMBEDDING)
    if pp_rank == d.pp - 1:
        shard.final_norm = t[FINAL_NORM]
        # lm_head stays unquantized in every format the engine reads (config checks exclude_modules).
        shard.lm_head = make_linear(t, LM_HEAD, False, None)
        if d.medusa_heads:
            shard.medusa = [([make_linear(t, medusa_linear(h, layer), True, d.linear_format(medusa_linear(h, layer)),
                                          group=d.group_size) for layer in range(d.medusa_layers)],
                             make_linear(t, medusa_lm_head(h), False, None)) for h in range(d.medusa_heads)]
    return shard


def _experts(d: ModelDims, t: dict[str, torch.Tensor], p: str, g: str, tp_rank: int) -> Experts:
    """One layer's router and this rank's experts, each expert a linear of its stored format."""
    count = d.num_experts // d.moe_ep

    def stack(name: str) -> list[Linear]:
        fmt = d.linear_format(f"{g}.{name}")
        return [make_linear(one, f"{p}.{name}", d.expert_bias, fmt, group=d.group_size)
                for one in expert_slices(t, f"{p}.{name}", count)]

    def shared(name: str) -> Linear | None:
        module = name.removesuffix(".weight")
        if f"{p}.{name}" not in t:
            return None
        return make_linear(t, f"{p}.{module}", False, d.linear_format(f"{g}.{module}"), group=d.group_size)

    return Experts(router=t[f"{p}.mlp.router.weight"], fc=stack("mlp.fc"), proj=stack("mlp.proj"),
                   first=moe_first_expert(d, tp_rank), top_k=d.top_k, normalization=d.moe_normalization,
                   router_kind=d.moe_router,
                   shared_fc=shared(SHARED_FC), shared_proj=shared(SHARED_PROJ), shared_gate=t.get(f"{p}.{SHARED_GATE}"),
                   grouped=d.grouped_routing, score_bias=t.get(f"{p}.{SCORE_BIAS}"),
                   router_bias=t.get(f"{p}.mlp.router.bias"),
                   activation=clamped_swiglu(d.swiglu_alpha, d.swiglu_limit) if d.swiglu_limit is not None else None,
                   # every moe_tp slice of an expert holds the whole proj bias; one of them adds it
                   proj_bias=tp_rank // d.moe_ep == 0)


def moe_first_expert(d: ModelDims, tp_rank: int) -> int:
    """The global index of the first expert a TP rank holds (Mapping.ep_experts, moe_ep_rank = tp_rank % moe_ep)."""
    return (tp_rank % d.moe_ep) * (d.num_experts // d.moe_ep)


def load_stages(engine_dir: Path, d: ModelDims, kv_reserve: int = 0) -> list[list[RankShard]]:
    """All ranks, grouped by pipeline stage, TP ranks in order within a stage (`kv_reserve`: see load_rank)."""
    stages = [[load_rank(engine_dir, d, pp * d.tp + tp, kv_reserve) for tp in range(d.tp)] for pp in range(d.pp)]
    check_replicas(stages, d)
    return stages


def load_own_stage(engine_dir: Path, d: ModelDims, rank: int, kv_reserve: int = 0) -> list[list[RankShard]]:
    """One rank process's view (ranks.py): its own shard in its stage, every other stage empty."""
    stages: list[list[RankShard]] = [[] for _ in range(d.pp)]
    stages[rank // d.tp] = [load_rank(engine_dir, d, rank, kv_reserve)]
    return stages


def _proj_bias(layer: LayerShard) -> torch.Tensor | None:
    return layer.proj.bias if layer.proj is not None else None


def _router(layer: LayerShard) -> torch.Tensor | None:
    return layer.experts.router if layer.experts is not None else None


def _router_bias(layer: LayerShard) -> torch.Tensor | None:
    return layer.experts.router_bias if layer.experts is not None else None


def _shared_gate(layer: LayerShard) -> torch.Tensor | None:
    return layer.experts.shared_gate if layer.experts is not None else None


def _score_bias(layer: LayerShard) -> torch.Tensor | None:
    return layer.experts.score_bias if layer.experts is not None else None


def check_replicas(stages: list[list[RankShard]], d: ModelDims) -> None:
    """Tensors every TP rank holds in full must be identical across the ranks of a stage.

    The forward pass keeps one hidden state per stage (as the all-reduce would
    make it), so it applies each replicated tensor once; comparing the copies
    here is what proves ranks other than the first hold the right ones.
    """
    for shards in stages:
        first = shards[0]
        for other in shards[1:]:
            pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = [
                (FINAL_NORM, first.final_norm, other.final_norm)]
            if not d.use_parallel_embedding:  # sharded embeddings differ by design
                pairs.append((EMBEDDING, first.embedding, other.embedding))
            for i, (la, lb) in enumerate(zip(first.layers, other.layers, strict=False)):
                p = _layer(i)
                pairs += [(f"{p}.input_layernorm.weight", la.input_norm, lb.input_norm),
                          (f"{p}.post_layernorm.weight", la.post_norm, lb.post_norm),
                          (f"{p}.pre_feedforward_layernorm.weight", la.pre_ff_norm, lb.pre_ff_norm),
                          (f"{p}.post_feedforward_layernorm.weight", la.post_ff_norm, lb.post_ff_norm),
                          (f"{p}.attention.q_layernorm.weight", la.q_norm, lb.q_norm),
                          (f"{p}.attention.k_layernorm.weight", la.k_norm, lb.k_norm),
                          (f"{p}.attention.kv_cache_scaling_factor", la.kv_scale, lb.kv_scale),
                          (f"{p}.attention.dense.bias", la.dense.bias, lb.dense.bias),
                          (f"{p}.mlp.proj.bias", _proj_bias(la), _proj_bias(lb)),
                          (f"{p}.mlp.router.weight", _router(la), _router(lb)),
                          (f"{p}.mlp.router.bias", _router_bias(la), _router_bias(lb)),
                          (f"{p}.{SHARED_GATE}", _shared_gate(la), _shared_gate(lb)),
                          (f"{p}.{SCORE_BIAS}", _score_bias(la), _score_bias(lb)),
                          *mla.replicas(p, la.mla, lb.mla), *mtp.replicas(p, la.mtp, lb.mtp)]
            for name, a, b in pairs:
                if a is not None and b is not None and not torch.equal(a, b):
                    raise ToolchainError(
                        f"rank{other.rank}.safetensors: replicated tensor {name} differs from "
                        f"rank{first.rank}'s copy",
                        "every TP rank must hold the same norms and row-parallel biases; reconvert with --force")
