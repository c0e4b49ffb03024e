"""What LoRA adapters add to a step: per token and adapted module a shrink GEMM (in x r) and an expand GEMM
(r x out), 2 x r x (localIn + localOut) FLOPs on a rank, and per step each distinct adapter's weights on the rank
read once (its bytes: r x (localIn + localOut) x dtype per module and layer). Derived from the adapters' shapes
(the PyTorch backend's LoraLayer and the engine's lora plugin run these two GEMMs per module; the FLOP count is
reasoned, not an upstream figure: /work/notes/i38-facts-llmapi.md §1e). The adapters' GEMMs are counted at the
half-precision peak whatever the base's format, as the adapters stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolchain.archs.params import ArchParams
from toolchain.plan.lora import base_dims, local_dims, resolved


@dataclass(frozen=True)
class LoraLoad:
    """The adapters a stage's rank runs for the workload's mix: (share of requests, FLOPs per token, bytes) each;
    the base's own requests (share 1 - the sum) add nothing."""

    adapters: tuple[tuple[float, float, float], ...]

    @property
    def flops_per_token(self) -> float:
        """Expected FLOPs per token of the step (a token runs its request's adapter only)."""
        return sum(share * flops for share, flops, _ in self.adapters)

    def bytes_read(self, sequences: float) -> float:
        """Expected bytes of the distinct adapters `sequences` sequences use in one step: an adapter is read once
        if any of them uses it, which misses it with chance (1 - share) each (requests drawn by share)."""
        return sum((1.0 - (1.0 - share) ** sequences) * nbytes for share, _, nbytes in self.adapters)


def module_flops(rank: int, d_in: int, d_out: int, module: str, tp: int) -> float:
    """FLOPs per token of one adapted module on one rank: the shrink (x A^T, in -> r) and the expand (x B^T,
    r -> out), a multiply and an add each, on the rank's slice."""
    return 2.0 * rank * sum(local_dims((d_in, d_out), module, tp))


def lora_load(spec, p: ArchParams, layers: range, tp: int, dtype_bytes: int) -> tuple[LoraLoad | None, str | None]:
    """The LoRA work of a rank holding `layers` at `tp` for the spec's workload, and a note on what it assumes;
    (None, None) without LoRA or with adapters the plan cannot read (the lora.adapters check says why)."""
    setup = resolved(spec)
    if setup is None:
        return None, None
    dims = base_dims(p)
    per_adapter = {}
    for a in setup.adapters:
        flops = sum(module_flops(r, d_in, d_out, m, tp)
                    for (layer, m), ((r, d_in), (d_out, _)) in a.shapes.items() if layer in layers)
        per_adapter[a.name] = (flops, flops / 2 * dtype_bytes)
    classes = spec.validation.workload.classes
    total = sum(c.share for c in classes)
    mix = [(c.share / total, *per_adapter[c.adapter]) for c in classes if c.adapter in per_adapter]
    if mix:
        return LoraLoad(tuple(mix)), None
    # No workload class names an adapter: every request is taken to use the largest one (the spec's adapter of the
    # highest rank, or a max_lora_rank adapter on every target module when adapters come per request only), so
    # the prediction is the slowest the adapters make it.
    if per_adapter:
        name = max(setup.adapters, key=lambda a: (a.rank, per_adapter[a.name][0])).name
        flops, nbytes = per_adapter[name]
        what = f"LoRA adapter {name!r}"
    else:
        flops = sum(module_flops(setup.max_lora_rank, *dims[m], m, tp) for m in setup.target_modules) * len(layers)
        nbytes = flops / 2 * dtype_bytes
        what = f"a rank-{setup.max_lora_rank} LoRA adapter on {', '.join(setup.target_modules)}"
    return LoraLoad(((1.0, flops, nbytes),)), (f"no validation.workload class names a LoRA adapter: every request "
                                               f"is predicted with {what}, the largest")
