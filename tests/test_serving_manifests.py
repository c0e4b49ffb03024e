"""`toolchain serve --manifests DIR` on both GPU paths (target trtllm: the engine; target llmapi) and the
docker lines of `serve --print`. Every document is parsed back and its keys held against upstream's
own schemas: Kubernetes objects against the kubernetes client's models (generated from the
Kubernetes OpenAPI schema), the LeaderWorkerSet against facts/lws.json (the json tags of
kubernetes-sigs/lws' v1 Go types). The command each pod or Slurm task runs is compared with what
`serve --print` prints."""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from toolchain import upstream
from toolchain.cli import main
from toolchain.llmapi import launch as llmapi_launch
from toolchain.plan.plan import checkpoint_bytes_per_rank
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import load_spec
from toolchain.triton import cluster
from toolchain.triton.launch import launch_command
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
ENGINE_70B = REPO / "build" / "llama3-70b-sq-tp4pp2.yaml"  # trtllm, tp 4 x pp 2, host 0.0.0.0
LLMAPI_8B = REPO / "build" / "llama3-8b-llmapi-h100.yaml"  # llmapi, tp 1, gpu.per_node 8 (default)
LWS = upstream.facts("lws")


# -- schema checks -----------------------------------------------------------------------------------------------


def _k8s_check(doc, model: str, where: str = "") -> None:
    """Every key of `doc` is a field of Kubernetes model `model` (kubernetes.client V1 classes)."""
    from kubernetes import client

    if model in ("object", "str", "int", "bool", "float"):
        return
    m = re.fullmatch(r"list\[(.+)\]", model)
    if m:
        assert isinstance(doc, list), where
        for i, item in enumerate(doc):
            _k8s_check(item, m.group(1), f"{where}[{i}]")
        return
    m = re.fullmatch(r"dict\(str, (.+)\)", model)
    if m:
        assert isinstance(doc, dict), where
        for k, v in doc.items():
            _k8s_check(v, m.group(1), f"{where}.{k}")
        return
    cls = getattr(client, model)
    by_json = {j: a for a, j in cls.attribute_map.items()}
    assert isinstance(doc, dict), where
    for key, value in doc.items():
        assert key in by_json, f"{where}: {model} has no field {key!r}"
        _k8s_check(value, cls.openapi_types[by_json[key]], f"{where}.{key}")


def _lws_check(doc: dict, struct: str = "LeaderWorkerSet", where: str = "") -> None:
    """Every key is a json field of the LWS Go struct (facts/lws.json); required ones present, enum
    values allowed; pod templates checked as Kubernetes' PodTemplateSpec."""
    structs = LWS["types"]["structs"]
    fields = structs[struct]["fields"]
    for name, field in fields.items():
        if field["required"]:
            assert name in doc, f"{where}: {struct} needs {name}"
    for key, value in doc.items():
        if struct == "LeaderWorkerSet" and key in ("apiVersion", "kind"):
            continue
        assert key in fields, f"{where}: {struct} has no field {key!r}"
        field = fields[key]
        if "enum" in field:
            assert value in field["enum"], f"{where}.{key}: {value!r} not in {field['enum']}"
        kind = field["type"].lstrip("*")
        if kind == "corev1.PodTemplateSpec":
            _k8s_check(value, "V1PodTemplateSpec", f"{where}.{key}")
        elif kind == "metav1.ObjectMeta":
            _k8s_check(value, "V1ObjectMeta", f"{where}.{key}")
        elif kind in structs:
            _lws_check(value, kind, f"{where}.{key}")


KINDS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
         ("v1", "ServiceAccount"): "V1ServiceAccount", ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
         ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding"}


def _docs(out: Path) -> dict[str, dict]:
    """kind -> document of every YAML file in `out`, each checked against its schema."""
    docs: dict[str, dict] = {}
    for path in sorted(out.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["apiVersion"], doc["kind"])
            if doc["kind"] == "LeaderWorkerSet":
                assert doc["apiVersion"] == LWS["api_version"]["value"]
                _lws_check(doc)
            else:
                _k8s_check(doc, KINDS[key], doc["kind"])
            docs[doc["kind"]] = doc
    return docs


