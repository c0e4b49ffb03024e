"""Target llmapi on Kubernetes: a DynamoGraphDeployment (nvidia.com/v1alpha1) and the ConfigMap holding the
LLM-API YAML its workers read.

Laid out as Dynamo's own trtllm examples lay it out (examples/backends/trtllm/deploy/agg_router.yaml, disagg.yaml):
a `Frontend` service (componentType frontend, the router mode as DYN_ROUTER_MODE) and worker services
(componentType worker; subComponentType prefill / decode when disaggregated) whose main container runs
`python3 -m dynamo.trtllm`, each with `resources.limits.gpu` of tp x pp. Every field is one the operator's Go types
declare (facts crd.structs: DynamoGraphDeploymentSpec, DynamoComponentDeploymentSharedSpec, Resources,
ResourceItem, ExtraPodSpec) or a Kubernetes corev1 field (facts kubernetes), and the tests hold the rendered
document to both.

The operator runs discovery (Kubernetes) and names the Dynamo namespace itself ({k8s namespace}-{name}), so the
commands carry no --namespace and no plane flags. The YAML comes from a ConfigMap mounted at /config; the model
directories are mounted from the host at the same paths, as the LeaderWorkerSet manifests of the LLM-API path do
(a shared filesystem or the same paths on every node).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from toolchain import upstream
from toolchain.dynamo import DYNAMO_VERSION, flags
from toolchain.dynamo.checks import check
from toolchain.dynamo.render import worker_groups
from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec
from toolchain.targets import CPU, GPU, LLMAPI, named, require_target
from toolchain.workspace import Workspace
from toolchain.llmapi.manifests import k8s_name
from toolchain.llmapi.launch import container_mounts
from toolchain.llmapi.args import serve_config
from toolchain.fsutil import write_dir

API_VERSION = "nvidia.com/v1alpha1"
IMAGE = f"nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:{DYNAMO_VERSION}"  # the examples' image, at the pinned tag
CONFIG_DIR = "/config"
ENGINE_ARGS = "engine-args.yaml"
FILES = {"graph": "dynamographdeployment.yaml", "config": "engine-args-configmap.yaml"}
SERVICE_NAMES = {"agg": "TRTLLMWorker", "prefill": "TRTLLMPrefillWorker", "decode": "TRTLLMDecodeWorker"}
# The operator fixes the frontend's port: container port "http" = DynamoServicePort 8000, DYN_HTTP_PORT and
# DYNAMO_PORT set to it, probes and the frontend Service on it (ai-dynamo/dynamo@1aaffae0822996eff407ccf8eb1c43823e7c5713
# deploy/operator/internal/dynamo/component_frontend.go; DynamoServicePort in deploy/operator/internal/consts/consts.go
# @d195d280e13e5532510a1004ad8d8d06f2f8266a). Another dynamo.http_port cannot be honoured in the cluster.
OPERATOR_HTTP_PORT = 8000


def _env(flag: str, value: str) -> dict[str, str]:
    """The frontend reads each flag from a variable too (facts frontend.flags[flag].env_var)."""
    return {"name": upstream.facts("dynamo")["frontend"]["flags"][flags.frontend(flag)]["env_var"], "value": value}


def config_map_name(spec: DeploymentSpec) -> str:
    return f"{k8s_name(spec)}-engine-args"


def _volumes(spec: DeploymentSpec, workspace: Workspace) -> tuple[list[dict], list[dict]]:
    volumes: list[dict] = [{"name": "engine-args", "configMap": {"name": config_map_name(spec)}}]
    mounts: list[dict] = [{"name": "engine-args", "mountPath": CONFIG_DIR, "readOnly": True}]
    repo = str(Path(workspace.model_repo_dir(spec)).resolve())
    for i, path in enumerate(p for p in container_mounts(spec, workspace) if p != repo):
        volumes.append({"name": f"model{i}", "hostPath": {"path": path}})
        mounts.append({"name": f"model{i}", "mountPath": path, "readOnly": True})
    return volumes, mounts


def graph_deployment(spec: DeploymentSpec, workspace: Workspace) -> dict[str, Any]:
    require_target(spec, f"the DynamoGraphDeployment is for target {named(LLMAPI, GPU)} (GPU nodes), not {spec.target}",
            f"set target: {named(LLMAPI, GPU)} (target {named(LLMAPI, CPU)} serves on this host with `toolchain "
            "dynamo`)", path=LLMAPI, device=GPU)
    check(spec)
    if spec.dynamo.http_port != OPERATOR_HTTP_PORT:
        raise ToolchainError(f"dynamo.http_port {spec.dynamo.http_port}: the Dynamo operator serves the frontend on "
                             f"port {OPERATOR_HTTP_PORT} (its container port, Service and probes), whatever the "
                             "graph says", f"set dynamo.http_port: {OPERATOR_HTTP_PORT} for --manifests, and reach "
                             f"another port with `kubectl port-forward` to the frontend Service's {OPERATOR_HTTP_PORT}")
    image = spec.dynamo.image or IMAGE
    d = spec.dynamo
    frontend_env = [_env("--router-mode", d.router), _env("--migration-limit", str(d.migration_limit))]
    services: dict[str, Any] = {"Frontend": {
        "componentType": "frontend", "replicas": 1, "envs": frontend_env,
        "extraPodSpec": {"mainContainer": {"image": image}},
    }}
    # No command: the operator starts the frontend for componentType frontend; its flags travel as variables.
    volumes, mounts = _volumes(spec, workspace)
    for group in worker_groups(spec, workspace, engine_args=f"{CONFIG_DIR}/{ENGINE_ARGS}", planes=False,
                               namespace=False):
        service: dict[str, Any] = {"componentType": "worker"}
        if group.role != "agg":
            service["subComponentType"] = group.role
        service.update({
            "replicas": group.replicas,
            "resources": {"limits": {"gpu": str(group.gpus)}},
            "extraPodSpec": {
                "volumes": volumes,
                "mainContainer": {"image": image, "command": group.argv[:3], "args": group.argv[3:],
                                  "volumeMounts": mounts},
            },
        })
        services[SERVICE_NAMES[group.role]] = service
    return {"apiVersion": API_VERSION, "kind": "DynamoGraphDeployment", "metadata": {"name": k8s_name(spec)},
            "spec": {"backendFramework": "trtllm", "services": services}}


def config_map(spec: DeploymentSpec) -> dict[str, Any]:
    text = yaml.safe_dump(serve_config(spec), sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config_map_name(spec)},
            "data": {ENGINE_ARGS: text}}


class _Dumper(yaml.SafeDumper):
    """Plain YAML for kubectl: no anchors for the lists the worker services share, scripts as literal blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def manifests(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    head = f"# Generated by `toolchain dynamo --manifests` from {spec.source or '<spec>'} (deployment '{spec.name}').\n"
    graph = graph_deployment(spec, workspace)
    note = ("# Needs the Dynamo operator (its CRDs) in the cluster; the model paths must exist on every GPU node "
            "(hostPath).\n")
    return {
        FILES["graph"]: head + note + yaml.dump(graph, Dumper=_Dumper, sort_keys=False, width=120),
        FILES["config"]: head + "# The LLM-API YAML the workers read (--extra-engine-args).\n"
                         + yaml.dump(config_map(spec), Dumper=_Dumper, sort_keys=False, width=120),
    }


def write_manifests(spec: DeploymentSpec, workspace: Workspace, out_dir: Path | str) -> list[Path]:
    """Write both files into `out_dir` (replaced as a whole, atomically); the paths written."""

    return write_dir(out_dir, manifests(spec, workspace), option="--manifests")
