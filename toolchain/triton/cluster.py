"""Slurm batch scripts and Kubernetes objects for a GPU deployment, shared by the engine path
(triton/manifests.py) and the LLM-API path (llmapi/manifests.py), which differ only in the command
each rank runs.

Hosts: one rank per GPU over ceil(tp x pp / gpu.per_node) hosts, the ranks spread evenly, so a
host (a Slurm node, a pod) asks for the GPUs its ranks use, not gpu.per_node: tp 1 asks for one.

Kubernetes: one host is a Deployment (Recreate: a rolling update would need a second set of GPUs);
several are a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, field names in facts/lws.json, read
from kubernetes-sigs/lws at v0.10.0) whose leader pod starts every rank with mpirun. Open MPI
reaches the worker pods through an rsh agent that runs `kubectl exec`, as the LWS project's own
TensorRT-LLM example does (kubernetes-sigs/lws v0.10.0, 2161f38ff333f9e24d3c44adef7cd5d9787cac00,
docs/examples/tensorrt-llm: build/server.py passes `-mca plm_rsh_agent kubessh`, build/Dockerfile adds
kubectl to the image, rbac.yaml allows pods/exec; facts/lws.json `example`); no sshd, no keys. The stock NGC image has no kubectl, so
the leader runs an image built from the shipped Dockerfile.leader (the pinned image plus kubectl);
the worker pods run the stock image and only wait. A Service selects the serving pod; startup,
readiness and liveness probes use the server's own health endpoints.

Startup probe: a pod is given the time its ranks take to read their weights (the largest rank's
checkpoint bytes at LOAD_BYTES_PER_S) and never less than LOAD_FLOOR_S, nor than
serving.startup_timeout_s.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import yaml

from toolchain import upstream
from toolchain.errors import ToolchainError
from toolchain.fsutil import write_dir
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import REPLICA_PORT_STEP, DeploymentSpec
from toolchain.targets import target_of
from toolchain.triton import exposure
from toolchain.plan.plan import checkpoint_bytes_per_rank
from toolchain.versions import TRITON_CONTAINER

# Where a server in a job or a pod binds: it is reached from other hosts (clients, the kubelet's probes).
ALL_INTERFACES = "0.0.0.0"
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource

# Weights are read from a filesystem every host mounts; 100 MiB/s per rank is what eight ranks of a node
# reading at once get from an 800 MiB/s network filesystem, slower than a local NVMe, so a probe sized
# by it does not kill a pod that is still loading. The floor covers what does not scale with size:
# the image's start, CUDA and NCCL initialisation, the engine's or the PyTorch backend's warm-up.
LOAD_BYTES_PER_S = 100 * 2**20
LOAD_FLOOR_S = 300
PROBE_PERIOD_S = 10

LWS = upstream.facts("lws")
LWS_API = LWS["api_version"]["value"]
LWS_CONST = {k: v["value"] for k, v in LWS["types"]["constants"].items()}
LWS_NAME_LABEL = LWS_CONST["SetNameLabelKey"]  # set by the LWS controller on every pod of the set

RSH_AGENT = "/tmp/kubexec"
KUBECTL_VERSION = "v1.34.0"  # a build argument of Dockerfile.leader: match the cluster's minor version
LEADER_DOCKERFILE = "Dockerfile.leader"


# -- ranks and hosts -----------------------------------------------------------------------------------------


def world_size(spec: DeploymentSpec) -> int:
    """GPUs one model instance spans: one rank per tensor x pipeline shard."""
    return spec.parallelism.world_size


def node_count(spec: DeploymentSpec) -> int:
    return math.ceil(world_size(spec) / spec.gpu.per_node)


def tasks_per_node(spec: DeploymentSpec) -> int:
    """Ranks placed on each host, so GPUs each host asks for: the world spread evenly."""
    return math.ceil(world_size(spec) / node_count(spec))


def multi_node(spec: DeploymentSpec) -> bool:
    return world_size(spec) > spec.gpu.per_node


# -- replicas (serving.replicas) ------------------------------------------------------------------------------
# Replica i is the whole deployment again on tp x pp GPUs of its own: on a host, the next ones after the replicas
# before it ([slot*w, (slot+1)*w), w = tp x pp, as toolchain/dynamo/render.py gives its workers), its ports the
# spec's + REPLICA_PORT_STEP x i. On Kubernetes each replica is a pod (a group of pods), on Slurm a task of a job
# array, which carries its index in SLURM_ARRAY_TASK_ID.

ARRAY_INDEX = "SLURM_ARRAY_TASK_ID"
_PORT_SENTINEL = re.compile(r"@PORT(\d+)@")  # shlex leaves it unquoted: swapped for the shell's arithmetic after


def replicas(spec: DeploymentSpec) -> int:
    return spec.serving.replicas


def _ports_shifted(spec: DeploymentSpec, shift) -> DeploymentSpec:
    s = spec.serving
    serving = s.model_copy(update={k: shift(getattr(s, k)) for k in ("http_port", "grpc_port", "metrics_port")
                                   if getattr(s, k)})
    port = spec.llmapi.openai_port
    llmapi = spec.llmapi.model_copy(update={"openai_port": shift(port)} if port else {})
    return spec.model_copy(update={"serving": serving, "llmapi": llmapi})


def replica_spec(spec: DeploymentSpec, i: int) -> DeploymentSpec:
    """The spec replica i serves: every port + REPLICA_PORT_STEP x i (0, a port picked at start, stays 0)."""
    return spec if i == 0 else _ports_shifted(spec, lambda p: p + REPLICA_PORT_STEP * i)


def array_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec a Slurm array task serves when there are several replicas: its ports stand for the spec's +
    REPLICA_PORT_STEP x $SLURM_ARRAY_TASK_ID until `array_ports` swaps them in a rendered script."""
    return spec if replicas(spec) == 1 else _ports_shifted(spec, lambda p: f"@PORT{p}@")


