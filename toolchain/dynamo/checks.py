"""The spec combinations a Dynamo deployment refuses, each in one line naming what to change."""

from __future__ import annotations

from toolchain.dynamo import flags
from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec


def problems(spec: DeploymentSpec) -> list[str]:
    d = spec.dynamo
    out = []
    if not spec.llmapi_path:
        out.append(f"Dynamo serves the LLM-API path; target {spec.target} is the engine path (set target: llmapi "
                   "on a GPU host, llmapi-cpu on this one)")
    if d.router not in flags.choices("frontend", "--router-mode"):
        out.append(f"dynamo.router {d.router!r} is not one of the frontend's --router-mode choices")
    if d.router == "kv" and not spec.build.kv_cache_reuse:
        out.append("dynamo.router kv routes by the workers' cached KV blocks, which build.kv_cache_reuse false turns "
                   "off (no block is ever stored); set build.kv_cache_reuse: true or dynamo.router: round-robin")
    if d.disaggregated and spec.target == "llmapi-cpu":
        out.append("dynamo.disaggregated needs KV-cache transfer between prefill and decode workers, which the CPU "
                   "engine does not have; set it on target llmapi (GPU hosts) or serve aggregated here")
    if spec.target == "llmapi" and spec.parallelism.world_size > spec.gpu.per_node:
        out.append(f"one worker of tp x pp = {spec.parallelism.world_size} GPUs spans hosts (gpu.per_node "
                   f"{spec.gpu.per_node}); Dynamo's multinode workers are not rendered yet: keep tp x pp within a host")
    if spec.llmapi_path:
        from toolchain.llmapi.args import options_problem

        why = options_problem(spec)
        if why:
            out.append(why)
    return out


def check(spec: DeploymentSpec) -> None:
    found = problems(spec)
    if found:
        raise ToolchainError(found[0])