def _bash_n(text: str, shell: str = "bash") -> None:
    if shutil.which(shell):
        subprocess.run([shell, "-n"], input=text, text=True, check=True)


def _sbatch(text: str) -> tuple[dict[str, str], list[str]]:
    """(#SBATCH directives, the one command the script runs, as argv)."""
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))
    body = [line for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    assert body[0] == "set -euo pipefail" and len(body) == 2, body
    _bash_n(text)
    return directives, shlex.split(body[1])


def _serve(root: Path, spec: Path, *args: str) -> int:
    return main(["--root", str(root), "serve", str(spec), *args])


def _container(doc: dict, which: str = "leaderTemplate") -> dict:
    if doc["kind"] == "Deployment":
        return doc["spec"]["template"]["spec"]["containers"][0]
    return doc["spec"]["leaderWorkerTemplate"][which]["spec"]["containers"][0]


# -- item 9: writing manifests is printing; the engine path gets them too ----------------------------------------


def test_llmapi_manifests_are_written_without_tensorrt_llm(tmp_path, capsys):
    """TensorRT-LLM is not installed here: llmapi.runtime-version fails, and --manifests only warns."""
    out = tmp_path / "m"
    assert _serve(tmp_path / "ws", LLMAPI_8B, "--manifests", str(out)) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "warning: check llmapi.runtime-version fails" in err
    assert {p.name for p in out.iterdir()} == {"trtllm-serve.sbatch", "triton.sbatch", "deployment.yaml",
                                               "service.yaml"}
    _docs(out)


def test_engine_path_single_host_manifests_run_the_printed_line(tmp_path, capsys):
    """tp 4 on one host: a Deployment whose command is `serve --print`'s line, a Service, probes, and
    a Slurm script whose tasks run that line's rank segments."""
    root, out = tmp_path / "ws", tmp_path / "m"
    sets = ["--set", "parallelism.pp=1", "--set", "parallelism.gpus=4"]
    assert _serve(root, ENGINE_70B, "--print", *sets) == 0
    printed = capsys.readouterr().out.splitlines()
    line = shlex.split(printed[0].replace('"${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY to the admin key}"', "KEY"))
    assert _serve(root, ENGINE_70B, "--manifests", str(out), *sets) == 0
    written = capsys.readouterr().out
    assert f"# wrote {out / 'deployment.yaml'}" in written
    assert {p.name for p in out.iterdir()} == {"triton.sbatch", "deployment.yaml", "service.yaml"}
    docs = _docs(out)
    deploy, svc = docs["Deployment"], docs["Service"]
    server = _container(deploy)
    assert server["image"] == TRITON_IMAGE
    assert [a.replace("$(TRITON_ADMIN_KEY)", "KEY") for a in server["command"]] == line
    assert server["env"] == [{"name": "TRITON_ADMIN_KEY", "valueFrom": {"secretKeyRef": {
        "name": "llama3-70b-sq-tp4pp2-admin-key", "key": "admin-key"}}}]
    assert server["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert server["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8000}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8000}
    assert svc["spec"]["selector"] == deploy["spec"]["template"]["metadata"]["labels"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {8000, 8001}  # metrics stay on loopback off-loopback
    mounted = {m["mountPath"] for m in server["volumeMounts"]}
    spec = load_spec(ENGINE_70B, ("parallelism.pp=1", "parallelism.gpus=4"))
    assert {str(Workspace(root).engine_root(spec)), str(Workspace(root).model_repo_dir(spec))} <= mounted

    directives, srun = _sbatch((out / "triton.sbatch").read_text())
    assert directives["nodes"] == "1" and directives["ntasks"] == "4" and directives["gpus-per-node"] == "4"
    assert srun[0] == "srun" and "--mpi=pmix" in srun and srun[-3:-1] == ["bash", "-c"]
    ranks = _segments(line)
    script = srun[-1].replace('"${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY to the admin key}"', "KEY")
    first, other = re.fullmatch(r'if \[ "\$SLURM_PROCID" -eq 0 \]; then exec (.*); else exec (.*); fi', script).groups()
    assert shlex.split(first) == ranks[0]
    assert shlex.split(other) == [a.replace("prefix1_", "prefix${SLURM_PROCID}_") for a in ranks[1]]


def _segments(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for a in argv[argv.index("-n"):]:
        out.append([]) if a == ":" else out[-1].append(a)
    return [s[2:] for s in out]


def test_llmapi_print_has_docker_lines(tmp_path, capsys):
    root = tmp_path / "ws"
    assert _serve(root, LLMAPI_8B, "--print") == 0
    lines = capsys.readouterr().out.splitlines()
    dockers = [shlex.split(line) for line in lines if line.startswith("docker run")]
    assert len(dockers) == 2
    spec, ws = load_spec(LLMAPI_8B), Workspace(root)
    serve, triton = dockers
    image = serve.index(TRITON_IMAGE)
    assert serve[image + 1:] == llmapi_launch.trtllm_serve_command(spec, ws, host="0.0.0.0")
    assert ["-p", "8080:8080"] == serve[serve.index("-p"):serve.index("-p") + 2]
    mounts = {serve[i + 1] for i, a in enumerate(serve) if a == "-v"}
    assert {f"{p}:{p}" for p in llmapi_launch.container_mounts(spec, ws)} == mounts
    # serving.host 0.0.0.0: the key reaches tritonserver from docker's environment, never the line.
    assert triton[triton.index(TRITON_IMAGE) + 1:][:2] == ["sh", "-c"] and ["-e", "TRITON_ADMIN_KEY"] == \
        triton[triton.index("-e"):triton.index("-e") + 2]


def _published(docker: list[str]) -> list[str]:
    return [docker[i + 1] for i, a in enumerate(docker) if a == "-p"]


@pytest.mark.parametrize("spec_path", [ENGINE_70B, LLMAPI_8B])
@pytest.mark.parametrize("host,on", [("127.0.0.1", "127.0.0.1:"), ("localhost", "127.0.0.1:"),
                                     ("10.1.2.3", "10.1.2.3:"), ("::1", "[::1]:")])
def test_docker_lines_bind_every_interface_and_publish_where_the_spec_binds(tmp_path, capsys, spec_path, host, on):
    """Issue 33 item 5: a server bound to the container's loopback (or to a host address the container does not
    have) is reached by nothing through a published port. Every printed container binds 0.0.0.0 inside and
    docker publishes each port on the address the spec names, metrics on the host's loopback where they stay
    private; the admin key follows the spec's address, not the container's."""
    assert _serve(tmp_path / "ws", spec_path, "--print", "--set", f"serving.host={host}") == 0
    dockers = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if line.startswith("docker run")]
    assert dockers
    loopback = host in ("127.0.0.1", "localhost", "::1")
    for docker in dockers:
        inside = " ".join(docker[docker.index(TRITON_IMAGE) + 1:])
        addresses = re.findall(r"--(?:http|grpc|metrics)-address=(\S+)", inside) + re.findall(r"--host (\S+)", inside)
        assert addresses and set(addresses) == {"0.0.0.0"}, inside
        # metrics (8002) stay on the host's loopback off loopback; every other port is published on `on`
        expected = {"8002": "127.0.0.1:" if not loopback else on}
        ports = [p.rsplit(":", 2) for p in _published(docker)]
        assert ports and all(a == b and f"{h}:" == expected.get(a, on) for h, a, b in ports), _published(docker)
        if "tritonserver" in inside:
            assert ("--http-restricted-api" in inside) == (not loopback)


def test_docker_publishes_on_an_address_not_a_name(tmp_path, capsys):
    assert _serve(tmp_path / "ws", ENGINE_70B, "--print", "--set", "serving.host=gpu-node-3") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: serving.host gpu-node-3 is a name; docker publishes a container's ports on an IP")


# -- item 10: manifests request what they use ------------------------------------------------------------------


@pytest.mark.parametrize("spec_path,sets", [(LLMAPI_8B, ()), (ENGINE_70B, ("parallelism.pp=1", "parallelism.tp=1",
                                                                           "parallelism.gpus=1"))])
def test_tp1_asks_for_one_gpu(tmp_path, capsys, spec_path, sets):
    out = tmp_path / "m"
    args = [a for s in sets for a in ("--set", s)] + ["--skip-check", "llmapi.runtime-version"]
    assert _serve(tmp_path / "ws", spec_path, "--manifests", str(out), *args) == 0, capsys.readouterr().err
    docs = _docs(out)
    server = _container(docs.get("Deployment") or docs["LeaderWorkerSet"])
    assert server["resources"]["limits"] == {"nvidia.com/gpu": 1}
    for script in out.glob("*.sbatch"):
        directives, _ = _sbatch(script.read_text())
        assert directives["gpus-per-node"] == "1" and directives["nodes"] == "1"


def test_hosts_ask_for_the_gpus_their_ranks_use(tmp_path, capsys):
    """tp 6 x pp 2 over hosts of 8: two pods of 6 ranks each ask for 6 GPUs, not 8."""
    out = tmp_path / "m"
    sets = ["--set", "parallelism.tp=6", "--set", "parallelism.pp=2", "--set", "parallelism.gpus=12"]
    assert _serve(tmp_path / "ws", LLMAPI_8B, "--manifests", str(out), *sets) == 0, capsys.readouterr().err
    lws = _docs(out)["LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    for which in ("leaderTemplate", "workerTemplate"):
        assert _container(lws, which)["resources"]["limits"] == {"nvidia.com/gpu": 6}
    directives, _ = _sbatch((out / "trtllm-serve.sbatch").read_text())
    assert (directives["nodes"], directives["ntasks"], directives["gpus-per-node"]) == ("2", "12", "6")


def test_startup_probe_allows_for_the_weights(tmp_path):
    """The startup probe's budget covers the largest rank's bytes at the documented rate, never less
    than the floor: a 70B model on one GPU gets far more than on eight."""
    budgets = {}
    for tp in (1, 8):
        spec = load_spec(ENGINE_70B, (f"parallelism.tp={tp}", "parallelism.pp=1", f"parallelism.gpus={tp}"))
        probe = cluster.probes(spec, 8000, "/r", "/l")["startupProbe"]
        budget = probe["failureThreshold"] * probe["periodSeconds"]
        load = max(checkpoint_bytes_per_rank(spec)) / cluster.LOAD_BYTES_PER_S
        assert budget >= load and budget >= cluster.LOAD_FLOOR_S and budget >= spec.serving.startup_timeout_s
        assert budget < max(load, cluster.LOAD_FLOOR_S) + probe["periodSeconds"] + 1
        budgets[tp] = budget
    assert budgets[1] > 2 * budgets[8] and budgets[8] == cluster.LOAD_FLOOR_S


# -- item 10: the LeaderWorkerSet starts ranks with the stock image's tools ----------------------------------------


def test_engine_lws_starts_ranks_over_kubectl_exec(tmp_path, capsys):
    """tp 4 x pp 2 on hosts of 4 GPUs: two pods. The leader runs `serve --print`'s mpirun line with the
    pods as hosts and a kubectl-exec rsh agent (no sshd); workers run the stock image and wait; the
    leader's image is the shipped Dockerfile's (the pinned image plus kubectl), its account may exec."""
    root, out = tmp_path / "ws", tmp_path / "m"
    sets = ["--set", "gpu.per_node=4"]
    assert _serve(root, ENGINE_70B, "--print", *sets) == 0
    printed = shlex.split(capsys.readouterr().out.splitlines()[0].replace(
        '"${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY to the admin key}"', "$(TRITON_ADMIN_KEY)"))
    assert _serve(root, ENGINE_70B, "--manifests", str(out), *sets) == 0
    capsys.readouterr()
    assert {p.name for p in out.iterdir()} == {"triton.sbatch", "leaderworkerset.yaml", "service.yaml", "rbac.yaml",
                                               "Dockerfile.leader"}
    docs = _docs(out)
    lws = docs["LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _container(lws), _container(lws, "workerTemplate")
    assert worker["image"] == TRITON_IMAGE and "sshd" not in " ".join(worker["command"])
    assert leader["resources"]["limits"] == worker["resources"]["limits"] == {"nvidia.com/gpu": 4}
    script = leader["command"][2]
    _bash_n(script)
    assert "$$" not in script  # Kubernetes would collapse it to "$" in a container command
    agent = re.search(r"<<'AGENT'\n(.*?)\nAGENT\n", script, re.S).group(1)
    _bash_n(agent, "sh")
    assert 'kubectl exec "$pod" -c worker --' in agent and worker["name"] == "worker"
    mpirun = shlex.split(script.splitlines()[-1])
    assert mpirun[:2] == ["exec", "mpirun"]
    i = mpirun.index("--mca")
    assert mpirun[i:i + 8] == ["--mca", "plm_rsh_agent", cluster.RSH_AGENT, "--mca", "plm_rsh_no_tree_spawn", "1",
                               "-H", "$hosts"]
    assert mpirun[1:i] + mpirun[i + 8:] == printed  # the printed line, hosts and agent added
    assert "LWS_GROUP_SIZE" in script and LWS["types"]["constants"]["LwsGroupSize"]["value"] == "LWS_GROUP_SIZE"

    # The leader's image: FROM the pinned image, adding kubectl; its service account may exec into pods.
    dockerfile = (out / "Dockerfile.leader").read_text()
    assert re.search(rf"^FROM {re.escape(TRITON_IMAGE)}$", dockerfile, re.M) and "kubectl" in dockerfile
    run = dockerfile[dockerfile.index("RUN "):]
    _bash_n(run[4:])
    assert leader["image"] == cluster.leader_image()
    account = template["leaderTemplate"]["spec"]["serviceAccountName"]
    assert docs["ServiceAccount"]["metadata"]["name"] == account
    rules = docs["Role"]["rules"]
    # create for SPDY exec (a POST), get for the WebSocket exec kubectl >= 1.30 tries first (a GET).
    [exec_rule] = [r for r in rules if "pods/exec" in r["resources"]]
    assert exec_rule["resources"] == ["pods/exec"] and {"create", "get"} <= set(exec_rule["verbs"])
    assert any("pods" in r["resources"] and {"get", "watch"} <= set(r["verbs"]) for r in rules)
    assert docs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    # The upstream example does the same: the rsh agent is an MCA parameter of its mpirun, and it
    # grants pods/exec.
    example = LWS["example"]
    assert example["rsh_agent"]["mca"] == "plm_rsh_agent"
    assert any("pods/exec" in r["resources"] and "create" in r["verbs"] for r in example["role_rules"]["rules"])
    svc = docs["Service"]
    assert svc["spec"]["selector"] == {LWS["types"]["constants"]["SetNameLabelKey"]["value"]: lws["metadata"]["name"],
                                       "role": "leader"}
    assert template["leaderTemplate"]["metadata"]["labels"]["role"] == "leader"


def test_llmapi_lws_runs_trtllm_serve_under_mpirun(tmp_path, capsys):
    root, out = tmp_path / "ws", tmp_path / "m"
    sets = ("parallelism.tp=8", "parallelism.pp=2", "parallelism.gpus=16")
    assert _serve(root, LLMAPI_8B, "--manifests", str(out), *[a for s in sets for a in ("--set", s)]) == 0
    capsys.readouterr()
    lws = _docs(out)["LeaderWorkerSet"]
    leader = _container(lws)
    mpirun = shlex.split(leader["command"][2].splitlines()[-1])
    spec = load_spec(LLMAPI_8B, sets)
    tail = mpirun[mpirun.index("-n"):]
    assert tail == ["-n", "16", "trtllm-llmapi-launch",
                    *llmapi_launch.trtllm_serve_command(spec, Workspace(root), host="0.0.0.0")]
    assert leader["startupProbe"]["httpGet"] == {"path": "/health", "port": 8080}


def test_manifests_refuse_cpu_targets_and_spanning_orchestrator(tmp_path, capsys):
    cpu = REPO / "build" / "tiny-llama.yaml"
    assert _serve(tmp_path / "ws", cpu, "--manifests", str(tmp_path / "m")) == 2
    assert "--manifests is for the GPU targets" in capsys.readouterr().err
    spec = load_spec(ENGINE_70B, ("gpu.per_node=4",))
    launch = launch_command(cluster.for_cluster(spec), Path("/repo"))
    assert launch.mode == "leader" and "--hostfile" not in launch.argv
    assert math.ceil(spec.parallelism.world_size / 4) == cluster.node_count(spec) == 2


def test_draft_target_runs_its_orchestrator_line_on_one_host(tmp_path, capsys):
    """Draft-target is one orchestrator process (TRTLLM_ORCHESTRATOR=1): the Slurm task and the pod run
    the printed line itself; spanning hosts is refused in one line."""
    spec_path = REPO / "build" / "qwen2.5-7b-draft-target.yaml"
    root, out = tmp_path / "ws", tmp_path / "m"
    assert _serve(root, spec_path, "--print") == 0
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed.startswith("TRTLLM_ORCHESTRATOR=1 mpirun ")
    argv = shlex.split(printed.replace('"${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY to the admin key}"', "KEY"))[1:]
    assert _serve(root, spec_path, "--manifests", str(out)) == 0
    capsys.readouterr()
    server = _container(_docs(out)["Deployment"])
    assert [a.replace("$(TRITON_ADMIN_KEY)", "KEY") for a in server["command"]] == argv
    assert {"name": "TRTLLM_ORCHESTRATOR", "value": "1"} in server["env"]
    directives, srun = _sbatch((out / "triton.sbatch").read_text())
    assert (directives["nodes"], directives["ntasks"]) == ("1", "1")
    i = srun.index("env")
    assert srun[i + 1] == "TRTLLM_ORCHESTRATOR=1" and [a.replace(
        "${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY to the admin key}", "KEY") for a in srun[i + 2:]] == argv
    sets = ["--set", "parallelism.tp=8", "--set", "parallelism.gpus=8", "--set", "gpu.per_node=4"]
    assert _serve(root, spec_path, "--manifests", str(tmp_path / "m2"), *sets) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: draft-target runs one orchestrator process, which cannot span 2 hosts")
    assert not (tmp_path / "m2").exists()


# -- issue 33 item 9: serving.replicas reaches the launch lines and the manifests ---------------------------------


@pytest.mark.parametrize("spec_path,sets,n", [
    (LLMAPI_8B, ("serving.replicas=4", "parallelism.tp=2", "parallelism.gpus=8"), 4),  # 4 x tp2 on one host of 8
    (ENGINE_70B, ("serving.replicas=3", "parallelism.tp=2", "parallelism.pp=1", "parallelism.gpus=6",
                  "gpu.per_node=4"), 3),  # two replicas per host of 4: the third on the next host
])
def test_replicas_launch_n_copies_on_their_own_gpus_and_ports(tmp_path, capsys, spec_path, sets, n):
    args = [a for s in sets for a in ("--set", s)] + ["--skip-check", "llmapi.runtime-version"]
    assert _serve(tmp_path / "ws", spec_path, "--print", *args) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if line.startswith("# replica ")]
    assert [h.split(":")[0] for h in heads] == [f"# replica {i} of {n}" for i in range(n)]
    # Every host line and every container of replica i: GPUs [slot*2, slot*2+2) of host i // (per_node // 2).
    per_host = load_spec(spec_path, sets).gpu.per_node // 2
    pinned = [line for line in lines if line.startswith("CUDA_VISIBLE_DEVICES=")]
    dockers = [shlex.split(line) for line in lines if line.startswith("docker run")]
    servers = len(pinned) // n
    assert servers and len(pinned) == servers * n and len(dockers) == servers * n
    for i in range(n):
        first = (i % per_host) * 2
        devices = f"{first},{first + 1}"
        assert f"GPUs {devices} of host {i // per_host}" in heads[i]
        mine = pinned[i * servers:(i + 1) * servers]
        assert all(line.startswith(f"CUDA_VISIBLE_DEVICES={devices} ") for line in mine)
        for docker in dockers[i * servers:(i + 1) * servers]:
            assert docker[docker.index("--gpus") + 1] == f'"device={devices}"'
    # ports: every replica's its own (the spec's + 100 x i), so replicas sharing a host never collide
    published = [p.rsplit(":", 2)[-1] for d in dockers for p in _published(d)]
    assert len(published) == len(set(published)) and "8100" in published and f"8{n - 1}00" in published
    ports = re.findall(r"--(?:(?:http|grpc|metrics)[-_])?port[= ](\d+)", "\n".join(pinned))
    assert len(ports) >= 3 * n and len(ports) == len(set(ports))

    out = tmp_path / "m"
    assert _serve(tmp_path / "ws", spec_path, "--manifests", str(out), *args) == 0, capsys.readouterr().err
    docs = _docs(out)  # held against Kubernetes' and LWS' schemas
    server = docs.get("Deployment") or docs["LeaderWorkerSet"]
    assert server["spec"]["replicas"] == n
    assert _container(server)["resources"]["limits"] == {"nvidia.com/gpu": 2}  # one replica's GPUs per pod
    for script in out.glob("*.sbatch"):
        text = script.read_text()
        directives, srun = _sbatch(text)
        assert directives["array"] == f"0-{n - 1}" and directives["gpus-per-node"] == "2"
        assert "+100*SLURM_ARRAY_TASK_ID))" in text and "@PORT" not in text


def test_one_replica_prints_and_writes_as_before(tmp_path, capsys):
    assert _serve(tmp_path / "ws", LLMAPI_8B, "--print") == 0
    printed = capsys.readouterr().out
    assert "# replica" not in printed and "CUDA_VISIBLE_DEVICES" not in printed and "--gpus all" in printed
    assert _serve(tmp_path / "ws", LLMAPI_8B, "--manifests", str(tmp_path / "m")) == 0
    capsys.readouterr()
    assert _docs(tmp_path / "m")["Deployment"]["spec"]["replicas"] == 1
    assert "--array" not in (tmp_path / "m" / "trtllm-serve.sbatch").read_text()


@pytest.mark.parametrize("spec_path,sets,message", [
    (REPO / "build" / "tiny-llama.yaml", ("serving.replicas=2",),
     "serving.replicas 2: target cpu serves one server on this host; set it to 1"),
    (LLMAPI_8B, ("serving.replicas=4", "parallelism.tp=2", "parallelism.gpus=4"),
     "serving.replicas x tp x pp = 4 x 2 x 1 = 8 GPUs but parallelism.gpus is 4"),
    (LLMAPI_8B, ("serving.replicas=64", "llmapi.openai_port=60000"), "replica 63 would serve port 60000 + 6300"),
])
def test_replicas_that_do_not_fit_are_one_line(tmp_path, capsys, spec_path, sets, message):
    assert _serve(tmp_path / "ws", spec_path, "--print", *[a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_serve_without_print_says_it_starts_one_replica(tmp_path, capsys):
    assert _serve(tmp_path / "ws", ENGINE_70B, "--set", "serving.replicas=2", "--set", "parallelism.gpus=16") == 2
    err = capsys.readouterr().err
    assert "note: serving.replicas 2: serve starts one replica here" in err and "no model repository" in err
