"""The memory plan of a spec: per rank, what fits, and what would make it fit.

`plan_memory` is a pure function of the spec, the model parameters, the
precision and the device, so the verdict can try variants of the spec (more
tensor parallelism, a smaller format, shorter sequences) by planning them too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from toolchain.archs import get_family
from toolchain.archs.layout import layout_problems
from toolchain.plan import memory as mem
from toolchain.gpus import GIB, GPUS, Gpu
from toolchain.plan.model import DTYPE_BYTES, ModelInfo, kv_dtype, kv_dtype_bytes, weight_dtype
from toolchain.errors import ToolchainError
from toolchain.plan.model import load_model
from toolchain.quant import formats
from toolchain.quant.view import Quantization, quantization_of
from toolchain.plan import lora as lora_plan
from toolchain.plan import mtp
from toolchain.speculative import CHECKPOINT, mode_of, target_draft_layers
from toolchain.targets import LLMAPI, target_of


@dataclass(frozen=True)
class RankPlan:
    rank: int
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]
    """First and last decoder layer (global index) this rank holds; (0, -1) when none."""
    weights_bytes: int
    checkpoint_bytes: int
    """Size of this rank's checkpoint file (weight-only formats are stored unquantized)."""
    kv_bytes_per_token: int
    """KV bytes per token of a full-length sequence on this rank (sliding layers hold only their window:
    memory.window_share)."""
    activation_bytes: int
    """Estimate: activations of the build profile plus the last stage's logits buffers."""
    workspace_bytes: int
    """Estimate: CUDA context, cuBLAS/NCCL workspaces, runtime buffers."""
    draft_bytes: int
    """Weights and activations of a draft model placed on this rank's GPU."""
    cuda_graph_bytes: int
    """Estimate: the LLM-API path's CUDA-graph memory pool (memory.cuda_graph_bytes); 0 on the engine path."""
    device_bytes: int
    free_bytes: int
    """Device memory left after everything above; the KV pool takes its share of it."""
    kv_pool_bytes: int
    kv_tokens_capacity: int
    lora: lora_plan.RankLora | None = None
    """The LoRA adapter caches of this rank (plan/lora.py), out of what the KV pool leaves; None without LoRA."""


@dataclass
class MemoryPlan:
    device: Gpu
    weight_dtype: str
    kv_dtype: str
    quant: Quantization
    ranks: list[RankPlan]
    sequence_tokens: int
    """KV tokens one full-length sequence needs (block-rounded, draft head-room, beams)."""
    max_batch_size: int
    draft_kv_tokens_capacity: int | None = None
    draft_sequence_tokens: int | None = None
    suggestions: list[str] = field(default_factory=list)

    @property
    def kv_tokens_capacity(self) -> int:
        # Every token's KV lives on every stage: the pipeline holds what its tightest rank holds.
        return min(r.kv_tokens_capacity for r in self.ranks)

    @property
    def concurrency(self) -> int:
        return self.kv_tokens_capacity // self.sequence_tokens

    @property
    def weights_fit(self) -> bool:
        return all(r.free_bytes > 0 for r in self.ranks)

    @property
    def fits(self) -> bool:
        draft_ok = self.draft_kv_tokens_capacity is None or self.draft_kv_tokens_capacity >= (self.draft_sequence_tokens or 0)
        return self.weights_fit and self.concurrency >= 1 and draft_ok

    def tightest(self) -> RankPlan:
        return min(self.ranks, key=lambda r: r.free_bytes)

    def verdict(self) -> str:
        r = self.tightest()
        if not self.weights_fit:
            need = r.device_bytes - r.free_bytes
            text = (f"does not fit: rank {r.rank} needs {need / GIB:.1f} GiB before any KV cache, "
                    f"the {self.device.name} has {r.device_bytes / GIB:.1f} GiB")
        elif self.concurrency < 1:
            text = (f"does not fit: the KV cache holds {self.kv_tokens_capacity} tokens per rank, "
                    f"less than one {self.sequence_tokens}-token sequence")
        elif not self.fits:
            text = (f"does not fit: the draft model's KV cache holds {self.draft_kv_tokens_capacity} tokens, "
                    f"less than one {self.draft_sequence_tokens}-token sequence")
        else:
            text = (f"fits: {r.free_bytes / GIB:.1f} GiB left for the KV cache on the tightest rank (rank {r.rank}); "
                    f"{self.concurrency} sequences of {self.sequence_tokens} tokens fit at once "
                    f"(max_batch_size {self.max_batch_size})")
        if self.suggestions:
            text += "; would fit with " + " or ".join(f"--set {s}" for s in self.suggestions)
        return text


