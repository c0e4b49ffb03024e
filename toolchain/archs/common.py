"""Shared pieces of the per-family tables: row and family declarations, name
matching, and the named transforms rows may apply.

A family is data: a tuple of `Row`s, each mapping one HF tensor-name pattern
(`{layer}` standing for the decoder block index) to a TensorRT-LLM checkpoint
name plus a shard rule. The checkpoint package interprets the rules; nothing
here touches weights except the small transforms at the bottom.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from toolchain.errors import ToolchainError

if TYPE_CHECKING:  # torch costs ~1.4 s to import; `toolchain plan` reads tables without it
    import torch


class Shard(str, enum.Enum):
    """How a tensor is laid out over the tensor-parallel ranks (TensorRT-LLM
    tensorrt_llm/models/convert_utils.py, tensorrt_llm/layers/linear.py)."""

    COLUMN = "column"        # split dim 0 (output features); column-parallel biases split too
    ROW = "row"              # split dim 1 (input features) of a row-parallel weight
    REPLICATE = "replicate"  # full copy on every rank (norms, row-parallel biases)
    QKV = "qkv"              # q/k/v rows fused per rank, per head, KV duplicated when tp > nkv (dup_kv_weight)
    VOCAB = "vocab"          # lm_head: pad V to ceil(V/T)*T with zero rows, split dim 0 (pad_vocab_size)
    EMBEDDING = "embedding"  # vocab embedding: full unless use_parallel_embedding (layers/embedding.py)
    DROP = "drop"            # known HF tensor with no checkpoint counterpart
    # Mixture-of-experts rows (`{expert}` in the HF name): every expert of a layer is read into one
    # stacked tensor [experts, out, in], experts split over moe_ep, the expert width over moe_tp
    # (TensorRT-LLM tensorrt_llm/models/llama/convert.py, `if moe_config.has_moe()`).
    EXPERT_FC = "expert_fc"      # [w3; w1] per expert, concatenated along out (part "w3" or "w1")
    EXPERT_PROJ = "expert_proj"  # w2 per expert, its input (expert width) split over moe_tp
    # A swiglu MLP's fused fc (TensorRT-LLM MLP(hidden_act="swiglu"), e.g. Qwen2-MoE's shared expert): up and
    # gate each split over tp like COLUMN, and each rank's [up; gate] slices concatenated along out (part "w3"
    # for up, the linear half, "w1" for gate, the activated half, as in EXPERT_FC).
    GATED_FC = "gated_fc"
    # Fused HF projections (Phi-3: tensorrt_llm/models/phi3/convert.py): one HF tensor whose rows are
    # several projections. FUSED_QKV is [q; k; v] and shards like QKV rows; FUSED_GATE_UP is [gate; up] and
    # becomes a swiglu fc [up; gate] on every rank, each half split over tp (sharding.split_gated_fc).
    FUSED_QKV = "fused_qkv"
    FUSED_GATE_UP = "fused_gate_up"
    # One HF tensor holding every expert of a layer (gpt-oss: experts.gate_up_proj [E, H, 2I] with gate and up
    # interleaved, its bias [E, 2I]; experts.down_proj [E, I, H], its bias [E, H]), laid out as the EXPERT_FC /
    # EXPERT_PROJ stacks are (checkpoint/expert_stacks.py): the experts over moe_ep, the width over moe_tp.
    STACKED_GATE_UP = "stacked_gate_up"
    STACKED_DOWN = "stacked_down"
    # Every expert of a layer in one HF tensor (transformers 5's Llama 4 experts, (in, out) per expert):
    # STACKED_EXPERT_FC is gate_up_proj [E, H, 2I] with the gate (activated) half first, STACKED_EXPERT_PROJ is
    # down_proj [E, I, H]; both are laid out per rank as EXPERT_FC and EXPERT_PROJ are (checkpoint/sharding.py
    # split_stacked_experts).
    # STACKED_GATE_UP_ROWS / STACKED_DOWN_ROWS: the same stacks stored one row per output feature with their
    # input in blocks, [E, out, in/32(, 16)] (gpt-oss's MXFP4 blocks and scales; checkpoint/expert_stacks.py).
    STACKED_GATE_UP_ROWS = "stacked_gate_up_rows"
    STACKED_DOWN_ROWS = "stacked_down_rows"
    STACKED_EXPERT_FC = "stacked_expert_fc"
    STACKED_EXPERT_PROJ = "stacked_expert_proj"


class Stage(str, enum.Enum):
    """Which pipeline stage holds a tensor (TensorRT-LLM tensorrt_llm/mapping.py, Mapping.pp_layers)."""

    LAYER = "layer"  # the stage owning the row's decoder layer
    FIRST = "first"
    LAST = "last"


@dataclass(frozen=True)
class Row:
    hf: str
    """HF tensor name; `{layer}` matches the decoder block index."""
    trt: str | None
    """TensorRT-LLM name (same `{layer}` placeholder, renumbered per stage); None for DROP rows."""
    shard: Shard
    part: str | None = None
    """For QKV rows: which of "q", "k", "v" this source is; for EXPERT_FC and GATED_FC rows "w3" (linear) or
    "w1" (activated)."""
    when: str | None = None
    """Boolean `ArchParams` attribute that enables the row; a disabled row makes its tensor unexpected."""
    stage: Stage | None = None
    """Defaults to LAYER for `{layer}` rows; non-layer rows must say FIRST or LAST."""
    transform: str | None = None
    """Name in TRANSFORMS applied to the HF tensor before sharding."""
    tied_from: str | None = None
    """HF name to use instead when this tensor is absent and word embeddings are tied."""
    shape: tuple[str, ...] | None = None
    """Expected HF shape in DIM symbols (after the transform), checked before any weight is read."""
    dtype: str | None = None
    """Checkpoint dtype when it is not the model's: the MoE router stays float32 ("Router should never be
    quantized", cast to float32: TensorRT-LLM tensorrt_llm/models/llama/convert.py)."""
    layers: str | None = None
    """For a `{layer}` row that only some layers hold: "moe" (the layers ArchParams.is_moe_layer names) or
    "dense" (the others), as Llama 4 interleaves dense and mixture-of-experts MLPs and DeepSeek-V3 starts with
    dense layers; "nextn" (ArchParams.is_mtp_layer: a kept multi-token-prediction layer's own tensors); None: every
    layer."""

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.hf

    @property
    def placement(self) -> Stage:
        return self.stage or (Stage.LAYER if self.per_layer else Stage.FIRST)


