"""The engine directory's `config.json`, read and validated into one object.

The file is shaped like trtllm-build's output (`pretrained_config` +
`build_config`), so the CPU engine reads exactly what a GPU engine directory
describes. Everything the forward pass needs is resolved here once, so a bad
directory fails at load with one clear message instead of mid-request.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolchain.archs import checkpoint_architectures, family_for_checkpoint
from toolchain.archs.common import Decoder
from toolchain.archs.moe import EXPERT_METHODS
from toolchain.engine.cpu.mla import MlaDims, parse as parse_mla
from toolchain.engine.cpu.routing import GroupedRouting
from toolchain.engine.cpu.llama4 import Llama4Attention, llama4_dims
from toolchain.errors import ToolchainError
from toolchain.quant import exclude, formats
from toolchain.quant.recipe import GROUP_SIZES, per_group_multiple
from toolchain.upstream import facts

# MedusaForCausalLM (upstream facts medusa.json) is a base decoder plus Medusa heads: MedusaForCausalLm builds QWen's
# decoder when model_type names qwen and LLaMA's otherwise (tensorrt_llm/models/medusa/model.py, rule
# base_from_model_type there).
MEDUSA = facts("medusa")["architecture"]
# What the engine runs: the checkpoint of every registered family (archs/__init__.py, each family's `decoder` saying
# how TensorRT-LLM builds it) and Medusa over one.
ARCHITECTURES = {*checkpoint_architectures(), MEDUSA}
MOE_NORMALIZATIONS = (0, 1)  # ExpertScaleNormalizationMode NONE, RENORMALIZE (SPARSE_MIXER is not run here)
ROPE_TYPES = {None, "none", "linear", "llama3", "yarn"}
UNQUANTIZED = {None, "NO_QUANT"}
# quant_algo values the CPU engine runs as stored (a row with a CPU kernel, engine/cpu/qlinear.py; a pending one is
# refused on its own, PENDING_ALGOS), and KV-cache formats.
QUANT_ALGOS = {f.quant_algo for f in formats.ALL if f.cpu_kernel and f.cpu_kernel_ready and f.quant_algo}
PENDING_ALGOS = {f.quant_algo: f.cpu_kernel for f in formats.ALL if not f.cpu_kernel_ready}
# quant_algo values whose experts the CPU engine runs (engine/cpu/moe.py): the archs/moe.py EXPERT_METHODS' rows.
MOE_QUANT_ALGOS = {a for m in EXPERT_METHODS if (a := formats.METHODS[m].quant_algo) is not None}
# ...and FP8 block-scale experts as a DeepSeek-V3 checkpoint stores them (imported: checkpoint/block_experts.py)
MOE_QUANT_ALGOS.add(str(formats.FP8_BLOCK.quant_algo))
# and the stored formats that hold the experts alone (MXFP4, as gpt-oss is released), as the CPU engine runs them
MOE_QUANT_ALGOS |= {f.quant_algo for f in formats.STORED_ONLY.values() if f.quant_algo and f.cpu_kernel_ready}
KV_ALGOS = tuple(k.quant_algo for k in formats.KV_CACHE.values() if k.quant_algo)
# TensorRT-LLM's exclusion list when config.json gives none (quantize_layers in
# tensorrt_llm/quantization/quantize.py; facts checkpoint_config.json, quant/exclude.py).
DEFAULT_EXCLUDE = exclude.DEFAULT

_REBUILD = "rebuild the engine with `toolchain build-engine --force`"


@dataclass(frozen=True)
class ModelDims:
    """Model shape and options from `pretrained_config`, plus the parallel mapping."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    hidden_act: str
    norm_epsilon: float
    rotary_base: float
    rotary_scaling: dict | None
    attn_bias: bool
    dense_bias: bool
    mlp_bias: bool
    use_parallel_embedding: bool
    embedding_sharding_dim: int
    tie_word_embeddings: bool
    tp: int
    pp: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    qk_layernorm: bool = False
    attention_windows: tuple[int, ...] | None = None
    group_size: int = 128
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: tuple[str, ...] = DEFAULT_EXCLUDE
    """fnmatch globs of unquantized modules; a list in config.json replaces the default (QuantConfig)."""
    exclude_listed: tuple[str, ...] | None = None
    """config.json's exclude_modules as written; None when absent or null (only then do upstream's defaults
    apply: quant/exclude.py)."""
    medusa_heads: int = 0
    """MedusaForCausalLM: number of heads (num_medusa_heads); 0 for any other architecture."""
    medusa_layers: int = 1
    num_experts: int = 0
    """Mixture of experts (config.json `moe`): experts per layer; 0 for a dense MLP."""
    top_k: int = 0
    moe_normalization: int = 1
    moe_tp: int = 1
    """mapping.moe_tp_size: over how many TP ranks each expert's width is split."""
    moe_ep: int = 1
    """mapping.moe_ep_size: over how many TP ranks the experts are divided."""
    expert_size: int = 0
    """Each routed expert's width: moe_intermediate_size for Qwen MoE, else intermediate_size."""
    shared_expert_size: int = 0
    """Qwen2-MoE's shared expert width (moe_shared_expert_intermediate_size), split over all of tp; 0: none."""
    inter_layernorms: bool = False
    """Gemma 2: post_layernorm on the attention output, pre/post_feedforward_layernorm around the MLP,
    the embedding scaled by sqrt(hidden_size) (GemmaDecoderLayer, GemmaModel)."""
    query_pre_attn_scalar: float | None = None
    """Gemma 2: attention scores scaled by 1/sqrt(this) instead of 1/sqrt(head_size)."""
    attn_softcap: float | None = None
    """Gemma 2 attn_logit_softcapping: scores become tanh(s / c) * c before the mask and softmax."""
    final_softcap: float | None = None
    """Gemma 2 final_logit_softcapping: logits become tanh(l / c) * c."""
    fused_mlp: bool = False
    """Phi3ForCausalLM: mlp.fc holds [up; gate] per rank (swiglu), and there is no mlp.gate."""
    rotary_base_local: float | None = None
    """Gemma 3 rope_local_base_freq: the rope base of its local layers (Attention(is_local=True)); None: one base."""
    sliding_window_pattern: int = 0
    """Gemma 3 _sliding_window_pattern: layer i is local when (i + 1) % pattern != 0 (GemmaDecoderLayer); 0: none."""
    attention_sinks: bool = False
    """gpt-oss: each layer holds attention.sinks, one learned logit per q head in the softmax denominator."""
    expert_bias: bool = False
    """gpt-oss: biased router, expert fc and proj, and the clamped SwiGLU (engine/cpu/clamped_swiglu.py)."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    """gpt-oss's clamp on the experts' gate and up (config.json swiglu_limit); None: plain SwiGLU."""

    mla: MlaDims | None = None
    """DeepSeek-V3's multi-head latent attention (engine/cpu/mla.py); None for every other attention."""
    dense_layers: int = 0
    """Leading layers of a mixture-of-experts model with a dense MLP (DeepSeek-V3's first_k_dense_replace)."""
    grouped_routing: GroupedRouting | None = None
    """DeepSeek-V3's grouped sigmoid routing with its correction bias (routing.py); None: softmax top-k."""

    rope_interleaved: bool = False
    """position_embedding_type rope_gptj: rope turns the pairs (2i, 2i + 1), not (i, i + d/2) (Llama 4)."""
    moe_layers: tuple[int, ...] | None = None
    """The layers whose MLP is a mixture of experts where only some are (Llama 4's moe_layers); None: all of a
    MoE model's but its `dense_layers`."""
    moe_router: str = "softmax"
    """The family's routing (archs/common.py Decoder.moe_router): "softmax" or Llama 4's "sigmoid_input"."""
    shared_expert_gate: bool = True
    """Whether a shared expert is scaled by its sigmoid gate (Decoder.shared_expert_gate): Qwen2-MoE's is,
    DeepSeek-V3's and Llama 4's are added as they are."""
    llama4: Llama4Attention | None = None
    """Llama 4's rope and NoPE layers, chunks, q/k norm and temperature tuning (engine/cpu/llama4.py)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers held after the main ones (config.json num_nextn_predict_layers, which
    checkpoint/mtp.py writes for speculative.mode mtp): global layers num_layers.., on the last stage, each with
    its own KV cache layer (engine/cpu/mtp.py)."""

    @property
    def cache_layers(self) -> int:
        """Layers the KV pool holds: the main ones, then the MTP layers'."""
        return self.num_layers + self.mtp_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` holds experts rather than a dense MLP."""
        return (self.is_moe and layer >= self.dense_layers
                and (self.moe_layers is None or layer in self.moe_layers))

    @property
    def has_dense_mlp(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    def is_local(self, layer: int) -> bool:
        """Whether global layer `layer` rotates with rotary_base_local (Gemma 3's local layers)."""
        return self.sliding_window_pattern > 0 and bool((layer + 1) % self.sliding_window_pattern)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def format(self) -> formats.Format | None:
        """The quant_algo's row (quant/formats.py); None when unquantized."""
        return formats.BY_ALGO.get(self.quant_algo) if self.quant_algo not in UNQUANTIZED else None

    @property
    def per_group(self) -> bool:
        return self.format is not None and self.format.per_group

    @property
    def mlp_width(self) -> int:
        """Full MLP width as stored: per-group int4 pads it to max(64, g) * tp (TensorRT-LLM
        tensorrt_llm/quantization/layers.py, WeightOnlyGroupwiseQuantLinear)."""
        if not self.per_group:
            return self.intermediate_size
        m = per_group_multiple(self.group_size, self.tp)
        return -(-self.intermediate_size // m) * m

    def linear_format(self, module: str) -> str | None:
        """How `module` (global TensorRT-LLM name) is stored: None for fp, else a qlinear format."""
        if self.format is None or any(fnmatch.fnmatchcase(module, p) for p in self.exclude_modules):
            return None
        return self.format.cpu_kernel

    def build_quantizes(self, weight: str) -> bool:
        """Whether trtllm-build turns fp tensor `weight` (its name in the rank file) into int8 plus a
        per_channel_scale: W8A16/W4A16's weight_only_quantize_dict, which matches exclude_modules against
        tensor names (quant/exclude.py)."""
        fmt = self.format
        return fmt is not None and fmt.weight_only and exclude.build_quantizes(weight, self.exclude_listed)
    """runtime_defaults.max_attention_window: per-layer windows, repeated over the layers; None = full."""

    def attention_window(self, layer: int) -> int | None:
        """Keys a query at `layer` may see (itself included), None for all."""
        if not self.attention_windows:
            return None
        return self.attention_windows[layer % len(self.attention_windows)]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        # T > nkv: each rank holds one duplicated KV head (TensorRT-LLM convert_utils.py, dup_kv_weight).
        return max(1, self.num_kv_heads // self.tp)

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.tp) * self.tp

    def stage_layers(self, pp_rank: int) -> range:
        """Global layer indices of a pipeline stage: torch.tensor_split(range(L), P) (TensorRT-LLM
        tensorrt_llm/mapping.py, Mapping.pp_layers)."""
        base, extra = divmod(self.num_layers, self.pp)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))


@dataclass(frozen=True)
class BuildLimits:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int = 32  # plugin_config.tokens_per_block (TensorRT-LLM 1.2's default)
    max_draft_len: int = 0  # draft tokens a request may bring for verification (speculative decoding)
    max_beam_width: int = 1  # widest beam search a request may ask for (engine/cpu/beams.py)


def _need(cfg: dict, key: str, kind: type, origin: str) -> Any:
    if key not in cfg:
        raise ToolchainError(f"{origin}: pretrained_config has no '{key}'", _REBUILD)
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ToolchainError(f"{origin}: pretrained_config '{key}' must be {kind.__name__}, got {value!r}", _REBUILD)
    return value


def _rope_scaling(raw: Any, origin: str) -> dict | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ToolchainError(f"{origin}: rotary_scaling must be an object or null, got {raw!r}", _REBUILD)
    kind = raw.get("type", raw.get("rope_type"))
    if kind in (None, "none", "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ToolchainError(f"{origin}: rotary_scaling type '{kind}' is not supported by the CPU engine",
                             "supported: linear, llama3, yarn (or null)")
    needed = ["factor"] + {"llama3": ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
                           "yarn": ["original_max_position_embeddings"]}.get(kind, [])
    missing = [k for k in needed if k not in raw]
    if missing:
        raise ToolchainError(f"{origin}: rotary_scaling of type '{kind}' lacks {', '.join(missing)}", _REBUILD)
    return {**raw, "type": kind}


def _long_rope(cfg: dict, origin: str) -> dict:
    """Phi-3's long_rope keys (tensorrt_llm/models/phi3/model.py passes them to Attention) as the rotary
    scaling engine/cpu/rope.py computes."""
    short, long_ = cfg.get("longrope_scaling_short_factors"), cfg.get("longrope_scaling_long_factors")
    original = cfg.get("original_max_position_embeddings")
    if (not isinstance(short, list) or not isinstance(long_, list) or len(short) != len(long_)
            or not isinstance(original, int) or original < 1):
        raise ToolchainError(f"{origin}: long_rope needs longrope_scaling_short_factors and _long_factors of equal "
                             "length and a positive original_max_position_embeddings", _REBUILD)
    return {"type": "longrope", "short_factor": short, "long_factor": long_,
            "original_max_position_embeddings": original,
            "max_position_embeddings": int(cfg.get("max_position_embeddings", original))}


def _windows(raw: Any, origin: str) -> tuple[int, ...] | None:
    """TensorRT-LLM's RuntimeDefaults.max_attention_window: a list of positive
    ints, repeated over the layers when shorter than num_layers."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ToolchainError(f"{origin}: runtime_defaults must be an object, got {raw!r}", _REBUILD)
    windows = raw.get("max_attention_window")
    if windows is None:
        return None
    if (not isinstance(windows, list) or not windows
            or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in windows)):
        raise ToolchainError(f"{origin}: runtime_defaults.max_attention_window must be a non-empty list of "
                             f"positive integers, got {windows!r}", _REBUILD)
    return tuple(windows)


def parse_dims(cfg: dict, origin: str) -> ModelDims:
    arch = _need(cfg, "architecture", str, origin)
    if arch not in ARCHITECTURES:
        raise ToolchainError(f"{origin}: architecture '{arch}' is not supported by the CPU engine",
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
    decoder = _decoder(arch, cfg)
    position = cfg.get("position_embedding_type", "rope_gpt_neox")
    if position not in ("rope_gpt_neox", "rope_gptj") and not (position == "long_rope" and decoder.long_rope):
        raise ToolchainError(f"{origin}: position_embedding_type '{position}' "
                             "is not supported by the CPU engine",
                             "only rope_gpt_neox, rope_gptj (and Phi-3's long_rope) are")
    mapping = cfg.get("mapping") or {}
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    world = int(mapping.get("world_size", tp * pp))
    if tp < 1 or pp < 1 or world != tp * pp or int(mapping.get("cp_size", 1)) != 1:
        raise ToolchainError(f"{origin}: mapping {mapping} is inconsistent (world_size must be tp_size x pp_size, "
                             "cp_size 1)", _REBUILD)
    quant = cfg.get("quantization") or {}
    listed = quant.get("exclude_modules")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise ToolchainError(f"{origin}: quantization.exclude_modules must be a list of module globs, got "
                                 f"{listed!r}", _REBUILD)
        listed = tuple(listed)
    hidden = _need(cfg, "hidden_size", int, origin)
    heads = _need(cfg, "num_attention_heads", int, origin)
    dims = ModelDims(
        architecture=arch,
        vocab_size=_need(cfg, "vocab_size", int, origin),
        hidden_size=hidden,
        num_layers=_need(cfg, "num_hidden_layers", int, origin),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_size=int(cfg.get("head_size") or hidden // heads),
        intermediate_size=_need(cfg, "intermediate_size", int, origin),
        hidden_act=_need(cfg, "hidden_act", str, origin),
        norm_epsilon=float(cfg.get("norm_epsilon", 1e-5)),
        rotary_base=float(cfg.get("rotary_base", 10000.0)),
        rotary_scaling=(_long_rope(cfg, origin) if position == "long_rope"
                        else None if decoder.mla  # MLA rotates its rope head itself (mla.py: yarn)
                        else _rope_scaling(cfg.get("rotary_scaling"), origin)),
        attn_bias=bool(cfg.get("attn_bias", False)),
        dense_bias=bool(cfg.get("attn_bias", False)) and decoder.dense_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        use_parallel_embedding=bool(cfg.get("use_parallel_embedding", False)),
        embedding_sharding_dim=int(cfg.get("embedding_sharding_dim", 0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        tp=tp,
        pp=pp,
        quant_algo=quant.get("quant_algo"),
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        qk_layernorm=bool(cfg.get("qk_layernorm", False)),
        attention_windows=_windows(cfg.get("runtime_defaults"), origin),
        group_size=int(quant.get("group_size") or 128),
        has_zero_point=bool(quant.get("has_zero_point", False)),
        pre_quant_scale=bool(quant.get("pre_quant_scale", False)),
        exclude_modules=exclude.module_patterns(listed),
        exclude_listed=listed,
        **_medusa_dims(arch, cfg, origin),
        **_moe_dims(cfg, mapping, tp, origin),
        **_gemma2_dims(arch, decoder.config_group, cfg, origin),
        fused_mlp=decoder.fused_mlp,
        **_gpt_oss_dims(decoder, cfg, origin),
        rope_interleaved=position == "rope_gptj",
        moe_router=decoder.moe_router,
        shared_expert_gate=decoder.shared_expert_gate,
        **llama4_dims(decoder.attention_config, cfg, origin),
    )
    if decoder.mla:
        dims = dataclasses.replace(dims, **parse_mla(cfg, origin, tp=tp, heads=heads, intermediate=dims.intermediate_size,
                                                     quant=(dims.quant_algo, dims.kv_cache_quant_algo)))
    _check_dims(dims, decoder, origin)
    return dims


def _decoder(arch: str, cfg: dict) -> Decoder:
    """How TensorRT-LLM builds the decoder of an `arch` checkpoint: its family's `decoder` (archs/*.py), for Medusa
    the base's, QWen's when model_type names qwen (MedusaConfig, tensorrt_llm/models/medusa/config.py)."""
    if arch == MEDUSA:
        arch = "QWenForCausalLM" if "qwen" in str(cfg.get("model_type", "")).lower() else "LlamaForCausalLM"
    return family_for_checkpoint(arch).decoder


def _moe_dims(cfg: dict, mapping: dict, tp: int, origin: str) -> dict:
    """The `moe` section (MoeConfig.to_dict) and the mapping's expert parallelism; a MoeConfig with at
    most one expert is a dense model upstream (MoeConfig.has_moe: num_experts > 1)."""
    raw = cfg.get("moe") or {}
    if not isinstance(raw, dict):
        raise ToolchainError(f"{origin}: pretrained_config 'moe' must be an object, got {raw!r}", _REBUILD)
    experts = raw.get("num_experts", 0)
    if not isinstance(experts, int) or experts <= 1:
        return {}
    top_k, mode = raw.get("top_k"), raw.get("normalization_mode", 1)
    moe_tp, moe_ep = mapping.get("moe_tp_size", tp), mapping.get("moe_ep_size", 1)
    if (not isinstance(top_k, int) or not 1 <= top_k <= experts or mode not in MOE_NORMALIZATIONS
            or not isinstance(moe_tp, int) or not isinstance(moe_ep, int) or moe_tp < 1 or moe_ep < 1):
        raise ToolchainError(f"{origin}: moe {raw} with mapping moe_tp_size {moe_tp}, moe_ep_size {moe_ep} is not "
                             "supported by the CPU engine (top_k 1..num_experts, normalization_mode 0 or 1)",
                             _REBUILD)
    return {"num_experts": experts, "top_k": top_k, "moe_normalization": mode, "moe_tp": moe_tp, "moe_ep": moe_ep,
            **_qwen_moe_sizes(cfg, origin), **_moe_layer_sizes(cfg, origin)}


def _moe_layer_sizes(cfg: dict, origin: str) -> dict:
    """Llama 4 (archs/llama4.py): the layers that hold experts (moe_layers; the others a dense MLP of
    intermediate_size) and the experts' and shared expert's width (moe_intermediate_size,
    moe_shared_expert_intermediate_size); empty without moe_layers."""
    layers = cfg.get("moe_layers")
    if layers is None:
        return {}
    count = cfg.get("num_hidden_layers")
    if (not isinstance(layers, list) or not isinstance(count, int)
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count for i in layers)):
        raise ToolchainError(f"{origin}: moe_layers must list layers below num_hidden_layers, got {layers!r}",
                             _REBUILD)
    out: dict = {"moe_layers": tuple(layers)}
    for key, field in (("moe_intermediate_size", "expert_size"),
                       ("moe_shared_expert_intermediate_size", "shared_expert_size")):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ToolchainError(f"{origin}: a config with moe_layers needs {key} >= 1, got {value!r}", _REBUILD)
        out[field] = value
    return out


def _qwen_moe_sizes(cfg: dict, origin: str) -> dict:
    """The experts' widths as QWenDecoderLayer reads them (tensorrt_llm/models/qwen/model.py): qwen2_moe and
    qwen3_moe experts are moe_intermediate_size wide, and qwen2_moe adds a shared expert (SharedMoE) of
    moe_shared_expert_intermediate_size; every other MoE family's experts are intermediate_size wide."""
    kind = str(cfg.get("qwen_type"))
    keys = {"qwen2_moe": ("moe_intermediate_size", "moe_shared_expert_intermediate_size"),
            "qwen3_moe": ("moe_intermediate_size",)}.get(kind, ())
    sizes = {}
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ToolchainError(f"{origin}: a {kind} config needs {key} >= 1, got {value!r}", _REBUILD)
        sizes[key] = value
    out = {"expert_size": sizes.get("moe_intermediate_size", cfg.get("intermediate_size", 0))}
    if "moe_shared_expert_intermediate_size" in sizes:
        out["shared_expert_size"] = sizes["moe_shared_expert_intermediate_size"]
    return out


def _gemma2_dims(arch: str, group: str | None, cfg: dict, origin: str) -> dict:
    """Gemma2ConfigGroup or Gemma3ConfigGroup (the decoder's `config_group`), and inter_layernorms
    (tensorrt_llm/models/gemma/config.py, GemmaConfig); Gemma 3 has no attention soft-cap (model.py sets
    max_attn_value for Gemma 2 only)."""
    if group is None:
        return {}
    gemma3 = group == "Gemma3ConfigGroup"
    values = {}
    keys = ("query_pre_attn_scalar", "final_logit_softcapping", "rope_local_base_freq") if gemma3 else \
        ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    for key in keys:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ToolchainError(f"{origin}: pretrained_config '{key}' must be a positive number or null, "
                                 f"got {value!r}", _REBUILD)
        values[key] = None if value is None else float(value)
    if values["query_pre_attn_scalar"] is None:  # GemmaConfig asserts it for Gemma 2 and 3
        raise ToolchainError(f"{origin}: a {arch} config needs query_pre_attn_scalar", _REBUILD)
    out = {"inter_layernorms": bool(cfg.get("inter_layernorms", True)),
           "query_pre_attn_scalar": values["query_pre_attn_scalar"],
           "attn_softcap": values.get("attn_logit_softcapping"), "final_softcap": values["final_logit_softcapping"]}
    if gemma3:
        pattern, local_base = cfg.get("_sliding_window_pattern"), values["rope_local_base_freq"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1 or local_base is None:
            raise ToolchainError(f"{origin}: a {arch} config needs _sliding_window_pattern >= 1 and "
                                 f"rope_local_base_freq, got {pattern!r} and {local_base!r}", _REBUILD)
        out.update(sliding_window_pattern=pattern, rotary_base_local=local_base)
    return out


def _gpt_oss_dims(decoder: Decoder, cfg: dict, origin: str) -> dict:
    """gpt-oss's traits (archs/gpt_oss.py): sinks, biased experts and their clamped SwiGLU constants."""
    if not (decoder.attention_sinks or decoder.expert_bias):
        return {}
    out: dict[str, Any] = {"attention_sinks": decoder.attention_sinks, "expert_bias": decoder.expert_bias}
    if decoder.expert_bias:
        for key in ("swiglu_alpha", "swiglu_limit"):
            value = cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ToolchainError(f"{origin}: a {cfg.get('architecture')} config needs {key} > 0, got {value!r}",
                                     _REBUILD)
            out[key] = float(value)
    return out


def _medusa_dims(arch: str, cfg: dict, origin: str) -> dict:
    if arch != MEDUSA:
        return {}
    heads, layers = cfg.get("num_medusa_heads"), cfg.get("num_medusa_layers", 1)
    if not isinstance(heads, int) or heads < 1 or not isinstance(layers, int) or layers < 1:
        raise ToolchainError(f"{origin}: a MedusaForCausalLM config needs num_medusa_heads >= 1 and "
                             f"num_medusa_layers >= 1, got {heads!r} and {layers!r}", _REBUILD)
    return {"medusa_heads": heads, "medusa_layers": layers}


def _check_dims(d: ModelDims, decoder: Decoder, origin: str) -> None:
    problems = []
    # upstream writes swiglu for mixture-of-experts MLPs (the gate fused into fc), the decoder's own for dense ones
    act = "swiglu" if d.is_moe else decoder.hidden_act
    if d.hidden_act != act:
        problems.append(f"hidden_act '{d.hidden_act}' (only {act} is supported{' for experts' if d.is_moe else ''})")
    if d.num_heads % d.tp:
        problems.append(f"num_attention_heads {d.num_heads} not divisible by tp {d.tp}")
    if d.medusa_heads and d.pp > 1:
        problems.append(f"Medusa heads with pp_size {d.pp} (the CPU engine runs Medusa at pp 1)")
    if d.num_kv_heads % d.tp and d.tp % d.num_kv_heads:
        problems.append(f"num_key_value_heads {d.num_kv_heads} and tp {d.tp} do not divide one another")
    if d.num_heads % d.num_kv_heads:
        problems.append(f"num_attention_heads {d.num_heads} not a multiple of num_key_value_heads {d.num_kv_heads}")
    if d.is_moe:
        if d.moe_tp * d.moe_ep != d.tp:
            problems.append(f"mapping moe_tp_size {d.moe_tp} x moe_ep_size {d.moe_ep} is not tp {d.tp}")
        if d.num_experts % d.moe_ep:
            problems.append(f"num_experts {d.num_experts} not divisible by moe_ep_size {d.moe_ep}")
        if d.expert_size % d.moe_tp:
            problems.append(f"expert width {d.expert_size} not divisible by moe_tp_size {d.moe_tp}")
        if d.shared_expert_size % d.tp:
            problems.append(f"shared expert width {d.shared_expert_size} not divisible by tp {d.tp}")
        if d.quant_algo not in UNQUANTIZED | MOE_QUANT_ALGOS:
            problems.append(f"quant_algo {d.quant_algo} on mixture-of-experts layers (the experts run unquantized, "
                            f"{', '.join(sorted(MOE_QUANT_ALGOS))})")
        if d.mlp_bias:
            problems.append("mlp_bias on mixture-of-experts layers (experts without biases only)")
    if d.has_dense_mlp and d.intermediate_size % d.tp:
        problems.append(f"intermediate_size {d.intermediate_size} not divisible by tp {d.tp}")
    if d.pp > d.num_layers:
        problems.append(f"pp {d.pp} exceeds num_hidden_layers {d.num_layers}")
    if d.embedding_sharding_dim not in (0, 1):
        problems.append(f"embedding_sharding_dim {d.embedding_sharding_dim} (must be 0 or 1)")
    if d.use_parallel_embedding and d.embedding_sharding_dim == 1 and d.hidden_size % d.tp:
        problems.append(f"hidden_size {d.hidden_size} not divisible by tp {d.tp} (embedding_sharding_dim 1)")
    if d.rotary_scaling and d.rotary_scaling["type"] == "longrope" and len(d.rotary_scaling["short_factor"]) * 2 != d.head_size:
        problems.append(f"longrope factors for {len(d.rotary_scaling['short_factor']) * 2} rotary dims, head_size "
                        f"{d.head_size}")
    if d.head_size % 2:
        problems.append(f"head_size {d.head_size} is odd (rotary needs pairs)")
    if problems:
        raise ToolchainError(f"{origin}: " + "; ".join(problems), _REBUILD)
    if d.quant_algo in PENDING_ALGOS:
        raise ToolchainError(f"{origin}: quant_algo {d.quant_algo}: the CPU engine's {PENDING_ALGOS[d.quant_algo]} "
                             "kernel is not implemented yet", "serve it on a GPU target (trtllm or llmapi)")
    if d.quant_algo not in UNQUANTIZED | QUANT_ALGOS:
        raise ToolchainError(f"{origin}: quant_algo {d.quant_algo} is not supported by the CPU engine",
                             f"supported: {', '.join(sorted(QUANT_ALGOS))}")
    if d.kv_cache_quant_algo not in (*UNQUANTIZED, *KV_ALGOS):
        raise ToolchainError(f"{origin}: kv_cache_quant_algo {d.kv_cache_quant_algo} is not supported by the CPU "
                             "engine", f"supported: {', '.join(KV_ALGOS)}")
    if d.per_group and d.group_size not in GROUP_SIZES:
        raise ToolchainError(f"{origin}: group_size {d.group_size} (TensorRT-LLM implements 64 and 128)", _REBUILD)
    kept = ("lm_head", "transformer.vocab_embedding")
    if d.format is not None and d.format.weight_only and not all(
            any(fnmatch.fnmatchcase(m, p) for p in d.exclude_modules) for m in kept):
        # The list replaces the default, so these modes would quantize the embedding (QuantConfig).
        raise ToolchainError(f"{origin}: quant_algo {d.quant_algo} with exclude_modules {list(d.exclude_modules)} "
                             "quantizes lm_head or the vocab embedding, which the CPU engine does not run",
                             "name lm_head and transformer.vocab_embedding in exclude_modules, or omit the list")


def parse_limits(build: Any, origin: str) -> BuildLimits:
    if not isinstance(build, dict):
        raise ToolchainError(f"{origin}: 'build_config' missing or not an object", _REBUILD)
    values = {}
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        value = build.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ToolchainError(f"{origin}: build_config '{key}' must be a positive integer, got {value!r}", _REBUILD)
        values[key] = value
    beams = build.get("max_beam_width", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or beams < 1:
        raise ToolchainError(f"{origin}: build_config.max_beam_width must be a positive integer, got {beams!r}",
                             _REBUILD)
    values["max_beam_width"] = beams
    plugin = build.get("plugin_config") or {}
    tpb = plugin.get("tokens_per_block", 32)
    if not isinstance(tpb, int) or isinstance(tpb, bool) or tpb < 1 or tpb & (tpb - 1):
        raise ToolchainError(f"{origin}: plugin_config.tokens_per_block must be a power of 2, got {tpb!r}", _REBUILD)
    values["tokens_per_block"] = tpb
    draft = build.get("max_draft_len", 0)
    if not isinstance(draft, int) or isinstance(draft, bool) or draft < 0:
        raise ToolchainError(f"{origin}: build_config.max_draft_len must be a non-negative integer, got {draft!r}",
                             _REBUILD)
    values["max_draft_len"] = draft
    if values["max_input_len"] > values["max_seq_len"]:
        raise ToolchainError(f"{origin}: max_input_len exceeds max_seq_len", _REBUILD)
    return BuildLimits(**values)


def read_engine_config(engine_dir: Path) -> tuple[dict, ModelDims, BuildLimits]:
    """The raw config dict plus its parsed model dimensions and build limits."""
    path = Path(engine_dir) / "config.json"
    if not path.is_file():
        raise ToolchainError(f"no engine config at {path}", "build the engine first: `toolchain build-engine`")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ToolchainError(f"{path} is not valid JSON: {err}", _REBUILD) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("pretrained_config"), dict):
        raise ToolchainError(f"{path}: no 'pretrained_config' object", _REBUILD)
    return raw, parse_dims(raw["pretrained_config"], str(path)), parse_limits(raw.get("build_config"), str(path))
