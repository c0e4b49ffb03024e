"""Manifests of target trtllm (the engine path): a Slurm batch script and a Kubernetes Deployment (one
host) or LeaderWorkerSet (several), with a Service and probes, built by triton/cluster.py.

Every rank runs the tritonserver arguments of `toolchain serve --print`'s mpirun line
(launch.launch_command on cluster.for_cluster(spec)):

* Slurm: `srun --mpi=pmix` with one task per rank in the pinned image, each task running its own
  segment of that line (rank 0 serves; the others load only the TensorRT-LLM models), the shared-memory
  prefix numbered by $SLURM_PROCID, as triton-inference-server/tensorrtllm_backend's README.md
  (39ba55a745266bbc50cf19af0f5dfcad1c939c12, "Launch the backend within Slurm based clusters") runs
  tritonserver under `srun --mpi=pmix` (`shm-region-prefix-name=prefix${SLURM_PROCID}_`). Orchestrator mode (draft-target) is one task
  running the line itself.
* Kubernetes, one host: the container command is the line. Several hosts: the LeaderWorkerSet's leader
  runs the line with the pods as mpirun's hosts (cluster.leader_script).

Probes: Triton's /v2/health/ready (startup, readiness) and /v2/health/live on the HTTP port, which
exposure.py leaves open without the key.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import DeploymentSpec
from toolchain.targets import ENGINE, GPU, require_target
from toolchain.triton import cluster, exposure
from toolchain.triton.endpoints import endpoints
from toolchain.triton.launch import LaunchCommand, launch_command
from toolchain.workspace import Workspace

FILES = {"slurm": "triton.sbatch", "deployment": "deployment.yaml", "lws": "leaderworkerset.yaml",
         "service": "service.yaml", "rbac": "rbac.yaml", "dockerfile": cluster.LEADER_DOCKERFILE}
READY, LIVE = "/v2/health/ready", "/v2/health/live"
_RANK = "@RANK@"  # stands for the task's rank in the Slurm line until it is printed


def mounts(spec: DeploymentSpec, workspace: Workspace) -> list[str]:
    """Host paths the ranks read, mounted at the same place so the absolute engine and tokenizer paths
    in the rendered configs hold inside the container."""
    paths = [workspace.engine_root(spec), workspace.model_repo_dir(spec), spec.model.tokenizer_dir]
    return sorted({str(Path(p)) for p in paths})


def cluster_launch(spec: DeploymentSpec, workspace: Workspace) -> LaunchCommand:
    """The line every manifest runs: `serve --print`'s for cluster.for_cluster(spec)."""
    require_target(spec, f"these manifests are for target trtllm, not {spec.target}", "set target: trtllm", path=ENGINE,
            device=GPU)
    launch = launch_command(cluster.for_cluster(spec), workspace.model_repo_dir(spec))
    if launch.mode == "orchestrator" and cluster.multi_node(spec):
        raise ToolchainError(f"draft-target runs one orchestrator process, which cannot span "
                             f"{cluster.node_count(spec)} hosts", "fit tp x pp within gpu.per_node")
    return launch


def segments(launch: LaunchCommand) -> list[list[str]]:
    """The per-rank argument lists of a leader-mode line (`-n 1 ARGS : -n 1 ARGS ...`)."""
    out: list[list[str]] = [[]]
    for arg in launch.argv[launch.argv.index("-n"):]:
        if arg == ":":
            out.append([])
        else:
            out[-1].append(arg)
    return [seg[2:] for seg in out]


def _words(argv: list[str], spec: DeploymentSpec) -> list[str]:
    """argv as shell words, the admin key (if any) as a reference to where the job finds it."""
    ref = exposure.shell_reference(spec.serving)
    return [shlex.quote(a).replace(exposure.PLACEHOLDER, ref) for a in argv]


def _shell(argv: list[str], spec: DeploymentSpec) -> str:
    return " ".join(_words(argv, spec))


def slurm_script(spec: DeploymentSpec, workspace: Workspace) -> str:
    """The batch script; with serving.replicas above 1, a job array whose task i serves replica i's ports."""
    return cluster.array_ports(_slurm_script(spec, workspace))