@dataclass(frozen=True)
class Decoder:
    """How TensorRT-LLM builds this family's decoder from a checkpoint, where config.json's fields alone do not say
    (MODEL_MAP in tensorrt_llm/models/__init__.py picks the class by `architecture`): what an engine executing the
    checkpoint must know beyond its fields. The CPU engine reads these (engine/cpu/config.py)."""

    hidden_act: str = "silu"
    """config.json's hidden_act for a dense MLP, as the converter writes it: "silu" (GatedMLP), "gelu" (Gemma's
    tanh form), "swiglu" (Phi-3's fused fc). Mixture-of-experts layers are "swiglu" in every family."""
    dense_bias: bool = True
    """The attention output projection is biased when attn_bias is; False where the decoder builds it unbiased
    (QWenDecoderLayer: Attention(bias=config.attn_bias, dense_bias=False), tensorrt_llm/models/qwen/model.py)."""
    fused_mlp: bool = False
    """mlp.fc holds [up; gate] per rank and there is no mlp.gate (Phi-3's MLP(hidden_act="swiglu"),
    tensorrt_llm/models/phi3/model.py): the family's table has a FUSED_GATE_UP row."""
    long_rope: bool = False
    """position_embedding_type "long_rope" is built (Phi-3's Attention with the longrope factors)."""
    attention_sinks: bool = False
    """Each attention layer has one learned logit per q head in its softmax denominator (gpt-oss `sinks`)."""
    expert_bias: bool = False
    """The router and the experts' fc and proj are biased, and the experts run the clamped SwiGLU with the
    config's swiglu_limit (gpt-oss)."""
    config_group: str | None = None
    """The Gemma config group whose fields config.json carries, "Gemma2ConfigGroup" or "Gemma3ConfigGroup"
    (tensorrt_llm/models/modeling_utils.py), with GemmaConfig's inter_layernorms; None for other decoders."""
    mla: bool = False
    """Multi-head latent attention with grouped sigmoid routing (DeepSeek-V3): config.json's `deepseek_v3`
    section says the ranks and groups, and the attention tensors are archs/deepseek_v3.py's, not a fused qkv."""
    moe_router: str = "softmax"
    """How the experts are routed: "softmax" (Mixtral, Qwen MoE: softmax over every expert, top-k, scaled as
    the moe section's normalization_mode says, the weights scaling each expert's output) or "sigmoid_input"
    (Llama 4's Llama4Router: top-k of the logits, their sigmoid scaling each expert's input)."""
    shared_expert_gate: bool = True
    """A shared expert is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE's SharedMoE); False: added as it is
    (Llama 4's Llama4TextMoe)."""
    attention_config: str | None = None
    """Attention keys of the family's own that config.json carries and the CPU engine reads: "llama4"
    (no_rope_layers, attention_chunk_size, use_qk_norm, temperature tuning: engine/cpu/llama4.py); None: none."""


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    rows: tuple[Row, ...]
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Values for HF config keys a config.json may omit (the HF config class defaults)."""
    config_extra: Callable[[Any], dict] | None = None
    """Family-specific TensorRT-LLM config.json fields, given the ArchParams."""
    prepare: Callable[[dict, str], dict] | None = None
    """Family-specific rewrite of the HF config dict before the shared alias lookup, for keys only this
    family nests (Gemma 3's per-layer-type rope_parameters in transformers 5)."""
    normalize: Callable[[dict, Any, str], Any] | None = None
    """Family-specific config normalisation: (HF config dict, ArchParams, origin) -> ArchParams.
    Runs after the shared alias lookup, for what only this family's HF config spells
    (sliding windows, forced biases, q/k norms) and what it cannot represent."""
    parallel_embedding_at_tp: bool = False
    """TensorRT-LLM's config class forces use_parallel_embedding = tp > 1 (GemmaConfig), whatever config.json says."""
    llmapi_refusal: Callable[[Any, int, bool], str | None] | None = None
    """(ArchParams, tp, quantized) -> why the LLM-API path (PyTorch backend) cannot serve this model, or None."""
    llmapi_no_reuse: str | None = None
    """Why the PyTorch backend must serve this family with KV block and partial reuse off (with the upstream
    source saying so), or None: llmapi/args.py writes enable_partial_reuse false and the llmapi.kv-reuse check
    refuses build.kv_cache_reuse."""
    engine_refusal: str | None = None
    """Why trtllm-build of the pinned release cannot build this family (with the upstream source saying so), or
    None: the arch.engine-path check refuses the engine path for it and points at the LLM-API path."""
    quantization: Callable[[Any, str, str, str | None], "Refusal | None"] | None = None
    """(ArchParams, method, kv_cache, stored) -> why this family's model cannot be quantized as asked, or None.
    `stored` names the format of a checkpoint that is quantized already. Convert, the HF-format export and the
    `arch.quantization` check all ask `quantization_refusal`, so a family states its limits once."""
    duplicates_kv_block_scales: bool = False
    """TensorRT-LLM's PyTorch weight mapper for the family repeats FP8 block scales (weight_scale_inv) with the K/V
    heads it duplicates when num_key_value_heads < tp (Qwen3MoeHfWeightMapper._duplicate_kv_weights); the generic
    HfWeightMapper repeats only weight, bias and NVFP4's weight_scale, so elsewhere such a split does not load."""
    decoder: Decoder = Decoder()
    """How TensorRT-LLM's decoder for this family runs its checkpoint (the CPU engine's traits)."""
    ignore: Callable[[Any, str], bool] | None = None
    """(ArchParams, HF tensor name) -> whether convert drops the tensor unread, for whole modules no row names
    (DeepSeek-V3's multi-token-prediction layers, which transformers ignores on load too)."""
    pipeline_refusal: str | None = None
    """Why the family cannot be split into pipeline stages (with the upstream source saying so), or None: pp > 1 is
    refused by the llmapi.architecture check and by convert for the LLM-API path (gpt-oss asserts pp_size == 1)."""
    mtp_rows: tuple[Row, ...] = ()
    """Rows only a multi-token-prediction layer has (DeepSeek-V3's enorm, hnorm, eh_proj, shared_head), beside the
    decoder rows it shares with the other layers; convert adds them for speculative.mode mtp (checkpoint/mtp.py)."""

    def __post_init__(self) -> None:
        # Table mistakes are programming errors: fail at import, not mid-conversion.
        for row in self.rows:
            if row.shard is Shard.QKV and row.part not in ("q", "k", "v"):
                raise ValueError(f"{self.name}: QKV row {row.hf} needs part q, k or v")
            if row.shard in (Shard.EXPERT_FC, Shard.GATED_FC) and row.part not in ("w3", "w1"):
                raise ValueError(f"{self.name}: {row.shard.name} row {row.hf} needs part w3 or w1")
            if (row.shard in EXPERT_SHARDS) != row.per_expert or (row.per_expert and not row.per_layer):
                raise ValueError(f"{self.name}: row {row.hf}: expert rows name {{layer}} and {{expert}}, others neither")
            if row.shard is not Shard.DROP and row.trt is None:
                raise ValueError(f"{self.name}: row {row.hf} has no TensorRT-LLM name")
            if not row.per_layer and row.stage is None and row.shard is not Shard.DROP:
                raise ValueError(f"{self.name}: non-layer row {row.hf} must name its stage")
            if row.transform is not None and row.transform not in TRANSFORMS:
                raise ValueError(f"{self.name}: row {row.hf} names unknown transform {row.transform}")
            if row.shape is not None and not set(row.shape) <= set(DIMS):
                raise ValueError(f"{self.name}: row {row.hf} shape uses unknown symbols {row.shape}")
            if row.layers not in (None, "moe", "dense", "nextn") or (row.layers is not None and not row.per_layer):
                raise ValueError(f"{self.name}: row {row.hf} layers must be moe or dense on a {{layer}} row")
        if self.decoder.fused_mlp != any(r.shard is Shard.FUSED_GATE_UP for r in self.rows):
            raise ValueError(f"{self.name}: decoder.fused_mlp must say whether the table has a FUSED_GATE_UP row")
        if not self.decoder.dense_bias and any(r.trt and r.trt.endswith("attention.dense.bias") for r in self.rows):
            raise ValueError(f"{self.name}: decoder.dense_bias is False but a row writes attention.dense.bias")


    def llmapi_problem(self, params: Any, tp: int, pp: int, quantized: bool) -> str | None:
        """Why the PyTorch backend cannot serve this model at this tp and pp (`pipeline_refusal`, then
        `llmapi_refusal`), or None. The llmapi.architecture check and convert for the LLM-API path both ask it."""
        if pp > 1 and self.pipeline_refusal is not None:
            return (f"{params.architecture} at pp {pp} on the LLM-API path: {self.pipeline_refusal}; "
                    "use parallelism.pp 1")
        return None if self.llmapi_refusal is None else self.llmapi_refusal(params, tp, quantized)

    def quantization_refusal(self, params: Any, method: str, kv_cache: str,
                             stored: str | None = None) -> "Refusal | None":
        """Why this model cannot be converted with `method`/`kv_cache` (or, with `stored`, imported as the
        pre-quantized checkpoint it is), or None."""
        if stored and any(r.shard in FUSED_SHARDS for r in self.rows):
            # The pre-quantized importers (AutoAWQ, GPTQ, ModelOpt) map one HF tensor to one checkpoint tensor;
            # a fused projection's packed weights and scales would have to be split per projection.
            return Refusal(f"a pre-quantized {params.architecture} checkpoint ({stored}) with fused projections",
                           "convert the unquantized model and set quantization.method instead")
        return None if self.quantization is None else self.quantization(params, method, kv_cache, stored)


@dataclass(frozen=True)
class Refusal:
    """What a family cannot do, in the one-line error's two halves: what is wrong and how to fix it."""

    why: str
    hint: str


EXPERT_SHARDS = (Shard.EXPERT_FC, Shard.EXPERT_PROJ)
STACKED_EXPERT_SHARDS = (Shard.STACKED_EXPERT_FC, Shard.STACKED_EXPERT_PROJ)  # one HF tensor per layer
FUSED_SHARDS = (Shard.FUSED_QKV, Shard.FUSED_GATE_UP)  # one HF tensor holding several projections

# Symbols for Row.shape, so tables state shapes without code.
DIMS: dict[str, Callable[[Any], int]] = {
    "H": lambda p: p.hidden_size,
    "I": lambda p: p.intermediate_size,
    "V": lambda p: p.vocab_size,
    "Q": lambda p: p.num_attention_heads * p.head_size,     # q_proj rows, o_proj columns
    "KV": lambda p: p.num_key_value_heads * p.head_size,    # k_proj / v_proj rows
    "HD": lambda p: p.head_size,                              # per-head q/k norms (Qwen3)
    "E": lambda p: p.num_experts,                             # MoE router rows
    "EI": lambda p: p.expert_size,                            # each routed expert's width
    "SI": lambda p: p.shared_expert_size,                     # the shared expert's width (Qwen2-MoE)
    "1": lambda p: 1,                                         # a single output row (Qwen2-MoE's shared_expert_gate)
    "QKV": lambda p: (p.num_attention_heads + 2 * p.num_key_value_heads) * p.head_size,  # fused qkv_proj rows
    "2I": lambda p: 2 * p.intermediate_size,                  # fused gate_up_proj rows
    # multi-head latent attention (DeepSeek-V3, ArchParams.mla): the q and kv latents and the per-head projections
    "QL": lambda p: p.mla["q_lora_rank"],
    "KVL": lambda p: p.mla["kv_lora_rank"],
    "KVA": lambda p: p.mla["kv_lora_rank"] + p.mla["qk_rope_head_dim"],      # kv_a_proj_with_mqa rows
    "QB": lambda p: p.num_attention_heads * (p.mla["qk_nope_head_dim"] + p.mla["qk_rope_head_dim"]),
    "KVB": lambda p: p.num_attention_heads * (p.mla["qk_nope_head_dim"] + p.mla["v_head_dim"]),
    "OV": lambda p: p.num_attention_heads * p.mla["v_head_dim"],             # o_proj columns
    "NH": lambda p: p.num_attention_heads,                    # one value per q head (gpt-oss sinks)
    "2EI": lambda p: 2 * p.expert_size,                       # every expert's fused gate_up_proj (gpt-oss, Llama 4)
    "2H": lambda p: 2 * p.hidden_size,                        # an MTP layer's eh_proj input [embedding; hidden]
    "HB": lambda p: p.hidden_size // 32,                      # MXFP4 blocks of 32 along the hidden size (gpt-oss)
    "EIB": lambda p: p.expert_size // 32,                     # MXFP4 blocks of 32 along the expert width
    "16": lambda p: 16,                                       # bytes of one MXFP4 block (32 e2m1 values)
}


def expected_shape(row: Row, params: Any) -> tuple[int, ...] | None:
    return None if row.shape is None else tuple(DIMS[sym](params) for sym in row.shape)


# What NameTable.match answers for a tensor its family's `ignore` drops.
IGNORED = Row("(ignored by the family)", None, Shard.DROP)


@dataclass(frozen=True)
class Match:
    row: Row
    layer: int | None
    expert: int | None = None


class NameTable:
    """The enabled rows of a family for one model, matched against HF names."""

    def __init__(self, family: Family, params: Any):
        self.family = family
        self.params = params
        self.rows = tuple(r for r in family.rows if r.when is None or bool(getattr(params, r.when)))
        self._patterns = [(re.compile(_pattern_regex(r.hf)), r) for r in self.rows]

    def match(self, hf_name: str) -> Match | None:
        if self.family.ignore is not None and self.family.ignore(self.params, hf_name):
            return Match(IGNORED, None)
        for regex, row in self._patterns:
            m = regex.fullmatch(hf_name)
            if m is None:
                continue
            layer = int(m.group("layer")) if row.per_layer else None
            if layer is not None and layer >= self.params.num_hidden_layers:
                return None  # a block past num_hidden_layers: config and weights disagree
            if layer is not None and not self.holds(row, layer):
                continue  # a dense MLP's tensor in a mixture-of-experts layer, or the other way round
            expert = int(m.group("expert")) if row.per_expert else None
            if expert is not None and expert >= self.params.num_experts:
                return None  # an expert past num_local_experts
            return Match(row, layer, expert)
        return None

    def expected(self) -> list[tuple[str, Match]]:
        """Every HF name the enabled non-DROP rows require, in table order per layer."""
        out = []
        for row in self.rows:
            if row.shard is Shard.DROP:
                continue
            layers = [i for i in range(self.params.num_hidden_layers) if self.holds(row, i)] if row.per_layer else [None]
            experts: list[int | None] = list(range(self.params.num_experts)) if row.per_expert else [None]
            for layer in layers:
                for expert in experts:
                    out.append((hf_name(row, layer, expert), Match(row, layer, expert)))
        return out

    def holds(self, row: Row, layer: int) -> bool:
        """Whether decoder layer `layer` holds the tensor of `row` (Row.layers)."""
        if row.layers is None:
            return True
        if row.layers == "nextn":
            return self.params.is_mtp_layer(layer)
        return self.params.is_moe_layer(layer) == (row.layers == "moe")

    def unmatched_error(self, names: list[str], origin: str) -> ToolchainError:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return ToolchainError(
            f"{origin}: {len(names)} tensor(s) match no {self.family.name} table row: {shown}",
            "the checkpoint does not fit its config.json (architecture, num_hidden_layers, attention_bias, mlp_bias)",
        )


def _pattern_regex(pattern: str) -> str:
    # "{any}" (DROP rows only: a multimodal checkpoint's vision tower) matches any rest of a name
    return (re.escape(pattern).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
            .replace(re.escape("{expert}"), r"(?P<expert>\d+)").replace(re.escape("{any}"), r".+"))


def hf_name(row: Row, layer: int | None, expert: int | None = None) -> str:
    name = row.hf.replace("{layer}", str(layer)) if layer is not None else row.hf
    return name.replace("{expert}", str(expert)) if expert is not None else name


def trt_name(row: Row, local_layer: int | None) -> str:
    if row.trt is None:
        raise ValueError(f"row {row.hf} has no TensorRT-LLM name")
    return row.trt.replace("{layer}", str(local_layer)) if local_layer is not None else row.trt


# Named transforms applied to an HF tensor before sharding. They must work on
# meta tensors too: the dry-run plan runs them to learn shapes without reading data.
def _transpose(t: torch.Tensor) -> torch.Tensor:
    # HF GPT-2 style Conv1D stores (in, out); the checkpoint wants (out, in) (TensorRT-LLM
    # tensorrt_llm/models/gpt/convert.py).
    return t.transpose(0, 1).contiguous()


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    # Gemma's RMSNorm scales by (1 + w); TensorRT-LLM's by w, so the converter stores w + 1, added in
    # float32 (tensorrt_llm/models/gemma/convert.py, load_gemma_weights: "param = param + 1.0").
    return t.float() + 1.0


TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transpose": _transpose,
    "plus_one": _plus_one,
}
