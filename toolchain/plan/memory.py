"""Memory per rank: weights by format, KV cache per token, activations (estimate).

Formulas after TensorRT-LLM docs/source/legacy/reference/memory.md, with the
tensor shapes of tensorrt_llm/models/llama/convert.py and the sharding rules of
tensorrt_llm/models/convert_utils.py and tensorrt_llm/mapping.py. Everything is
per rank: TP splits the linear layers (except that each rank holds at least
one whole KV head), PP gives a rank its stage's layers, the first stage the
embedding and the last the lm_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolchain.archs import get_family, supported
from toolchain.archs.layout import Layout
from toolchain.archs.params import ArchParams
from toolchain.plan import mla
from toolchain.quant import formats
from toolchain.quant.recipe import per_group_multiple
from toolchain.quant.view import Quantization

GIB = 1024**3
# CUDA context, cuBLAS/NCCL workspaces and runtime buffers per GPU: a few hundred
# MB to 1 GB by rule of thumb (TensorRT-LLM's memory.md gives no figure); plan the high end.
GPU_WORKSPACE_BYTES = 1 * GIB
ACTIVATION_BYTES = 2  # fp16/bf16 activations on GPU


def kv_heads_per_rank(p: ArchParams, tp: int) -> int:
    # With tp > nkv every rank holds one whole (duplicated) KV head (convert_utils.py, dup_kv_weight).
    return max(1, p.num_key_value_heads // tp)


def padded_vocab(p: ArchParams, tp: int) -> int:
    return math.ceil(p.vocab_size / tp) * tp


def mlp_width(p: ArchParams, tp: int, quant: Quantization | None = None) -> int:
    """The intermediate size the checkpoint holds: per-group int4 pads it with zero channels to a
    multiple of max(64, g) x tp, as trtllm-build's WeightOnlyGroupwiseQuantLinear/RowLinear pad
    their in/out features (TensorRT-LLM tensorrt_llm/quantization/layers.py at 2340c776) and convert does."""
    if quant is None or not quant.per_group:
        return p.intermediate_size
    m = per_group_multiple(quant.weight_group_size, tp)
    return -(-p.intermediate_size // m) * m


def linear_shapes(p: ArchParams, tp: int, quant: Quantization | None = None) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's linears on one rank."""
    hd, h = p.head_size, p.hidden_size
    q_r = p.num_attention_heads // tp * hd
    kv_r = kv_heads_per_rank(p, tp) * hd
    i_r = mlp_width(p, tp, quant) // tp
    mlp = [("fc", i_r, h), ("gate", i_r, h), ("proj", h, i_r)]
    if p.mla is not None:  # multi-head latent attention (DeepSeek-V3): its five projections (plan/mla.py)
        return mla.linear_shapes(p, tp) + mlp
    return [("qkv", q_r + 2 * kv_r, h), ("dense", h, q_r), *mlp]


MLP_LINEARS = ("fc", "gate", "proj")  # linear_shapes' dense MLP, which a mixture-of-experts layer replaces


# The MoE router is float32 in every format (tensorrt_llm/models/llama/convert.py), and the shared expert gate in
# the model dtype: convert's exclude_modules keep both unquantized (quant/exclude.py moe_exclusions), and the CPU
# engine refuses a list that would not (engine/cpu/weights.py check_kept_unquantized).
ROUTER_BYTES = 4


