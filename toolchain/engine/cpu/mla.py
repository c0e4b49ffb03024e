"""Multi-head latent attention (DeepSeek-V3) on the CPU engine, with its latent KV cache.

The checkpoint is this toolchain's own layout (archs/deepseek_v3.py: no upstream engine checkpoint exists for V3);
its config.json's `deepseek_v3` section gives the ranks. Per TP rank (transformers 5.25
models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3Attention):
- the latent: kv_a_proj_with_mqa(x) = [c | k_rope]; c RMS-normed by kv_a_layernorm, k_rope rotated. One entry of
  kv_lora_rank + qk_rope_head_dim values per token per layer is what the cache holds, as TensorRT-LLM's PyTorch
  backend allocates an MLA cache (CacheType.SELFKONLY, num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim:
  _torch/pyexecutor/_util.py; notes i36-facts §3.5). Every rank computes it from its whole copy of the latent
  projection and keeps it in its own pool (kv_cache.py `cache_widths`), as every GPU of a tp group holds it;
- queries: q_b_proj(q_a_layernorm(q_a_proj(x))), this rank's heads of [q_nope | q_rope], q_rope rotated;
- keys and values from the cached latents through this rank's rows of kv_b_proj: per head [k_nope | v], the key
  [k_nope | k_rope] with k_rope shared by the heads (the "naive" form; upstream's generation kernels absorb kv_b
  into q and o instead, which is the same product);
- the softmax scale qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (yarn_apply_mscale in
  transformers' modeling_rope_utils.py); the output through o_proj (attention.dense), row-parallel.
Rope runs over qk_rope_head_dim with YaRN's frequencies and cos/sin factor when rotary_scaling is yarn
(_compute_yarn_parameters, the same float32 operations), on interleaved pairs when rope_interleave
(apply_rotary_pos_emb_interleave: even and odd dims de-interleaved, then rotated as rotate_half pairs).
Each projection runs in its stored format (engine/cpu/qlinear.py): float, or the released checkpoints' FP8 block
scales (imported as stored, archs/deepseek_v3.py), a projection the checkpoint keeps in bf16 staying float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from toolchain.engine.cpu.linear import Linear
from toolchain.engine.cpu.qlinear import make_linear, stored_tensors
from toolchain.engine.cpu.rope import Rotary, apply_rotary
from toolchain.engine.cpu.routing import GroupedRouting
from toolchain.engine.cpu.yarn import attention_factor, yarn_frequencies, yarn_mscale
from toolchain.errors import ToolchainError

_REBUILD = "reconvert the checkpoint and rebuild the engine with --force"
# the weights as DeepSeek-V3 is run here: unquantized, or the released checkpoints' FP8 block scales (imported as
# stored: archs/deepseek_v3.py); the KV cache unquantized (the first two)
STORED_ALGOS = (None, "NO_QUANT", "FP8_BLOCK_SCALES")
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
SECTION = "deepseek_v3"  # the checkpoint config.json's section (archs/deepseek_v3.py config_extra)
_INTS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
         "first_k_dense_replace", "n_group", "topk_group", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class MlaDims:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    yarn: dict | None
    """The rotary_scaling of type yarn, or None for plain rope."""

    @property
    def latent_width(self) -> int:
        """Values one token's cache entry holds per layer: the normed latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse(cfg: dict, origin: str, *, tp: int, heads: int, intermediate: int, quant: tuple[Any, Any]) -> dict:
    """ModelDims fields of a DeepSeek-V3 checkpoint config: `mla`, `dense_layers`, `grouped_routing`, the expert
    widths and `shared_expert_gate` (none); one-line errors for what the CPU engine cannot run."""
    raw = cfg.get(SECTION)
    if not isinstance(raw, dict):
        raise ToolchainError(f"{origin}: a {cfg.get('architecture')} config needs its '{SECTION}' section", _REBUILD)
    values = {}
    for key in _INTS:
        value = raw.get(key)
        least = 0 if key == "first_k_dense_replace" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ToolchainError(f"{origin}: {SECTION}.{key} must be an integer >= {least}, got {value!r}", _REBUILD)
        values[key] = value
    scale = raw.get("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ToolchainError(f"{origin}: {SECTION}.routed_scaling_factor must be a positive number", _REBUILD)
    scaling = cfg.get("rotary_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else scaling
    if kind not in (None, "none", "default", "yarn"):
        raise ToolchainError(f"{origin}: rotary_scaling type {kind!r} with multi-head latent attention",
                             "the CPU engine runs DeepSeek-V3 with yarn or plain rope")
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads {heads} not divisible by tp {tp}")
    if values["first_k_dense_replace"] and intermediate % tp:
        problems.append(f"intermediate_size {intermediate} of the dense layers not divisible by tp {tp}")
    if values["qk_rope_head_dim"] % 2:
        problems.append(f"qk_rope_head_dim {values['qk_rope_head_dim']} is odd (rope rotates pairs)")
    if quant[0] not in STORED_ALGOS or quant[1] not in STORED_ALGOS[:2]:
        problems.append(f"quant_algo {quant[0]}, kv_cache_quant_algo {quant[1]} (DeepSeek-V3 runs unquantized or in "
                        "its released checkpoints' FP8 block scales here, its latent cache in float32)")
    if problems:
        raise ToolchainError(f"{origin}: " + "; ".join(problems), _REBUILD)
    mla = MlaDims(values["q_lora_rank"], values["kv_lora_rank"], values["qk_nope_head_dim"],
                  values["qk_rope_head_dim"], values["v_head_dim"], bool(raw.get("rope_interleave", True)),
                  dict(scaling) if kind == "yarn" else None)
    mtp = cfg.get("num_nextn_predict_layers", 0)  # the MTP layers convert kept (checkpoint/mtp.py), 0: none
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ToolchainError(f"{origin}: num_nextn_predict_layers must be an integer >= 0, got {mtp!r}", _REBUILD)
    if mtp and int(cfg.get("mapping", {}).get("pp_size", 1)) > 1:
        raise ToolchainError(f"{origin}: MTP layers with pp_size > 1 (PP + MTP combination is not supported)", _REBUILD)
    return {"mla": mla, "dense_layers": values["first_k_dense_replace"], "mtp_layers": mtp,
            "grouped_routing": GroupedRouting(values["n_group"], values["topk_group"], float(scale)),
            "expert_size": values["moe_intermediate_size"],
            "shared_expert_size": values["shared_expert_intermediate_size"], "shared_expert_gate": False}


# -- rope -------------------------------------------------------------------------------------------------------


def rotary(m: MlaDims, base: float) -> Rotary:
    """The rope tables over qk_rope_head_dim: plain, or YaRN's frequencies with its cos/sin factor."""
    table = Rotary(m.qk_rope_head_dim, base, None)
    if m.yarn is not None:
        table.inv_freq, table.scale = yarn_frequencies(m.qk_rope_head_dim, base, m.yarn), attention_factor(m.yarn)
    return table


def softmax_scale(m: MlaDims) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = m.qk_head_dim ** -0.5
    if m.yarn is not None and m.yarn.get("mscale_all_dim"):
        scale *= yarn_mscale(m.yarn["factor"], m.yarn["mscale_all_dim"]) ** 2
    return scale


# -- weights ----------------------------------------------------------------------------------------------------


@dataclass
class MlaShard:
    """One layer's latent projections (whole) and this rank's heads of q_b_proj and kv_b_proj."""

    q_a: Linear
    q_a_norm: torch.Tensor
    q_b: Linear
    kv_a: Linear
    kv_a_norm: torch.Tensor
    kv_b: Linear


def tensors(m: MlaDims, prefix: str, hidden: int, heads_per_rank: int,
            fmt: Callable[[str], str | None]) -> dict[str, tuple[tuple[int, ...], str]]:
    """What one rank holds of one layer's MLA (archs/deepseek_v3.py ROWS), beside attention.dense; each projection in
    its stored format (`fmt`: the module's name after the layer prefix -> qlinear format, None for float)."""
    a = f"{prefix}.attention"
    shapes = {"q_a_proj": (m.q_lora_rank, hidden), "q_b_proj": (heads_per_rank * m.qk_head_dim, m.q_lora_rank),
              "kv_a_proj_with_mqa": (m.latent_width, hidden),
              "kv_b_proj": (heads_per_rank * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)}
    out: dict[str, tuple[tuple[int, ...], str]] = {f"{a}.q_a_layernorm.weight": ((m.q_lora_rank,), "float"),
                                                   f"{a}.kv_a_layernorm.weight": ((m.kv_lora_rank,), "float")}
    for name, (rows, cols) in shapes.items():
        out.update(stored_tensors(f"{a}.{name}", rows, cols, False, fmt(f"attention.{name}")))
    return out


def load(t: dict[str, torch.Tensor], prefix: str, fmt: Callable[[str], str | None]) -> MlaShard:
    a = f"{prefix}.attention"
    q_a, q_b, kv_a, kv_b = (make_linear(t, f"{a}.{name}", False, fmt(f"attention.{name}")) for name in LINEARS)
    return MlaShard(q_a=q_a, q_a_norm=t[f"{a}.q_a_layernorm.weight"], q_b=q_b, kv_a=kv_a,
                    kv_a_norm=t[f"{a}.kv_a_layernorm.weight"], kv_b=kv_b)


def replicas(prefix: str, a: MlaShard | None, b: MlaShard | None) -> list[tuple[str, Any, Any]]:
    """The tensors every rank holds whole, paired for weights.check_replicas."""
    if a is None or b is None:
        return []
    p = f"{prefix}.attention"
    # the projections compared as their values (an FP8 block-scale one: its dequantized weight, tiles and scales)
    return [(f"{p}.q_a_proj.weight", _values(a.q_a), _values(b.q_a)),
            (f"{p}.q_a_layernorm.weight", a.q_a_norm, b.q_a_norm),
            (f"{p}.kv_a_proj_with_mqa.weight", _values(a.kv_a), _values(b.kv_a)),
            (f"{p}.kv_a_layernorm.weight", a.kv_a_norm, b.kv_a_norm)]


def _values(linear: Linear) -> torch.Tensor:
    dequantized = getattr(linear, "dequantized", None)
    return dequantized() if dequantized is not None else linear.weight


# -- attention --------------------------------------------------------------------------------------------------


class MlaAttention:
    def __init__(self, m: MlaDims, eps: float):
        self.m = m
        self.eps = eps
        self.scale = softmax_scale(m)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.m.rope_interleave:  # pairs (0, 1), (2, 3), ...: de-interleaved first (apply_rotary_pos_emb_interleave)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def __call__(self, w: MlaShard, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                 batch: Any) -> torch.Tensor:
        """This rank's attention output [N, heads_r x v_head_dim] for normed hidden states h [N, H]; writes the
        tokens' latents into `pool` [slots, 1, latent_width] at batch.write and reads each group's back."""
        m, n = self.m, h.shape[0]
        compressed = w.kv_a(h)
        latent = self._norm(compressed[:, : m.kv_lora_rank], w.kv_a_norm)
        k_rope = self._rope(compressed[:, None, m.kv_lora_rank:], cos, sin)
        pool.index_copy_(0, batch.write, torch.cat([latent[:, None], k_rope], dim=-1))
        q = w.q_b(self._norm(w.q_a(h), w.q_a_norm)).view(n, -1, m.qk_head_dim)
        heads = q.shape[1]
        q = torch.cat([q[..., : m.qk_nope_head_dim], self._rope(q[..., m.qk_nope_head_dim:], cos, sin)], dim=-1)
        out = torch.empty(n, heads * m.v_head_dim)
        for g in batch.groups:
            keys = g.slots.shape[1]
            cached = pool.index_select(0, g.flat_slots).view(g.batch, keys, m.latent_width)
            kv = w.kv_b(cached[..., : m.kv_lora_rank]).view(g.batch, keys, heads, -1)
            shared = cached[:, :, None, m.kv_lora_rank:].expand(g.batch, keys, heads, m.qk_rope_head_dim)
            key = torch.cat([kv[..., : m.qk_nope_head_dim], shared], dim=-1)
            value = kv[..., m.qk_nope_head_dim:]
            query = q[g.q_index].view(g.batch, g.q_len, heads, m.qk_head_dim).transpose(1, 2)
            causal = g.plain_causal(None)
            o = F.scaled_dot_product_attention(query, key.transpose(1, 2), value.transpose(1, 2),
                                               attn_mask=None if causal else g.mask(None), is_causal=causal,
                                               scale=self.scale)
            out[g.tokens] = o.transpose(1, 2).reshape(g.batch * g.q_len, -1)[g.valid]
        return out