def array_ports(text: str) -> str:
    """A script rendered from array_spec with each port as the task's shell arithmetic."""
    return _PORT_SENTINEL.sub(lambda m: f"$(({m.group(1)}+{REPLICA_PORT_STEP}*{ARRAY_INDEX}))", text)


def replica_gpus(spec: DeploymentSpec, i: int) -> tuple[int, str] | None:
    """(host index, "first,...,last" GPU indices on it) of replica i, where a replica fits one host; None where
    each spans hosts (then its hosts are its own: a hostfile, pods or an allocation per replica)."""
    if multi_node(spec):
        return None
    w = world_size(spec)
    per_host = spec.gpu.per_node // w
    first = (i % per_host) * w
    return i // per_host, ",".join(str(g) for g in range(first, first + w))


def replica_note(spec: DeploymentSpec, i: int) -> str:
    """The comment line heading replica i's lines in `serve --print`."""
    one, where = replica_spec(spec, i), replica_gpus(spec, i)
    s = one.serving
    gpus = f"GPUs {where[1]} of host {where[0]}" if where else f"{node_count(spec)} hosts of its own"
    openai = f", OpenAI {one.llmapi.openai_port}" if target_of(spec).serves_openai else ""
    return (f"# replica {i} of {replicas(spec)}: {gpus}; ports = the spec's + {REPLICA_PORT_STEP} x {i} "
            f"(HTTP {s.http_port}, gRPC {s.grpc_port}, metrics {s.metrics_port}{openai})")


def for_cluster(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec a job or a pod serves: Slurm or Kubernetes place the ranks (no gpu.hostfile), and a
    loopback serving.host becomes every interface (clients, the Service and the kubelet's probes come
    from other hosts), which puts Triton's admin APIs behind the key."""
    update: dict = {}
    if exposure.is_loopback(spec.serving.host):
        update["serving"] = spec.serving.model_copy(update={"host": ALL_INTERFACES})
    if spec.gpu.hostfile is not None:
        update["gpu"] = spec.gpu.model_copy(update={"hostfile": None})
    return spec.model_copy(update=update) if update else spec


def k8s_name(spec: DeploymentSpec) -> str:
    """spec.name as a DNS-1035 label (LWS pods are `<name>-<group>[-<index>]`, under 63 characters)."""
    name = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)[:40].rstrip("-")
    if not name:
        raise ToolchainError(f"deployment name {spec.name!r} has no letters for a Kubernetes name",
                             "give the spec a name starting with a letter")
    return name


def startup_budget_s(spec: DeploymentSpec) -> int:
    """Seconds a pod may take to become ready: its largest rank's weights at LOAD_BYTES_PER_S, at least
    LOAD_FLOOR_S and serving.startup_timeout_s."""

    rank_bytes = max(checkpoint_bytes_per_rank(spec))
    return int(max(LOAD_FLOOR_S, spec.serving.startup_timeout_s, math.ceil(rank_bytes / LOAD_BYTES_PER_S)))


