"""The spec's `dynamo` section: NVIDIA Dynamo deployments of the LLM-API path (`toolchain dynamo`), and, when
disaggregated, what each role (prefill, decode) runs with where it differs from the shared settings.

A role's settings become flags of its `python3 -m dynamo.trtllm` command and keys of its --override-engine-args
(toolchain/dynamo/render.py); their names are dynamo.trtllm's own (Dynamo 1.6.1 dynamo/trtllm/backend_args.py:
--tensor-parallel-size, --max-batch-size, --max-num-tokens, --free-gpu-memory-fraction). Unset, a role runs with
the spec's parallelism.tp, limits and serving.kv_cache_free_gpu_mem_fraction, as every worker did before roles
existed, and such a spec hashes as it did then (spec.py spec_hash).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from toolchain.spec_section import Section as _Section

ROLES = ("prefill", "decode")


class RoleSection(_Section):
    """One role of a disaggregated deployment; every field unset takes the spec's shared value."""

    tp: int | None = Field(None, ge=1, le=64)
    """Tensor-parallel size of each of the role's workers (default: parallelism.tp); pp stays parallelism.pp."""
    max_batch_size: int | None = Field(None, ge=1)
    """Most requests one worker of the role runs at once (default: limits.max_batch_size)."""
    max_num_tokens: int | None = Field(None, ge=1)
    """Most tokens one step of the role's worker runs (default: limits.max_num_tokens): a prefill worker's prompt
    budget per step, a decode worker's generating sequences per step."""
    kv_cache_free_gpu_mem_fraction: float | None = Field(None, gt=0, lt=1)
    """Share of the free GPU memory the role's KV cache takes (default: serving.kv_cache_free_gpu_mem_fraction)."""

    @property
    def given(self) -> dict[str, int | float]:
        """The fields set, by name."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class DynamoSection(_Section):
    """NVIDIA Dynamo (`toolchain dynamo`): an OpenAI frontend with a router in front of several engine workers."""

    workers: int = Field(2, ge=1, le=64)
    """Aggregated workers behind the router: replicas of `python3 -m dynamo.trtllm` (target llmapi, each tp x pp
    GPUs) or CPU-engine processes on this host (target llmapi-cpu)."""
    router: Literal["kv", "round-robin", "random", "least-loaded"] = "kv"
    """The frontend's --router-mode: kv sends each request to the worker whose cached KV blocks cover most of its
    prompt (the workers publish KV-block events; needs build.kv_cache_reuse); the others ignore the caches."""
    disaggregated: bool = False
    """Target llmapi: separate prefill and decode workers (dynamo.trtllm --disaggregation-mode prefill|decode,
    the KV cache sent from one to the other); prefill_workers and decode_workers count them instead of workers."""
    prefill_workers: int = Field(1, ge=1, le=64)
    """Prefill workers when disaggregated."""
    decode_workers: int = Field(1, ge=1, le=64)
    """Decode workers when disaggregated."""
    prefill: RoleSection = Field(default_factory=RoleSection)
    """When disaggregated: what each prefill worker runs with where it differs from the shared settings."""
    decode: RoleSection = Field(default_factory=RoleSection)
    """When disaggregated: what each decode worker runs with where it differs from the shared settings."""
    http_port: int = Field(8000, ge=0, le=65535)
    """Port of the frontend's OpenAI endpoint (Dynamo's default 8000); 0 picks a free one (target llmapi-cpu)."""
    namespace: str = Field("dynamo", pattern=r"^[a-z0-9][a-z0-9-]*$")
    """Dynamo namespace the workers register in and the frontend discovers (--namespace; Dynamo's default)."""
    migration_limit: int = Field(3, ge=0, le=16)
    """The frontend's --migration-limit: how often a request whose worker died or disconnected moves on to another
    worker, carrying its tokens so far (0: such a request fails with an error)."""
    image: str | None = None
    """Container image of the Kubernetes manifest; default nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:<the pinned
    Dynamo release>."""
    startup_timeout_s: float = Field(180.0, gt=0)
    """Seconds `toolchain dynamo` waits for the frontend to list the model with every worker registered (CPU)."""

    @property
    def roles_given(self) -> bool:
        return any(getattr(self, r).given for r in ROLES)

    def role(self, name: str) -> RoleSection:
        return self.prefill if name == "prefill" else self.decode

    @model_validator(mode="after")
    def _roles_need_disaggregation(self) -> "DynamoSection":
        if self.roles_given and not self.disaggregated:
            given = [f"dynamo.{r}.{k}" for r in ROLES for k in getattr(self, r).given]
            raise ValueError(f"{', '.join(given)} set a role of a disaggregated deployment, and dynamo.disaggregated "
                             "is false; set dynamo.disaggregated: true or remove them")
        return self


def role_gpus_problem(d: DynamoSection, tp: int, pp: int, gpus: int | None) -> str | None:
    """Why the disaggregated workers do not fit parallelism.gpus (when the spec states it), or None."""
    if not d.disaggregated or gpus is None:
        return None
    tp_p, tp_d = d.prefill.tp or tp, d.decode.tp or tp
    need = (d.prefill_workers * tp_p + d.decode_workers * tp_d) * pp
    if need <= gpus:
        return None
    return (f"dynamo prefill {d.prefill_workers} x tp {tp_p} + decode {d.decode_workers} x tp {tp_d} workers (pp {pp}) "
            f"take {need} GPUs but parallelism.gpus is {gpus}; lower the workers or a role's tp, or raise "
            "parallelism.gpus")