def expert_bytes(p: ArchParams, moe_tp: int, moe_ep: int, dt_bytes: int, quant: Quantization | None = None,
                 stored: bool = False, shared_tp: int | None = None) -> float:
    """One mixture-of-experts MLP on one rank, as convert lays it out (toolchain/archs/mixtral.py,
    qwen_moe.py): the router [E, H] whole on every rank, float32 in every format, and E/moe_ep experts each
    holding fc [2 I/moe_tp, H] and proj [H, I/moe_tp]; a shared expert (Qwen2-MoE) adds its tp slice, fc
    [2 S/tp, H] and proj [H, S/tp], and its gate [1, H] whole (tp = moe_tp x moe_ep). Each expert and the
    shared expert count as a linear of `quant`'s format (`stored`: as the checkpoint holds them, where
    weight-only experts are still float; else as the engine does: int8/int4 with a per-channel scale per
    expert, TensorRT-LLM tensorrt_llm/models/convert_utils.py weight_only_quantize on a batched matrix; AWQ
    packed int4 with per-group scales per expert, FP8 e4m3 with a scale per expert)."""
    experts, width, h = p.num_experts // moe_ep, p.expert_size // moe_tp, p.hidden_size
    # A stored format may hold some kinds only (MXFP4: the routed experts); the rest stay in the model dtype.
    shared_quant = quant.on("shared_expert") if quant is not None else None
    quant = quant.on("experts") if quant is not None else None

    def linear(out: int, inp: int, q: Quantization | None) -> float:
        return out * inp * dt_bytes if q is None else linear_bytes(out, inp, q, dt_bytes, stored)

    routed = experts * (linear(2 * width, h, quant) + linear(h, width, quant))
    if quant is not None:
        # What a stack holds once, not per expert: FP8's activation scale (MOEWeightWrapper, layers/moe.py at
        # c388fec7: (1,)); and in the engine AWQ's prequant vector, which the checkpoint stores per expert
        # ([experts, in]) and trtllm-build keeps row 0 of as the wrapper's (1, in) (preprocess_perlayer_weights,
        # tensorrt_llm/models/modeling_utils.py).
        row = quant.format.stored if stored else quant.format.built
        once = ("activation_scaling_factor",) if stored else ("activation_scaling_factor", "prequant_scaling_factor")
        held_once = tuple(t for t in row if t.suffix in once)
        g = quant.weight_group_size
        routed -= (experts - 1) * (formats.tensor_bytes(held_once, 2 * width, h, g, dt_bytes)
                                   + formats.tensor_bytes(held_once, h, width, g, dt_bytes))
    shared_r = p.shared_expert_size // (shared_tp or moe_tp * moe_ep)
    gate = h * dt_bytes if p.shared_expert_gated else 0  # DeepSeek-V3's and Llama 4's shared experts have none
    shared = linear(2 * shared_r, h, shared_quant) + linear(h, shared_r, shared_quant) + gate if p.shared_expert_size else 0
    return p.num_experts * h * ROUTER_BYTES + routed + shared


def sink_and_expert_bias_bytes(p: ArchParams, tp: int, moe_tp: int, moe_ep: int, dt_bytes: int) -> int:
    """What a gpt-oss layer holds beyond its linears (archs/gpt_oss.py, the family's decoder traits): its sinks,
    float32, one per q head of the rank; the router's float32 bias [E]; and each of the rank's experts' fc bias
    [2 I/moe_tp] and proj bias [H] (whole on every moe_tp slice). 0 for every other family."""
    if p.architecture not in supported():
        return 0
    decoder = get_family(p.architecture).decoder
    total = p.num_attention_heads // tp * 4 if decoder.attention_sinks else 0
    if decoder.expert_bias and p.is_moe:
        total += p.num_experts * ROUTER_BYTES
        total += p.num_experts // moe_ep * (2 * (p.expert_size // moe_tp) + p.hidden_size) * dt_bytes
    return total


def linear_bytes(out: int, inp: int, quant: Quantization, dt_bytes: int, stored: bool = False) -> float:
    """Bytes of one linear weight and its scales (memory.md), summed over the tensors its format's row
    lists (quant/formats.py): `stored` as written in the checkpoint, where weight-only formats are
    still in the model dtype (trtllm-build quantizes them: preprocess_weights in
    tensorrt_llm/models/modeling_utils.py), else as the engine holds them."""
    row = quant.format
    return formats.tensor_bytes(row.stored if stored else row.built, out, inp, quant.weight_group_size, dt_bytes)


@dataclass(frozen=True)
class WeightBreakdown:
    layers: float
    embedding: float
    lm_head: float
    norms: float

    @property
    def total(self) -> int:
        return int(self.layers + self.embedding + self.lm_head + self.norms)


