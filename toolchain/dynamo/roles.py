"""A disaggregated deployment's roles as specs: the spec each prefill or decode worker runs, its shared fields
replaced by the role's settings (spec_dynamo.RoleSection), so the memory plan, the checks and the prediction of
one role are those of an ordinary spec and no stage reads the dynamo section twice; and the split those roles make
for the prediction (plan/perf/disagg.py), which `toolchain plan` and `toolchain tune` both read."""

from __future__ import annotations

from typing import Any

from toolchain.errors import ToolchainError
from toolchain.gpus import Gpu
from toolchain.plan import memory as mem
from toolchain.plan import perf
from toolchain.plan.model import ModelInfo, kv_dtype, kv_dtype_bytes
from toolchain.plan.perf.disagg import Role, Split, predict_disagg
from toolchain.plan.plan import MemoryPlan
from toolchain.quant.view import Quantization
from toolchain.spec import DeploymentSpec
from toolchain.spec_dynamo import ROLES

# RoleSection field -> the shared spec field it replaces for that role.
SHARED = {"tp": ("parallelism", "tp"), "max_batch_size": ("limits", "max_batch_size"),
          "max_num_tokens": ("limits", "max_num_tokens"),
          "kv_cache_free_gpu_mem_fraction": ("serving", "kv_cache_free_gpu_mem_fraction")}


def role_values(spec: DeploymentSpec, role: str) -> dict[str, Any]:
    """What a worker of `role` runs with, every RoleSection field resolved (the role's, else the shared one)."""
    given = spec.dynamo.role(role).given
    return {k: given.get(k, getattr(getattr(spec, section), name)) for k, (section, name) in SHARED.items()}


def role_changes(spec: DeploymentSpec, role: str) -> dict[str, Any]:
    """The role's settings that differ from the shared ones (what its command must carry)."""
    return {k: v for k, v in role_values(spec, role).items()
            if v != getattr(getattr(spec, SHARED[k][0]), SHARED[k][1])}


def role_spec(spec: DeploymentSpec, role: str) -> DeploymentSpec:
    """The spec one worker of `role` runs: the role's settings in the shared fields, parallelism.gpus its own
    tp x pp, and one aggregated worker (what `toolchain plan` of one worker would read)."""
    if role not in ROLES:
        raise ValueError(f"no Dynamo role {role!r}")
    changes: dict[str, Any] = {".".join(SHARED[k]): v for k, v in role_values(spec, role).items()}
    changes.update({"parallelism.gpus": None, "dynamo.disaggregated": False, "dynamo.prefill": {}, "dynamo.decode": {},
                    "dynamo.workers": 1, "name": f"{spec.name}-{role}"})
    try:
        return spec.derived(changes)
    except ToolchainError as err:
        raise ToolchainError(f"dynamo.{role}: {err.message}") from None


def role_of(spec: DeploymentSpec, model: ModelInfo, quant: Quantization, device: Gpu, memory: MemoryPlan,
            workers: int, draft: ModelInfo | None = None) -> Role:
    """One role for the prediction (`spec`: its role spec, planned into `memory`): its replica, limits, KV pool and
    the KV bytes per token one of its ranks holds (what it sends or receives)."""
    dep, _ = perf.deployment(spec, model, quant, device, draft)
    p, layout = model.params, spec.parallelism.layout
    layers = max(len(r) for r in layout.stage_layers(p.num_hidden_layers))
    per_token = mem.kv_bytes_per_token(p, tp=layout.attn_tp, stage_layer_count=layers,
                                       kv_bytes=kv_dtype_bytes(kv_dtype(spec, p, quant)))
    return Role(dep, workers, spec.limits.max_batch_size, spec.limits.max_num_tokens, memory.kv_tokens_capacity,
                per_token)


def split_of(spec: DeploymentSpec, prefill: Role, decode: Role) -> Split:
    """The split of a disaggregated spec: its workload over the two roles, NVLink between them when all their
    GPUs fit one node of gpu.per_node."""
    wl = spec.validation.workload
    same_node = prefill.gpus + decode.gpus <= spec.gpu.per_node
    return Split(prefill, decode, wl.input_tokens, wl.output_tokens, spec.build.chunked_context,
                 spec.build.tokens_per_block, same_node)


def split_performance(spec: DeploymentSpec, split: Split, device: Gpu, concurrency: int | None = None) -> dict:
    """The split's `performance` object at `concurrency` (default the workload's), labelled with its basis."""
    basis = f"{perf.basis_of(device)}; disaggregated: plan/perf/disagg.py"
    return predict_disagg(split, concurrency or spec.validation.workload.concurrency, spec.gpu.hourly_usd, basis)