# -- Slurm ---------------------------------------------------------------------------------------------------


def pyxis_image(image: str) -> str:
    """An image reference as pyxis' --container-image takes it: enroot's `REGISTRY#IMAGE[:TAG]`
    form (a plain `nvcr.io/...` would be looked up on Docker Hub)."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return image


def srun_command(spec: DeploymentSpec, mounts: list[str], *, ntasks: int | None = None,
                 container: bool = True) -> list[str]:
    """srun over the hosts the world needs, one task per rank (PMIx, so the ranks see one MPI world),
    in the pinned image through pyxis when `container`, `mounts` at the same paths."""
    tasks = world_size(spec) if ntasks is None else ntasks
    argv = ["srun", "--mpi=pmix", f"--nodes={node_count(spec) if ntasks is None else 1}", f"--ntasks={tasks}",
            f"--ntasks-per-node={tasks_per_node(spec) if ntasks is None else tasks}"]
    if container:
        argv += [f"--container-image={pyxis_image(TRITON_IMAGE)}",
                 f"--container-mounts={','.join(f'{p}:{p}' for p in sorted(set(mounts)))}"]
    return argv


def wrap(words: list[str]) -> str:
    """One shell command from its (already quoted) words, one argument group per line."""
    lines: list[str] = []
    current: list[str] = []
    for word in words:
        if word.startswith("-") and current and len(" ".join(current)) > 60:
            lines.append(" ".join(current))
            current = []
        current.append(word)
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)


def sbatch(spec: DeploymentSpec, job: str, what: str, words: list[str], *, nodes: int | None = None,
           ntasks: int | None = None) -> str:
    """A batch script running the shell command `words` (usually srun; each word already quoted)."""
    nodes = node_count(spec) if nodes is None else nodes
    ntasks = world_size(spec) if ntasks is None else ntasks
    per = math.ceil(ntasks / nodes)
    gpus = world_size(spec) if ntasks == 1 else per
    directives = [("job-name", f"{spec.name}-{job}"), ("nodes", nodes), ("ntasks", ntasks),
                  ("ntasks-per-node", per), ("gpus-per-node", gpus)]
    n = replicas(spec)
    if n > 1:
        directives.append(("array", f"0-{n - 1}"))
    out = ["#!/bin/bash"] + [f"#SBATCH --{key}={value}" for key, value in directives]
    out += [
        f"# Generated by `toolchain serve --manifests` from {spec.source or '<spec>'} (deployment '{spec.name}').",
        f"# tp {spec.parallelism.tp} x pp {spec.parallelism.pp} = {world_size(spec)} ranks, one per GPU, "
        f"over {nodes} host(s) of {gpus} GPUs.",
        f"# Serves {what}.",
    ]
    if n > 1:
        out.append(f"# serving.replicas {n}: one array task per replica, each on an allocation of its own; task i "
                   f"serves every port + {REPLICA_PORT_STEP} x i (${ARRAY_INDEX}), so tasks sharing a host never collide.")
    out += [
        "# The model, engine, tokenizer and model_repo paths must be on a filesystem every host mounts.",
        "set -euo pipefail",
        wrap(words),
        "",
    ]
    return "\n".join(out)


# -- Kubernetes ----------------------------------------------------------------------------------------------


def volumes(mounts: list[str]) -> tuple[list[dict], list[dict]]:
    """(pod volumes, container volumeMounts): each path read-only at the same place (hostPath), and a
    memory-backed /dev/shm (NCCL and the Python backend need more than a container's 64 MiB)."""
    unique = sorted({str(Path(m)) for m in mounts})
    vols: list[dict] = [{"name": f"data{i}", "hostPath": {"path": m}} for i, m in enumerate(unique)]
    vol_mounts: list[dict] = [{"name": f"data{i}", "mountPath": m, "readOnly": True} for i, m in enumerate(unique)]
    vols.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    vol_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return vols, vol_mounts


def probes(spec: DeploymentSpec, port: int, ready: str, live: str) -> dict:
    """Startup probe sized by the weights (startup_budget_s); readiness and liveness, which the kubelet
    runs only once the startup probe passed."""
    budget = startup_budget_s(spec)
    return {
        "startupProbe": {"httpGet": {"path": ready, "port": port}, "periodSeconds": PROBE_PERIOD_S,
                         "failureThreshold": math.ceil(budget / PROBE_PERIOD_S)},
        "readinessProbe": {"httpGet": {"path": ready, "port": port}, "periodSeconds": PROBE_PERIOD_S,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": live, "port": port}, "periodSeconds": PROBE_PERIOD_S,
                          "failureThreshold": 6},
    }


def container(name: str, image: str, command: list[str], *, gpus: int, mounts: list[dict],
              ports: dict[str, int] | None = None, env: list[dict] | None = None, extra: dict | None = None) -> dict:
    out: dict = {"name": name, "image": image, "command": command}
    if env:
        out["env"] = env
    if ports:
        out["ports"] = [{"name": n, "containerPort": p} for n, p in ports.items()]
    out["resources"] = {"limits": {GPU_RESOURCE: gpus}}
    out.update(extra or {})
    out["volumeMounts"] = mounts
    return out


def deployment(spec: DeploymentSpec, server: dict, pod_volumes: list[dict]) -> dict:
    """One pod per replica, each serving the whole world (apps/v1 Deployment; the Service spreads requests
    over them)."""
    name = k8s_name(spec)
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": replicas(spec), "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [server], "volumes": pod_volumes}}}}