@dataclass(frozen=True)
class DraftModel:
    """A draft_target draft model: tp 1, all layers, on the GPU of rank 0."""

    info: ModelInfo


def plan_memory(spec, model: ModelInfo, quant: Quantization, device: Gpu, draft: DraftModel | None = None,
                suggest: bool = True) -> MemoryPlan:
    p = model.params
    par, lim, build = spec.parallelism, spec.limits, spec.build
    tp, pp = par.tp, par.pp
    dt = weight_dtype(spec, p)
    dt_bytes = DTYPE_BYTES[dt]
    kv_name = kv_dtype(spec, p, quant)
    kv_bytes = kv_dtype_bytes(kv_name)
    gpu = device.kind == "gpu"
    device_bytes = device.memory_bytes if gpu else device.memory_bytes // (tp * pp)  # the CPU engine shares RAM
    cap = spec.serving.max_tokens_in_paged_kv_cache
    if cap is None and not gpu:  # the CPU engine's own default
        cap = mem.cpu_default_max_tokens(lim.max_batch_size, lim.max_seq_len)
    fraction = spec.serving.kv_cache_free_gpu_mem_fraction
    spec_mode = spec.speculative.mode
    draft_len = spec.speculative.max_draft_len if spec_mode != "none" else 0
    mtp_layers = target_draft_layers(spec_mode)  # the model's own MTP layers (plan/mtp.py), on the last stage
    if mtp_layers:  # MTPDecodingConfig drafts num_nextn_predict_layers tokens (llmapi/args.py: max_draft_len or 1)
        draft_len = draft_len or 1
    beam = build.max_beam_width
    seq_tokens = mem.sequence_tokens(lim.max_seq_len, draft_len, build.tokens_per_block,
                                     getattr(p, "sliding_window", None)) * beam
    act_width = 2 if gpu else DTYPE_BYTES[dt]
    stages = spec.parallelism.layout.stage_layers(p.num_hidden_layers)
    # With attention DP each rank runs the whole attention and lm_head over its own requests and keeps their KV
    # with every KV head (Layout.attn_tp: 1), so its activations, logits and KV per token are those of tp 1.
    attn_tp = spec.parallelism.layout.attn_tp

    # What the engine holds its float tensors in: the CPU engine widens every one to float32 at load
    # (engine/cpu/weights.py), whatever the checkpoint stores; a GPU engine keeps the checkpoint's dtype.
    compute_dtype = target_of(spec).compute_dtype
    held_dtype = compute_dtype or dt
    draft_bytes = draft_kv = 0
    if draft is not None:
        dp = draft.info.params
        ddt = DTYPE_BYTES[compute_dtype or weight_dtype(spec, dp)]
        draft_bytes = mem.rank_weights(dp, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=ddt).total
        draft_bytes += mem.activation_bytes(dp, tp=1, max_num_tokens=lim.max_num_tokens,
                                            max_input_len=lim.max_input_len, context_fmha=build.context_fmha)
        if spec.speculative.use_draft_logits:  # the draft engine gathers generation logits for the BLS
            draft_bytes += mem.generation_logits_bytes(dp, tp=1, max_batch_size=lim.max_batch_size, beam=1)
        draft_kv = mem.kv_bytes_per_token(dp, tp=1, stage_layer_count=dp.num_hidden_layers, kv_bytes=ddt)

    heads = heads_rank_bytes(spec, p, held_dtype)
    stored_heads = heads if held_dtype == dt else heads_rank_bytes(spec, p, dt)
    graph_batch = 0
    if gpu and target_of(spec).path == LLMAPI:
        graph_batch = mem.cuda_graph_batch(spec.llmapi.options, max_batch_size=lim.max_batch_size,
                                           max_num_tokens=lim.max_num_tokens, draft_len=draft_len)
    lora = lora_plan.resolved(spec) if spec.lora.enabled and lora_plan.family_refusal(p) is None else None
    ranks: list[RankPlan] = []
    for rank in range(tp * pp):
        pp_rank, tp_rank = divmod(rank, tp)
        layers = stages[pp_rank]
        common = dict(tp=tp, pp_rank=pp_rank, pp=pp, quant=quant, dt_bytes=dt_bytes,
                      parallel_embedding=par.parallel_embedding, embedding_sharding_dim=par.embedding_sharding_dim,
                      qkv_bias=model.qkv_bias, dense_bias=model.dense_bias, moe_tp=par.moe_tp, moe_ep=par.moe_ep,
                      attention_dp=par.attention_dp)
        held = {**common, "dt_bytes": DTYPE_BYTES[held_dtype]}
        weights = mem.rank_weights(p, **held).total + heads
        stored = mem.rank_weights(p, stored=True, **common).total + stored_heads
        if not gpu:
            weights += mem.cpu_widened_bytes(p, tp=tp, pp_rank=pp_rank, pp=pp, quant=quant,
                                             attention_dp=par.attention_dp)
        if mtp_layers and pp_rank == pp - 1:
            weights += mtp.weight_bytes(p, mtp_layers, **held)
            stored += mtp.weight_bytes(p, mtp_layers, stored=True, **common)
        act = mem.activation_bytes(p, tp=attn_tp, max_num_tokens=lim.max_num_tokens, max_input_len=lim.max_input_len,
                                   context_fmha=build.context_fmha, act_bytes=act_width)
        if pp_rank == pp - 1:
            act += mem.logits_bytes(p, tp=attn_tp, max_batch_size=lim.max_batch_size, beam=beam,
                                    max_num_tokens=lim.max_num_tokens,
                                    gather_context_logits=build.gather_context_logits)
        workspace = mem.GPU_WORKSPACE_BYTES if gpu else 0
        graphs = mem.cuda_graph_bytes(p, tp=attn_tp, batch=graph_batch, draft_len=draft_len, last_stage=pp_rank == pp - 1)
        on_gpu = draft_bytes if rank == 0 else 0
        free = device_bytes - weights - act - workspace - graphs - on_gpu
        kv_tok = mem.kv_bytes_per_token(p, tp=attn_tp, kv_bytes=kv_bytes,
                                        stage_layer_count=len(layers) + (mtp_layers if pp_rank == pp - 1 else 0))
        if gpu:
            kv_tok = math.ceil(kv_tok * mem.window_share(p, layers, seq_tokens // beam))
        pool = int(fraction * free) if free > 0 else 0
        capacity = mem.kv_pool_tokens(free, fraction, kv_tok, build.tokens_per_block, cap)
        # the KV cache takes its blocks first; the LoRA device cache comes out of what they leave (plan/lora.py)
        caches = None if lora is None else lora_plan.rank_lora(spec, p, lora, layers=layers, tp=tp, gpu=gpu,
                                                               after_kv_bytes=free - capacity * kv_tok)
        ranks.append(RankPlan(rank, tp_rank, pp_rank, (layers.start, layers.stop - 1), weights, stored, kv_tok, act,
                              workspace, on_gpu, graphs, device_bytes, free, pool, capacity, caches))

    plan = MemoryPlan(device, dt, kv_name, quant, ranks, seq_tokens, lim.max_batch_size)
    if draft is not None:
        free0 = max(ranks[0].free_bytes, 0)
        pool = int(spec.speculative.draft_kv_cache_free_gpu_mem_fraction * free0)
        plan.draft_kv_tokens_capacity = pool // draft_kv // build.tokens_per_block * build.tokens_per_block
        plan.draft_sequence_tokens = mem.sequence_tokens(lim.max_seq_len, 0, build.tokens_per_block)
    if suggest and not plan.fits:
        plan.suggestions = suggestions(spec, model, quant, device, draft)
    return plan


def heads_rank_bytes(spec, params, dtype: str) -> int:
    """Medusa heads or EAGLE draft networks on each rank, as convert plans them (kept
    unquantized in the checkpoint dtype); 0 without a readable heads directory, which
    spec.medusa-heads / spec.eagle-draft report."""
    sp = spec.speculative
    if mode_of(sp.mode).adds != CHECKPOINT or sp.heads is None:
        return 0
    try:
        return _HEADS_BYTES[sp.mode](spec, params, dtype)
    except ToolchainError:
        return 0


def _medusa_rank_bytes(spec, params, dtype: str) -> int:
    from toolchain.checkpoint.medusa import plan_heads, read_heads

    return sum(t.nbytes for t in plan_heads(read_heads(spec.speculative.heads), dtype, spec.parallelism.tp, 1)[0])


def _eagle_rank_bytes(spec, params, dtype: str) -> int:
    from toolchain.checkpoint.eagle import eagle_shape, eagle_tree, plan_draft, read_draft
    from toolchain.checkpoint.layout import Options

    opts = Options(tp=spec.parallelism.tp, pp=1, dtype=dtype,
                   use_parallel_embedding=spec.parallelism.parallel_embedding,
                   embedding_sharding_dim=spec.parallelism.embedding_sharding_dim)
    draft = read_draft(spec.speculative.heads, params)
    return sum(t.nbytes for t in plan_draft(draft, eagle_shape(spec, eagle_tree(spec)), opts)[0])


# Each mode with networks in the checkpoint (adds checkpoint): its module's plan of them, on one rank.
_HEADS_BYTES = {"medusa": _medusa_rank_bytes, "eagle": _eagle_rank_bytes}


def _with(spec, section: str, **values):
    return spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})


