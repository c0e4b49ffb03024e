"""How a deployment is split over its ranks, as one frozen value, and the one rule for which models it splits.

`Layout` holds tp, pp, the experts' moe_tp x moe_ep and the embedding split, built once from the spec
(`ParallelismSection.layout`) or from a converter's options, and what derives from them: the layers of each
pipeline stage and the experts each rank holds. It is the shape of TensorRT-LLM's own tensorrt_llm/mapping.py
`Mapping` (one object every layer reads its split from; moe_tp/moe_ep derived as archs/moe.py `moe_sizes` does,
after MappingBase.__init__). `layout_problems` is the one place a model is checked against a layout, as vLLM
checks a model against its parallel config in one place (vllm/config.py ModelConfig.verify_with_parallel_config):
convert refuses, plan fails a check and skips its memory plan, and the LLM-API stage refuses on the same rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from toolchain.archs import moe


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    given_moe_tp: int | None = None
    """parallelism.moe_tp as the spec gives it (None: derived, see `moe_tp`)."""
    given_moe_ep: int | None = None
    """parallelism.moe_ep as the spec gives it (None: derived, see `moe_ep`)."""
    parallel_embedding: bool = False
    """use_parallel_embedding: the vocab embedding is split over the TP ranks (else every rank holds it whole)."""
    embedding_sharding_dim: int = 0
    """With parallel_embedding: 0 splits the vocabulary rows (padded like lm_head), 1 the hidden columns."""
    attention_dp: bool = False
    """Attention data parallelism (LLM() `enable_attention_dp`, the LLM-API path only): the tp ranks are attention
    data-parallel ranks, each with the whole attention and its own requests' KV (see `attn_tp`)."""

    @classmethod
    def of(cls, par: Any) -> Layout:
        """The layout a spec's `parallelism` section (or a converter's Options, spelled alike) asks for."""
        return cls(par.tp, par.pp, par.moe_tp, par.moe_ep, par.parallel_embedding, par.embedding_sharding_dim,
                   getattr(par, "attention_dp", False))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def moe_tp(self) -> int:
        """Over how many TP ranks each expert's width is split (Mapping.moe_tp_size)."""
        return moe.moe_sizes(self.tp, self.given_moe_tp, self.given_moe_ep)[0]

    @property
    def moe_ep(self) -> int:
        """Over how many TP ranks the experts are divided (Mapping.moe_ep_size)."""
        return moe.moe_sizes(self.tp, self.given_moe_tp, self.given_moe_ep)[1]

    @property
    def attn_tp(self) -> int:
        """Over how many ranks the attention (its heads, KV heads and KV cache) is split: 1 with attention DP, else tp.
        The PyTorch backend's Attention module and KV cache manager both take `tp_size = 1 if
        mapping.enable_attention_dp else mapping.tp_size` (tensorrt_llm/_torch/modules/attention.py
        Attention.__init__; _torch/pyexecutor/resource_manager.py KVCacheManager.get_cache_size_per_token), while
        MappingBase keeps tp_size and reports `dp_size` = tp_size (tensorrt_llm/mapping.py)."""
        return 1 if self.attention_dp else self.tp

    @property
    def embedding_split_hidden(self) -> bool:
        """Whether the embedding's hidden columns are split over tp (use_parallel_embedding, dim 1)."""
        return self.parallel_embedding and self.embedding_sharding_dim == 1

    def with_tp(self, tp: int) -> Layout:
        return dataclasses.replace(self, tp=tp)

    def stage_layers(self, num_layers: int) -> list[range]:
        """Global decoder-layer indices per pipeline stage as TensorRT-LLM 1.x assigns them
        (Mapping.pp_layers: torch.tensor_split over range(L), so the first L % P stages get one extra)."""
        base, extra = divmod(num_layers, self.pp)
        out, start = [], 0
        for stage in range(self.pp):
            n = base + (1 if stage < extra else 0)
            out.append(range(start, start + n))
            start += n
        return out

    def experts_per_rank(self, num_experts: int) -> int:
        """Whole experts each rank holds (Mapping.ep_experts: num_experts / moe_ep contiguous ones)."""
        return num_experts // self.moe_ep


class LayoutProblem(NamedTuple):
    axis: str
    """Which setting it is about: "size", "moe", "embedding", "tp", "pp" or "attention_dp" (callers pick their fix
    by it)."""
    text: str


def layout_problems(params: Any, layout: Layout) -> list[LayoutProblem]:
    """Every divisibility rule TensorRT-LLM asserts when it splits this model so (empty: it splits), in the order
    convert reports them: the expert split (tensorrt_llm/mapping.py, layers/moe.py MixtureOfExperts), the heads, KV
    heads, MLP and embedding over tp (models/convert_utils.py split, dup_kv_weight; layers/embedding.py), the
    layers over pp (Mapping.pp_layers)."""
    tp, pp = layout.tp, layout.pp
    if tp < 1 or pp < 1:
        return [LayoutProblem("size", f"tp={tp}, pp={pp}: both must be at least 1")]
    out = [LayoutProblem("moe", text) for text in
           moe.model_problems(params, tp, layout.given_moe_tp, layout.given_moe_ep)]
    if layout.embedding_sharding_dim not in (0, 1):
        out.append(LayoutProblem("embedding", f"embedding_sharding_dim={layout.embedding_sharding_dim} must be 0 "
                                              "(vocab) or 1 (hidden)"))
    out += [LayoutProblem("tp", text) for text in _tp_rule(params, layout)]
    if pp > params.num_hidden_layers:
        out.append(LayoutProblem("pp", f"pp={pp} exceeds num_hidden_layers={params.num_hidden_layers}"))
    if layout.attention_dp and not getattr(params, "is_moe", False):
        # Upstream runs it on dense models too, but where their MLP goes under it differs per model class (a
        # GatedMLP `overridden_tp_size=1` in some, the tp split in others: tensorrt_llm/_torch/models/), so a plan
        # of one would be a guess; refused rather than planned wrong.
        out.append(LayoutProblem("attention_dp", f"parallelism.attention_dp is planned for mixture-of-experts models; "
                                                 f"{params.architecture} is dense"))
    return out


def _tp_rule(params: Any, layout: Layout) -> list[str]:
    tp = layout.tp
    nh, nkv, inter = params.num_attention_heads, params.num_key_value_heads, params.intermediate_size
    if getattr(params, "is_moe", False) and not params.has_dense_mlp:
        inter = tp  # no dense MLP: the expert width splits over moe_tp only (archs/moe.py model_problems)
    problems = []
    if nh % tp:
        problems.append(f"tp={tp} does not divide num_attention_heads={nh}")
    if nkv >= tp and nkv % tp:
        problems.append(f"tp={tp} does not divide num_key_value_heads={nkv}")
    if nkv < tp and tp % nkv:
        problems.append(f"tp={tp} is not a multiple of num_key_value_heads={nkv} "
                        "(KV heads cannot be duplicated evenly)")
    if inter % tp:
        problems.append(f"tp={tp} does not divide intermediate_size={inter}")
    if layout.embedding_split_hidden and params.hidden_size % tp:
        problems.append(f"tp={tp} does not divide hidden_size={params.hidden_size} (embedding_sharding_dim 1)")
    return problems


def splits_tp(params: Any, layout: Layout, tp: int) -> bool:
    """Whether `tp` alone splits this model's heads, KV heads, MLP and embedding (the experts aside) with the
    rest of `layout` kept: the candidates a refusal suggests."""
    return not any(p.axis in ("size", "tp") for p in layout_problems(params, layout.with_tp(tp)))