def service_account(spec: DeploymentSpec) -> str:
    return f"{k8s_name(spec)}-mpi"


def leader_script(spec: DeploymentSpec, mpirun_tail: str) -> str:
    """The leader's shell script: the rsh agent, each worker pod waited for and added to the host
    list (`<leader pod>-<index>`, LWS' worker naming), then mpirun with that list and `mpirun_tail`
    (the ranks' part of the line, after `mpirun --allow-run-as-root`)."""
    per = tasks_per_node(spec)
    agent = ["#!/bin/sh", "# Open MPI's rsh agent: HOST COMMAND... -> COMMAND in that worker pod.",
             'pod="${1%%.*}"', "shift", 'exec kubectl exec "$pod" -c worker -- /bin/sh -c "$*"']
    return "\n".join([
        "set -eu",
        f"cat > {RSH_AGENT} <<'AGENT'", *agent, "AGENT",
        f"chmod +x {RSH_AGENT}",
        f'hosts="$HOSTNAME:{per}"',
        "i=1",
        f'while [ "$i" -lt "${LWS_CONST["LwsGroupSize"]}" ]; do',
        '  until kubectl wait --for=condition=Ready "pod/$HOSTNAME-$i" --timeout=60s; do sleep 5; done',
        f'  hosts="$hosts,$HOSTNAME-$i:{per}"',
        "  i=$((i + 1))",
        "done",
        # No tree spawn: a worker pod has neither kubectl nor the agent to start ranks further on.
        f'exec mpirun --allow-run-as-root --mca plm_rsh_agent {RSH_AGENT} --mca plm_rsh_no_tree_spawn 1 '
        f'-H "$hosts" {mpirun_tail}',
    ])


def leader_image() -> str:
    return f"trtllm-toolchain/leader:{TRITON_CONTAINER}"


def leader_worker_set(spec: DeploymentSpec, leader: dict, pod_volumes: list[dict], worker_mounts: list[dict]) -> dict:
    """One group of node_count pods per replica (LeaderWorkerSetSpec.replicas, facts/lws.json): `leader` (its
    command from leader_script) starts every rank of its group; the workers, in the stock image, wait for
    mpirun's `kubectl exec`."""
    name = k8s_name(spec)
    worker = container("worker", TRITON_IMAGE, ["/bin/sh", "-c", "exec sleep infinity"], gpus=tasks_per_node(spec),
                       mounts=worker_mounts)
    return {"apiVersion": LWS_API, "kind": LWS["kind"], "metadata": {"name": name}, "spec": {
        "replicas": replicas(spec),
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": node_count(spec),
            # A lost rank breaks the MPI world: restart the whole group, not one pod.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": {"metadata": {"labels": {"role": "leader"}},
                               "spec": {"serviceAccountName": service_account(spec), "containers": [leader],
                                        "volumes": pod_volumes}},
            "workerTemplate": {"metadata": {"labels": {"role": "worker"}},
                               "spec": {"containers": [worker], "volumes": pod_volumes}},
        }}}


# Verbs on pods/exec. The LWS example's rbac.yaml grants `create` (the POST of SPDY exec); kubectl 1.30 and later
# first opens exec as a WebSocket, an HTTP GET the API server authorizes as `get`, and only falls back to SPDY
# when that upgrade fails (KEP-4006, kubernetes/enhancements keps/sig-api-machinery/4006-transition-spdy-to-websockets;
# kubernetes/kubernetes#133515). Both, so the pinned kubectl (KUBECTL_VERSION) execs on its first try, and API
# servers with AuthorizePodWebsocketUpgradeCreatePermission (beta in 1.35), which ask for `create` on that GET too.
EXEC_VERBS = ["create", "get"]