def _fits(spec, model, quant, device, draft) -> bool:
    return plan_memory(spec, model, quant, device, draft, suggest=False).fits


# The weight formats from most to fewest bytes per weight, and the order plan suggests them in where several fit:
# FP8 first (no calibration search, near-lossless), then int8 weight-only, AWQ int4, NVFP4.
BYTES_ORDER = ["none", "int8_wo", "fp8", "fp8_block", "smoothquant", "int4_wo", "awq", "nvfp4"]
PREFERENCE = ["fp8", "fp8_block", "int8_wo", "awq", "nvfp4"]


def suggestions(spec, model: ModelInfo, quant: Quantization, device: Gpu, draft: DraftModel | None) -> list[str]:
    """The smallest change along each axis that makes the plan fit, as `--set` overrides that the
    spec accepts as printed: tp within the declared parallelism.gpus (else one node's gpu.per_node),
    no other format for a checkpoint stored quantized, another GPU only when gpu.name alone names it."""
    p = model.params
    out: list[str] = []
    tp, pp = spec.parallelism.tp, spec.parallelism.pp
    limit = spec.parallelism.gpus or spec.gpu.per_node
    sm = device.sm or 0
    gpu = device.kind == "gpu"  # the CPU engine's formats are its own business
    # A format this GPU cannot run (quant.device says so, with its fix) makes more of the same GPU no answer.
    runs_here = not (gpu and device.sm is not None and quant.format.refused_on(device.sm))
    for t in (2, 4, 8, 16, 32, 64):
        if runs_here and t > tp and t * pp <= limit and not layout_problems(p, spec.parallelism.layout.with_tp(t)) \
                and _fits(_with(spec, "parallelism", tp=t), model, quant, device, draft):
            out.append(f"parallelism.tp={t}")
            break
    # Fewer bytes per weight than the spec's own method (BYTES_ORDER), tried in order of preference: a format this
    # GPU runs on the spec's path and convert computes (a checkpoint stored quantized keeps its format).
    path = target_of(spec).path
    family = get_family(p.architecture)  # a format the family refuses (gpt-oss: every one yet) is no answer

    def allowed(method: str, kv_cache: str) -> bool:
        return family.quantization_refusal(p, method, kv_cache) is None

    candidates = [] if not gpu or quant.imported else \
        [m for m in PREFERENCE if (row := formats.METHODS[m]).ready_on(path) and row.refused_on(sm) is None
         and path in row.paths and allowed(m, quant.kv_cache)]
    for method in candidates:
        if BYTES_ORDER.index(method) > BYTES_ORDER.index(quant.method) and \
                _fits(spec, model, dataclasses.replace(quant, method=method), device, draft):
            out.append(f"quantization.method={method}")
            break
    if quant.kv_cache == "none" and gpu and not quant.imported:  # a stored checkpoint cannot be calibrated
        kv = "fp8" if sm >= 89 else "int8"
        if allowed(quant.method, kv) and _fits(spec, model, dataclasses.replace(quant, kv_cache=kv), device, draft):
            out.append(f"quantization.kv_cache={kv}")
    lim = spec.limits
    best = None
    low, high = lim.max_input_len + 1, lim.max_seq_len - 1
    while low <= high:  # the longest max_seq_len that fits
        mid = (low + high) // 2
        if _fits(_with(spec, "limits", max_seq_len=mid), model, quant, device, draft):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    if best is not None:
        out.append(f"limits.max_seq_len={best}")
    named = spec.gpu.memory_gib is None and spec.gpu.sm is None
    bigger = [g for g in GPUS if gpu and named and g.memory_gib > device.memory_gib and (g.sm or 0) >= sm
              and not quant.format.refused_on(g.sm or 0)]
    for g in sorted(bigger, key=lambda g: g.memory_gib):
        if _fits(_with(spec, "gpu", name=g.name, memory_gib=None, sm=None), model, quant, g, draft):
            out.append(f"gpu.name='{g.name}'")
            break
    return out