def rank_weights(p: ArchParams, *, tp: int, pp_rank: int, pp: int, quant: Quantization, dt_bytes: int,
                 parallel_embedding: bool = False, embedding_sharding_dim: int = 0, qkv_bias: bool = False,
                 dense_bias: bool = False, stored: bool = False, moe_tp: int | None = None,
                 moe_ep: int | None = None, attention_dp: bool = False) -> WeightBreakdown:
    """Weight bytes of one rank (its TP slice of its PP stage). A mixture-of-experts model holds its
    experts as `moe_tp`/`moe_ep` (None: as TensorRT-LLM's Mapping derives them) place them. With
    `attention_dp` (the LLM-API path) each rank holds the whole attention (Layout.attn_tp), the whole shared
    expert and dense MLP (`overridden_tp_size=1 if enable_attention_dp`: _torch/models/modeling_llama.py Llama4MoE,
    modeling_deepseekv3.py's mlp_tp_size 1) and the whole lm_head (LMHead without a mapping unless
    enable_lm_head_tp_in_adp, _torch/models/modeling_utils.py DecoderModelForCausalLM); the experts keep their
    moe_tp x moe_ep split."""
    layout = Layout(tp, pp, moe_tp, moe_ep, attention_dp=attention_dp)
    stage = layout.stage_layers(p.num_hidden_layers)[pp_rank]
    n_layers = len(stage)
    n_moe = sum(1 for layer in stage if p.is_moe_layer(layer))  # all of a MoE model's but DeepSeek's dense first
    h, v = p.hidden_size, p.vocab_size
    attn_tp = layout.attn_tp
    shapes = linear_shapes(p, attn_tp, quant)
    attention, mlp = quant.on("attention"), quant.on("mlp")  # each kind in the format, or in the model dtype
    per_layer = sum(linear_bytes(o, i, attention, dt_bytes, stored) for name, o, i in shapes if name not in MLP_LINEARS)
    per_layer += sink_and_expert_bias_bytes(p, attn_tp, layout.moe_tp, layout.moe_ep, dt_bytes)
    dense_mlp = sum(linear_bytes(o, i, mlp, dt_bytes, stored) for name, o, i in shapes if name in MLP_LINEARS)
    if qkv_bias:
        per_layer += linear_shapes(p, attn_tp)[0][1] * dt_bytes
    if dense_bias:
        per_layer += h * dt_bytes  # row-parallel bias, full on every rank
    if p.mlp_bias:
        dense_mlp += (2 * (p.intermediate_size // attn_tp) + h) * dt_bytes
    layers_bytes = n_layers * per_layer + (n_layers - n_moe) * dense_mlp
    if n_moe:
        layers_bytes += n_moe * expert_bytes(p, layout.moe_tp, layout.moe_ep, dt_bytes, quant, stored,
                                             shared_tp=attn_tp)
    norms = n_layers * p.norms_per_layer * h * dt_bytes
    if p.mla is not None:
        norms += n_layers * mla.norm_values(p) * dt_bytes
        layers_bytes += n_moe * p.num_experts * ROUTER_BYTES  # the routing correction bias, float32 like the router
    if tp > 1 and p.architecture in supported() and get_family(p.architecture).parallel_embedding_at_tp:
        parallel_embedding = True  # the family's TensorRT-LLM config forces it (GemmaConfig, archs/gemma.py)
    first, last = pp_rank == 0, pp_rank == pp - 1
    embedding = 0.0
    if first:
        # Embedding and lm_head stay in the model dtype under every format (QuantConfig's default
        # exclude list, tensorrt_llm/models/modeling_utils.py).
        if not parallel_embedding:
            embedding = v * h * dt_bytes
        elif embedding_sharding_dim == 0:
            embedding = padded_vocab(p, tp) // tp * h * dt_bytes
        else:
            embedding = v * (h // tp) * dt_bytes
    lm_head = 0.0
    if last:
        norms += h * dt_bytes  # ln_f
        lm_head = padded_vocab(p, attn_tp) // attn_tp * h * dt_bytes
        # trtllm-build shares one table when both tensors are identical (TensorRT-LLM
        # docs/source/release-notes.md, 0.16: --use_embedding_sharing removed):
        # tied, on the same rank, same shape.
        if p.tie_word_embeddings and first and not parallel_embedding and padded_vocab(p, attn_tp) // attn_tp == v:
            lm_head = 0.0
    return WeightBreakdown(layers_bytes, embedding, lm_head, norms)


def kv_bytes_per_token(p: ArchParams, *, tp: int, stage_layer_count: int, kv_bytes: int) -> int:
    """2 (K and V) x L_stage x nkv_r x hd x bytes (the paged KV cache layout,
    docs/source/legacy/advanced/gpt-attention.md); with multi-head latent attention one latent per layer,
    whole on every rank (plan/mla.py). Llama 4's chunked-attention layers count in full: how the PyTorch backend's
    KV manager sizes them is not established here (archs/llama4.py)."""
    if p.mla is not None:
        return stage_layer_count * mla.kv_values_per_token(p) * kv_bytes
    return 2 * stage_layer_count * kv_heads_per_rank(p, tp) * p.head_size * kv_bytes


# An unset max_tokens_in_paged_kv_cache on the CPU engine: room for this many full batches of max_seq_len.
# On a GPU the executor allocates its fraction of free memory up front; here the pool's memory is
# committed as blocks are first used, and with block reuse every new prompt takes a never-used block
# before a cached one is evicted, so an uncapped pool (a fraction of all host memory) would grow the
# server's RSS with every distinct prompt until it held most of the host.
CPU_POOL_BATCHES = 2


def cpu_widened_bytes(p: ArchParams, *, tp: int, pp_rank: int, pp: int, quant: Quantization,
                      attention_dp: bool = False) -> int:
    """The float32 copies the CPU engine keeps of one rank's dense linears in a format its kernel widens at load
    (its row's `cpu_widened`), on top of their stored tensors; 0 in every other format."""
    layout = Layout(tp, pp, attention_dp=attention_dp)
    stage = layout.stage_layers(p.num_hidden_layers)[pp_rank]
    dense_mlp = sum(1 for layer in stage if not p.is_moe_layer(layer))
    total = 0
    for name, out, inp in linear_shapes(p, layout.attn_tp, quant):
        kind = quant.on("mlp" if name in MLP_LINEARS else "attention")
        if kind.format.cpu_widened:
            total += (dense_mlp if name in MLP_LINEARS else len(stage)) * out * inp * 4
    return total


def cpu_default_max_tokens(max_batch_size: int, max_seq_len: int) -> int:
    return CPU_POOL_BATCHES * max_batch_size * max_seq_len


def kv_pool_tokens(free_bytes: int, fraction: float, bytes_per_token: int, tokens_per_block: int,
                   max_tokens: int | None = None) -> int:
    """Tokens a KV pool holds: whole blocks in `fraction` of the free memory, capped by
    max_tokens rounded up to a block (TensorRT-LLM calculateMaxNumBlocks in kvCacheManager.cpp:
    the smaller limit wins). The CPU engine sizes its pool with this same function."""
    block_bytes = bytes_per_token * tokens_per_block
    blocks = int(fraction * max(free_bytes, 0)) // block_bytes if block_bytes else 0
    if max_tokens is not None:
        blocks = min(blocks, -(-max_tokens // tokens_per_block))
    return blocks * tokens_per_block


def activation_bytes(p: ArchParams, *, tp: int, max_num_tokens: int, max_input_len: int,
                     context_fmha: bool = True, act_bytes: int = ACTIVATION_BYTES) -> int:
    """Estimate of one rank's activation memory, fixed at build time by the profile
    (memory.md): max_num_tokens packed tokens times the widest tensors of one layer
    (residual, normed input, qkv, attention output, fc and gate outputs). Without
    context FMHA the attention scores of each context sequence come on top."""
    q_r = p.num_attention_heads // tp * p.head_size
    width = 2 * p.hidden_size + linear_shapes(p, tp)[0][1] + q_r + 2 * (p.intermediate_size // tp)
    total = max_num_tokens * width * act_bytes
    if not context_fmha:
        sequences = math.ceil(max_num_tokens / max_input_len)
        total += sequences * (p.num_attention_heads // tp) * max_input_len**2 * act_bytes
    return int(total)


def logits_bytes(p: ArchParams, *, tp: int, max_batch_size: int, beam: int, max_num_tokens: int,
                 gather_context_logits: bool) -> int:
    """fp32 logits buffers of the last stage (an estimate; memory.md gives no formula)."""
    per_row = padded_vocab(p, tp) // tp * 4
    total = max_batch_size * beam * per_row
    if gather_context_logits:
        total += max_num_tokens * per_row
    return total


# Steps of generation logits the executor keeps on the GPU before copying them to the request's
# host buffer (TensorRT-LLM cpp/include/tensorrt_llm/batch_manager/runtimeBuffers.h,
# GenerationLogitsCache::kCACHE_LENGTH).
GENERATION_LOGITS_STEPS = 8


def generation_logits_bytes(p: ArchParams, *, tp: int, max_batch_size: int, beam: int) -> int:
    """fp32 buffers an engine built with --gather_generation_logits adds on its last stage:
    8 x (max_batch_size + 1) x beam x padded vocab x 4 bytes, the step cache [8, batch x beam, V]
    and its transpose [beam, 8, V] (runtimeBuffers.cpp, RuntimeBuffers::create); each request's
    [beam, max_new_tokens, V] copy sits in pinned host memory, not on the GPU."""
    per_row = padded_vocab(p, tp) // tp * 4
    return GENERATION_LOGITS_STEPS * (max_batch_size + 1) * beam * per_row


def window_share(p: ArchParams, layers: range, seq_tokens: int) -> float:
    """The share of a full-length sequence's KV cache that a stage's layers hold when some of them slide
    (per-layer windows, Gemma 2/3): 1 when every layer attends alike. TensorRT-LLM's KV cache manager keeps
    one pool per window size and gives each window a share of the memory in proportion to window x bytes per
    token of its layers (resource_manager.py adjust_window_sizes_for_vswa: a sequence needs "sum of
    window_size x cache_size_bytes_per_token"; the C++ BaseKVCacheManager::calculateMaxNumBlocks splits the
    pool the same way), so a sequence costs sum over layers of min(window, length) tokens of one layer's KV.
    The CPU engine keeps every layer's blocks (docs/cpu-engine.md), so its plan does not call this."""
    windows = p.layer_windows
    if windows is None or not len(layers):
        return 1.0
    return sum(min(windows[i], seq_tokens) for i in layers) / (len(layers) * seq_tokens)


# The LLM-API path (PyTorch backend) captures a CUDA graph per decode batch size, by default every size up to 128
# (tensorrt_llm/llmapi/llm_args.py CudaGraphConfig: max_batch_size 0 means 128; cuda_graph_config null turns
# graphs off), dropping sizes above the executor's max_batch_size and max_num_tokens / (1 + draft tokens)
# (_torch/pyexecutor/model_engine.py _filter_cuda_graph_batch_sizes). Every graph is captured into one memory
# pool (cuda_graph_runner.py: `self.memory_pool = graph.pool()` after each capture), so the pool holds about the
# intermediate tensors of the largest captured step; the KV estimation counts it among the memory "used outside
# torch (e.g., NCCL and CUDA graphs)" (_torch/pyexecutor/_util.py configure_kv_cache_capacity).
CUDA_GRAPH_DEFAULT_MAX_BATCH = 128


def cuda_graph_batch(options: dict, *, max_batch_size: int, max_num_tokens: int, draft_len: int) -> int:
    """The largest decode batch the PyTorch backend captures a CUDA graph for (0: graphs off)."""
    if "cuda_graph_config" in options and options["cuda_graph_config"] is None:
        return 0
    cfg = options.get("cuda_graph_config") or {}
    top = max(cfg.get("batch_sizes") or [0]) or cfg.get("max_batch_size") or CUDA_GRAPH_DEFAULT_MAX_BATCH
    return max(0, min(top, max_batch_size, max_num_tokens // (1 + draft_len)))


def cuda_graph_bytes(p: ArchParams, *, tp: int, batch: int, draft_len: int, last_stage: bool) -> int:
    """Estimate of the CUDA-graph pool: one decode step of `batch` sequences (1 + draft_len tokens each), its
    activations as `activation_bytes` counts them and, on the last stage, its fp32 logits."""
    if batch <= 0:
        return 0
    tokens = batch * (1 + draft_len)
    total = activation_bytes(p, tp=tp, max_num_tokens=tokens, max_input_len=tokens)
    if last_stage:
        total += tokens * padded_vocab(p, tp) // tp * 4
    return total


def sequence_tokens(max_seq_len: int, draft_len: int, tokens_per_block: int, window: int | None = None) -> int:
    """KV tokens one full-length sequence occupies: paged allocation rounds up to
    whole blocks, speculative decoding adds the draft as head-room (tensorrt_llm/builder.py
    adds max_draft_len to max_seq_len), and a
    sliding-window model keeps at most its window."""
    tokens = max_seq_len + draft_len
    if window:
        tokens = min(tokens, window)
    return math.ceil(tokens / tokens_per_block) * tokens_per_block