def rbac(spec: DeploymentSpec) -> list[dict]:
    """What the leader's kubectl needs: see pods and wait for them, exec into them (the rules of the
    LWS example's rbac.yaml, narrowed to pods, with `get` on pods/exec for WebSocket exec: EXEC_VERBS)."""
    sa = service_account(spec)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": sa},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["pods/exec"], "verbs": list(EXEC_VERBS)}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa}},
    ]


def leader_dockerfile() -> str:
    """The leader's image: the pinned image plus kubectl (checked against its published sha256)."""
    fetch = ("import sys, urllib.request as u; u.urlretrieve(sys.argv[1], '/usr/local/bin/kubectl'); "
             "u.urlretrieve(sys.argv[1] + '.sha256', '/tmp/kubectl.sha256')")
    return "\n".join([
        "# The leader pod of a multi-host LeaderWorkerSet: the pinned Triton image plus kubectl, which",
        f"# Open MPI's rsh agent ({RSH_AGENT}, written by the pod's command) uses to start ranks in the worker pods.",
        f"# Build and push it where the cluster pulls from, then set leaderTemplate's image (now {leader_image()}):",
        f"#   docker build -f {LEADER_DOCKERFILE} -t REGISTRY/{leader_image()} . && docker push REGISTRY/{leader_image()}",
        f"FROM {TRITON_IMAGE}",
        "# kubectl supports one minor version of skew against the API server: match the cluster's.",
        f"ARG KUBECTL_VERSION={KUBECTL_VERSION}",
        'RUN url="https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/$(dpkg --print-architecture)/kubectl" \\',
        f"    && python3 -c {shlex.quote(fetch)} \"$url\" \\",
        '    && echo "$(cat /tmp/kubectl.sha256)  /usr/local/bin/kubectl" | sha256sum --check \\',
        "    && chmod 0755 /usr/local/bin/kubectl && rm /tmp/kubectl.sha256",
        "",
    ])


def service(spec: DeploymentSpec, ports: dict[str, int]) -> dict:
    """The serving pod's ports: the Deployment's pod, or the LeaderWorkerSet's leader."""
    name = k8s_name(spec)
    selector = {LWS_NAME_LABEL: name, "role": "leader"} if multi_node(spec) else {"app": name}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": selector,
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports.items()]}}


def admin_secret(spec: DeploymentSpec) -> str:
    return f"{k8s_name(spec)}-admin-key"


def key_env(spec: DeploymentSpec) -> list[dict]:
    """The container environment carrying Triton's admin key, from Secret admin_secret (secret_line
    creates it); Kubernetes expands `$(VAR)` in a container's command from it."""
    ref = {"secretKeyRef": {"name": admin_secret(spec), "key": "admin-key"}}
    return [{"name": spec.serving.admin_key_env, "valueFrom": ref}]


def secret_line(spec: DeploymentSpec) -> str:
    """The command creating the admin-key Secret from the key where it is typed (never the key itself)."""
    return (f"printf %s {exposure.shell_reference(spec.serving)} | kubectl create secret generic "
            f"{admin_secret(spec)} --from-file=admin-key=/dev/stdin")


def k8s_command(argv: list[str], spec: DeploymentSpec) -> list[str]:
    """argv as a container command: the admin key as `$(VAR)`, expanded by Kubernetes."""
    return [a.replace(exposure.PLACEHOLDER, f"$({spec.serving.admin_key_env})") for a in argv]


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people and kubectl: no anchors for the lists the two templates share, and
    multi-line scripts as literal blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(docs: list[dict], spec: DeploymentSpec, note: str) -> str:
    head = (f"# Generated by `toolchain serve --manifests` from {spec.source or '<spec>'} "
            f"(deployment '{spec.name}').\n" + "".join(f"# {line}\n" for line in note.splitlines()))
    return head + "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=120) for d in docs)


def write(out_dir: Path | str, texts: dict[str, str]) -> list[Path]:
    """Write every manifest into `out_dir` (replaced as a whole, atomically); the paths written."""
    return write_dir(out_dir, texts, option="--manifests", executable=(".sbatch",))