def build_workers(spec, checkpoint_bytes: list[int], host_bytes: int) -> tuple[int, int]:
    """(workers, bytes per worker) for trtllm-build --workers: each worker holds
    one rank's weights plus TensorRT's builder copy, about twice the rank
    checkpoint (build OOMs: TensorRT-LLM issue #1543), so host RAM bounds how many run at once."""
    per_worker = 2 * max(checkpoint_bytes)
    world = len(checkpoint_bytes)
    if spec.build.workers:
        return min(spec.build.workers, world), per_worker
    return max(1, min(world, host_bytes // per_worker)), per_worker


def checkpoint_bytes_per_rank(spec, quant: Quantization | None = None) -> list[int]:
    """Size of each rank's checkpoint file, from config.json alone."""

    model = load_model(spec.model.checkpoint)
    quant = quant or quantization_of(spec.quantization, model.hf_config, hf_quant_config=model.hf_quant_config)
    p, tp, pp = model.params, spec.parallelism.tp, spec.parallelism.pp
    dt_bytes = DTYPE_BYTES[weight_dtype(spec, p)]
    return [mem.rank_weights(p, tp=tp, pp_rank=r // tp, pp=pp, quant=quant, dt_bytes=dt_bytes, stored=True,
                             parallel_embedding=spec.parallelism.parallel_embedding,
                             embedding_sharding_dim=spec.parallelism.embedding_sharding_dim,
                             qkv_bias=model.qkv_bias, dense_bias=model.dense_bias, moe_tp=spec.parallelism.moe_tp,
                             moe_ep=spec.parallelism.moe_ep).total for r in range(tp * pp)]