def _slurm_script(spec: DeploymentSpec, workspace: Workspace) -> str:
    launch = cluster_launch(cluster.array_spec(spec), workspace)
    s = cluster.for_cluster(spec).serving
    what = f"tritonserver (HTTP {s.http_port}, gRPC {s.grpc_port}, metrics {s.metrics_port} on the first host)"
    if launch.mode == "orchestrator":
        env = [f"{k}={v}" for k, v in launch.env.items()]
        words = [*map(shlex.quote, cluster.srun_command(spec, mounts(spec, workspace), ntasks=1)), "env",
                 *env, *_words(launch.argv, spec)]
        return cluster.sbatch(spec, "triton", what, words, nodes=1, ntasks=1)
    ranks = segments(launch)
    script = f"exec {_shell(ranks[0], spec)}"
    if len(ranks) > 1:
        # Every rank above 0 runs rank 1's arguments with its own shared-memory prefix.
        rest = [a.replace("shm-region-prefix-name=prefix1_", f"shm-region-prefix-name=prefix{_RANK}_")
                for a in ranks[1]]
        other = _shell(rest, spec).replace(_RANK, "${SLURM_PROCID}")
        script = f'if [ "$SLURM_PROCID" -eq 0 ]; then {script}; else exec {other}; fi'
    words = [*map(shlex.quote, cluster.srun_command(spec, mounts(spec, workspace))), "bash", "-c",
             shlex.quote(script)]
    return cluster.sbatch(spec, "triton", what, words)


def _ports(spec: DeploymentSpec) -> dict[str, int]:
    return endpoints(cluster.for_cluster(spec)).triton.declared


def kubernetes(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    launch = cluster_launch(spec, workspace)
    served = cluster.for_cluster(spec)
    vols, vol_mounts = cluster.volumes(mounts(spec, workspace))
    env = [{"name": k, "value": v} for k, v in launch.env.items()]
    env += cluster.key_env(spec) if launch.restricted else []
    ports = _ports(spec)
    extra = cluster.probes(spec, ports["http"], READY, LIVE)
    note = (f"{cluster.world_size(spec)} rank(s) over {cluster.node_count(spec)} pod(s) of "
            f"{cluster.tasks_per_node(spec)} GPU(s); the engine, tokenizer and model_repo paths must exist on "
            f"every node (hostPath).\nTriton binds {served.serving.host} in the pod.")
    if launch.restricted:
        note += f"\nNeeds Secret {cluster.admin_secret(spec)}: {cluster.secret_line(spec)}"
    texts: dict[str, str] = {}
    if not cluster.multi_node(spec):
        server = cluster.container("triton", TRITON_IMAGE, cluster.k8s_command(launch.argv, spec),
                                   gpus=cluster.world_size(spec), mounts=vol_mounts, ports=ports, env=env, extra=extra)
        texts[FILES["deployment"]] = cluster.to_yaml([cluster.deployment(spec, server, vols)], spec, note)
    else:
        tail = " ".join(shlex.quote(a) for a in cluster.k8s_command(launch.argv[2:], spec))
        leader = cluster.container("leader", cluster.leader_image(),
                                   ["/bin/bash", "-c", cluster.leader_script(spec, tail)],
                                   gpus=cluster.tasks_per_node(spec), mounts=vol_mounts, ports=ports, env=env,
                                   extra=extra)
        lws = cluster.leader_worker_set(spec, leader, vols, vol_mounts)
        texts[FILES["lws"]] = cluster.to_yaml([lws], spec, note + f"\nThe leader's image: see {cluster.LEADER_DOCKERFILE}.")
        texts[FILES["rbac"]] = cluster.to_yaml(cluster.rbac(spec), spec, "What the leader's kubectl may do.")
        texts[FILES["dockerfile"]] = cluster.leader_dockerfile()
    texts[FILES["service"]] = cluster.to_yaml([cluster.service(spec, ports)], spec, "Triton's ports of the serving pod.")
    return texts


def manifests(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    """File name -> text of every manifest."""
    return {FILES["slurm"]: slurm_script(spec, workspace), **kubernetes(spec, workspace)}
