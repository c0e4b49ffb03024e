"""A disaggregated deployment's roles as specs: the spec each prefill or decode worker runs, its shared fields
replaced by the role's settings (spec_dynamo.RoleSection), so the memory plan, the checks and the prediction of
one role are those of an ordinary spec and no stage reads the dynamo section twice."""

from __future__ import annotations

from typing import Any

from toolchain.errors import ToolchainError
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
