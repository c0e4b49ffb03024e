"""Ready-to-use manifests for target llmapi: Slurm batch scripts and Kubernetes objects.

Pure functions of (spec, workspace) returning text; `write_manifests` puts them in a directory. The
documents themselves (hosts, GPUs per host, probes, the LeaderWorkerSet and its rsh agent) come from
triton/cluster.py, shared with the engine path. Every rank runs in the pinned Triton trtllm image
(versions.py TRITON_IMAGE, which carries TensorRT-LLM 1.2.1, trtllm-serve and
trtllm-llmapi-launch).

Slurm: `srun --mpi=pmix` with pyxis' `--container-image` and `--container-mounts` (the flags
upstream's multi-node trtllm-serve example, examples/llm-api/llm_mgmn_trtllm_serve.sh, uses), every
task running `trtllm-llmapi-launch` in front of the server: rank 0 serves, the other ranks are the
MPI workers LLM() drives (tensorrt_llm/llmapi/trtllm-llmapi-launch).

Kubernetes: trtllm-serve (the OpenAI API) on one host is a Deployment whose container runs it, LLM()
starting a worker per GPU itself; on several hosts, the LeaderWorkerSet's leader runs it under mpirun
with trtllm-llmapi-launch in front, one rank per GPU over the pods. Probes: trtllm-serve's /health,
which answers once LLM() is up.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from toolchain.llmapi import launch
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import DeploymentSpec
from toolchain.targets import GPU, LLMAPI, require_target
from toolchain.triton import cluster, exposure
from toolchain.triton.cluster import k8s_name
from toolchain.triton.endpoints import endpoints
from toolchain.workspace import Workspace

__all__ = ["FILES", "k8s_name", "manifests", "write_manifests"]

FILES = {"slurm": "trtllm-serve.sbatch", "slurm_triton": "triton.sbatch", "deployment": "deployment.yaml",
         "lws": "leaderworkerset.yaml", "service": "service.yaml", "rbac": "rbac.yaml",
         "dockerfile": cluster.LEADER_DOCKERFILE}
HEALTH = "/health"  # trtllm-serve's health route (tensorrt_llm/serve/openai_server.py)


def _require_gpu_target(spec: DeploymentSpec) -> None:
    require_target(spec, f"Slurm and Kubernetes manifests are for target llmapi (GPU hosts), not {spec.target}",
            "set target: llmapi (the CPU stand-in runs on this host with `toolchain serve`)", path=LLMAPI, device=GPU)


# -- Slurm ---------------------------------------------------------------------------------------------------


def slurm_script(spec: DeploymentSpec, workspace: Workspace, server: str = "trtllm-serve") -> str:
    """An sbatch script serving the spec across its hosts: `server` is "trtllm-serve" or "triton"; with
    serving.replicas above 1, a job array whose task i serves replica i's ports."""
    _require_gpu_target(spec)
    each = cluster.array_spec(spec)
    if server == "trtllm-serve":
        argv = launch.multi_node_serve_command(each, workspace)
        what = f"trtllm-serve (OpenAI API on port {spec.llmapi.openai_port} of the first host)"
    elif server == "triton":
        argv = launch.multi_node_triton_command(each, workspace)
        s = spec.serving
        what = f"tritonserver (HTTP {s.http_port}, gRPC {s.grpc_port}, metrics {s.metrics_port} on the first host)"
    else:
        raise ValueError(f"unknown server {server!r}")
    # Off loopback the key comes from the job's environment or file, never the script.
    ref = exposure.shell_reference(spec.serving)
    words = [shlex.quote(a).replace(exposure.PLACEHOLDER, ref) for a in argv]
    return cluster.array_ports(cluster.sbatch(spec, server, what, words))


# -- Kubernetes ----------------------------------------------------------------------------------------------


def server_container(spec: DeploymentSpec, workspace: Workspace) -> dict:
    """The container serving the OpenAI port: trtllm-serve itself on one host, the leader's mpirun
    (cluster.leader_script) on several."""
    _require_gpu_target(spec)
    port = endpoints(spec).openai.port
    _, mounts = cluster.volumes(launch.container_mounts(spec, workspace))
    serve = launch.trtllm_serve_command(spec, workspace, host=cluster.ALL_INTERFACES)
    extra = cluster.probes(spec, port, HEALTH, HEALTH)
    if not cluster.multi_node(spec):
        return cluster.container("trtllm-serve", TRITON_IMAGE, serve, gpus=cluster.world_size(spec), mounts=mounts,
                                 ports={"openai": port}, extra=extra)
    tail = shlex.join(["-n", str(cluster.world_size(spec)), launch.LLMAPI_LAUNCH, *serve])
    return cluster.container("leader", cluster.leader_image(), ["/bin/bash", "-c", cluster.leader_script(spec, tail)],
                             gpus=cluster.tasks_per_node(spec), mounts=mounts, ports={"openai": port}, extra=extra)


def kubernetes(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    server = server_container(spec, workspace)
    vols, mounts = cluster.volumes(launch.container_mounts(spec, workspace))
    note = (f"{cluster.world_size(spec)} rank(s) over {cluster.node_count(spec)} pod(s) of "
            f"{cluster.tasks_per_node(spec)} GPU(s); the model, tokenizer and model_repo paths must exist on "
            "every node (hostPath).")
    texts: dict[str, str] = {}
    if not cluster.multi_node(spec):
        texts[FILES["deployment"]] = cluster.to_yaml([cluster.deployment(spec, server, vols)], spec, note)
    else:
        lws = cluster.leader_worker_set(spec, server, vols, mounts)
        texts[FILES["lws"]] = cluster.to_yaml([lws], spec, note + f"\nThe leader's image: see {cluster.LEADER_DOCKERFILE}.")
        texts[FILES["rbac"]] = cluster.to_yaml(cluster.rbac(spec), spec, "What the leader's kubectl may do.")
        texts[FILES["dockerfile"]] = cluster.leader_dockerfile()
    service = cluster.service(spec, {"openai": endpoints(spec).openai.port})
    texts[FILES["service"]] = cluster.to_yaml([service], spec, "The OpenAI port of the serving pod.")
    return texts


def manifests(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    """File name -> text of every manifest."""
    return {FILES["slurm"]: slurm_script(spec, workspace, "trtllm-serve"),
            FILES["slurm_triton"]: slurm_script(spec, workspace, "triton"),
            **kubernetes(spec, workspace)}


def write_manifests(spec: DeploymentSpec, workspace: Workspace, out_dir: Path | str) -> list[Path]:
    """Write every manifest into `out_dir` (replaced as a whole, atomically); the paths written."""
    return cluster.write(out_dir, manifests(spec, workspace))
