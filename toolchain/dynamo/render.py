"""Target llmapi: the Dynamo deployment of a GPU host as command lines.

    python -m dynamo.frontend --http-port P --router-mode kv ...        OpenAI endpoint, tokenizer, router
    python3 -m dynamo.trtllm --model M --extra-engine-args YAML ...     one per worker (tp x pp GPUs each)

The workers take the spec's LLM-API YAML as it is: the trtllm-serve.yaml `toolchain model-repo` writes
(toolchain/llmapi/args.py serve_config), which dynamo.trtllm merges over its own flags
(dynamo/trtllm/workers/llm_worker.py: update_llm_args_with_extra_options). Disaggregated workers take the same
YAML plus, through --override-engine-args, the two keys Dynamo's own prefill/decode engine configs add
(examples/backends/trtllm/engine_configs/qwen3/{prefill,decode}.yaml): the cache transceiver that moves the KV
cache from prefill to decode, and the overlap scheduler off on prefill workers. With router kv the workers publish
their KV-block events (--publish-kv-events), which the frontend's KV router indexes.

A role whose settings differ from the shared ones (dynamo.prefill / dynamo.decode: tp, max_batch_size,
max_num_tokens, the KV cache's share) says so twice: as dynamo.trtllm's own flags, and as the same LLM() keys in its
--override-engine-args. The flags alone would not hold: the worker builds LLM()'s arguments from its flags, then
merges the --extra-engine-args YAML over them (which names tensor_parallel_size, max_batch_size, max_num_tokens and
kv_cache_config, the shared values), then deep-merges --override-engine-args last (ai-dynamo 1.6.1 wheel,
dynamo/trtllm/workers/llm_worker.py: arg_map, update_llm_args_with_extra_options, deep_update).

One host, no etcd or NATS: file discovery, the TCP request plane and the ZMQ event plane, as on CPU. Worker i
gets GPUs [i*w, (i+1)*w) of the host (w = tp x pp) through CUDA_VISIBLE_DEVICES. Every flag is looked up in
the facts read from Dynamo 1.6.1 (flags.py); the override keys are checked against TensorRT-LLM 1.2.1's
TorchLlmArgs (facts/llmapi.json). Note: Dynamo 1.6.1's trtllm extra pins a newer TensorRT-LLM
(facts release.trtllm_extra_pin) than the 1.2.1 this toolchain checks the YAML against.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from toolchain import upstream
from toolchain.dynamo import flags
from toolchain.dynamo.checks import DISAGG_KEYS, check
from toolchain.dynamo.roles import role_changes, role_values
from toolchain.spec import DeploymentSpec
from toolchain.workspace import Workspace
from toolchain.llmapi.args import llm_args_problem
from toolchain.llmapi.launch import serve_config_path, served_model_name
from toolchain.llmapi.stage import served_model_dir

# dynamo.trtllm's components per role (dynamo/trtllm/args.py _default_endpoint): prefill workers register
# under their own component, which is how the frontend tells the two tiers apart.
COMPONENTS = {"agg": "backend", "decode": "backend", "prefill": "prefill"}


@dataclass
class WorkerGroup:
    """Replicas of one dynamo.trtllm command: aggregated, prefill or decode."""

    role: str
    replicas: int
    argv: list[str]
    gpus: int
    overrides: dict[str, Any] = field(default_factory=dict)


# A role's setting -> (dynamo.trtllm's flag, the LLM() key path it sets; Dynamo 1.6.1 backend_args.py and
# llm_worker.py's arg_map).
ROLE_FLAGS = {"tp": ("--tensor-parallel-size", ("tensor_parallel_size",)),
              "max_batch_size": ("--max-batch-size", ("max_batch_size",)),
              "max_num_tokens": ("--max-num-tokens", ("max_num_tokens",)),
              "kv_cache_free_gpu_mem_fraction": ("--free-gpu-memory-fraction",
                                                 ("kv_cache_config", "free_gpu_memory_fraction"))}


def role_overrides(role: str, spec: DeploymentSpec | None = None) -> dict[str, Any]:
    """What a prefill or decode worker sets over the aggregated YAML: the keys Dynamo's example engine configs
    add, and the role's own settings where they differ from the shared ones (`spec`); checked against the LLM()
    arguments of TensorRT-LLM 1.2.1."""

    if role == "agg":
        return {}
    doc = upstream.facts("dynamo")["examples"][f"engine_{role}"]["doc"]
    out = {key: doc[key] for key in DISAGG_KEYS if key in doc}
    for name, value in (role_changes(spec, role) if spec is not None else {}).items():
        *parents, last = ROLE_FLAGS[name][1]
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    problem = llm_args_problem(out, partial=True)
    if problem:
        raise LookupError(f"Dynamo's {role} engine keys are not TensorRT-LLM 1.2.1 LLM() arguments: {problem}")
    return out


def plane_flags(section: str) -> list[str]:
    f = flags.frontend if section == "frontend" else flags.worker
    return [f("--discovery-backend"), "file", f("--request-plane"), "tcp", f("--event-plane"), "zmq"]


def frontend_command(spec: DeploymentSpec, *, planes: bool = True, namespace: bool = True) -> list[str]:
    f = flags.frontend
    d = spec.dynamo
    argv = ["python3", "-m", "dynamo.frontend", f("--http-port"), str(d.http_port), f("--router-mode"), d.router,
            f("--migration-limit"), str(d.migration_limit)]
    if namespace:
        argv += [f("--namespace"), d.namespace]
    return argv + (plane_flags("frontend") if planes else [])


def worker_command(spec: DeploymentSpec, workspace: Workspace, role: str, *, engine_args: str | None = None,
                   model: str | None = None, planes: bool = True, namespace: bool = True) -> list[str]:
    """`python3 -m dynamo.trtllm` for `role` (agg, prefill, decode); `engine_args` and `model` replace the host
    paths (the Kubernetes manifest mounts them elsewhere)."""

    w = flags.worker
    argv = ["python3", "-m", "dynamo.trtllm", w("--model"), model or str(served_model_dir(spec, workspace)),
            w("--served-model-name"), served_model_name(spec),
            w("--extra-engine-args"), engine_args or str(serve_config_path(spec, workspace)),
            w("--kv-block-size"), str(spec.build.tokens_per_block)]
    if role != "agg":
        if role not in flags.choices("trtllm_worker", "--disaggregation-mode"):
            raise LookupError(f"dynamo.trtllm has no --disaggregation-mode {role}")
        for name, value in role_changes(spec, role).items():
            argv += [w(ROLE_FLAGS[name][0]), str(value)]
        argv += [w("--disaggregation-mode"), role,
                 w("--override-engine-args"), json.dumps(role_overrides(role, spec), separators=(",", ":"))]
    if spec.dynamo.router == "kv":
        argv.append(w("--publish-kv-events"))
    if namespace:
        argv += [w("--namespace"), spec.dynamo.namespace]
    return argv + (plane_flags("worker") if planes else [])


def worker_groups(spec: DeploymentSpec, workspace: Workspace, **kwargs: Any) -> list[WorkerGroup]:
    return [WorkerGroup(role, n, worker_command(spec, workspace, role, **kwargs), role_gpus(spec, role),
                        role_overrides(role, spec)) for role, n in roles(spec)]


def roles(spec: DeploymentSpec) -> list[tuple[str, int]]:
    """(role, workers) of the deployment: aggregated workers, or prefill and decode ones."""
    d = spec.dynamo
    return [("prefill", d.prefill_workers), ("decode", d.decode_workers)] if d.disaggregated else [("agg", d.workers)]


def role_gpus(spec: DeploymentSpec, role: str) -> int:
    """GPUs of one worker of `role`: its tp x pp."""
    tp = spec.parallelism.tp if role == "agg" else role_values(spec, role)["tp"]
    return tp * spec.parallelism.pp


def gpu_commands(spec: DeploymentSpec, workspace: Workspace) -> list[str]:
    """Shell lines starting the whole deployment on GPU hosts: the frontend, then each worker with its GPUs."""
    check(spec)
    lines = [shlex.join(frontend_command(spec)) + " &"]
    next_gpu = 0
    for group in worker_groups(spec, workspace):
        for _ in range(group.replicas):
            devices = ",".join(str(g) for g in range(next_gpu, next_gpu + group.gpus))
            next_gpu += group.gpus
            lines.append(f"CUDA_VISIBLE_DEVICES={devices} {shlex.join(group.argv)} &")
    return lines


def gpus_needed(spec: DeploymentSpec) -> int:
    return sum(n * role_gpus(spec, role) for role, n in roles(spec))


def version_note() -> str:
    pin = flags.trtllm_pin()
    return (f"Dynamo's TensorRT-LLM worker image carries {pin} (ai-dynamo's trtllm extra); the LLM-API YAML is "
            "checked against TensorRT-LLM 1.2.1's TorchLlmArgs") if pin else ""
