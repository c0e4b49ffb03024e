"""Launch lines and manifests of target llmapi: every artifact is parsed back (shlex for command
lines, yaml.safe_load for Kubernetes, the #SBATCH directives line by line) and held against the
spec and the facts read from upstream. No GPU is needed to render any of them."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import write_spec
from toolchain import upstream
from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.llmapi import launch, manifests
from toolchain.llmapi.stage import served_model_dir
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

LAUNCH_FLAGS = upstream.facts("llmapi")["launch_flags"]
RULES = upstream.facts("llmapi")["rules"]


def _spec(tmp_path: Path, checkpoint: Path, name: str = "lws-model", **sections):
    sections.setdefault("target", "llmapi")
    return load_spec(write_spec(tmp_path / f"{name}.yaml", checkpoint, name=name, **sections))


@pytest.fixture
def two_nodes(tmp_path, hf_llama):
    """tp 8 x pp 2 on hosts of 8 GPUs: 16 ranks over 2 hosts."""
    spec = _spec(tmp_path, hf_llama, parallelism={"tp": 8, "pp": 2}, gpu={"per_node": 8},
                 llmapi={"openai_port": 9090})
    return spec, Workspace(tmp_path / "ws")


def _options(argv: list[str], start: int) -> dict[str, str]:
    """`--name value` pairs of argv[start:] (click style)."""
    out, rest = {}, argv[start:]
    for i in range(0, len(rest), 2):
        assert rest[i].startswith("--"), rest
        out[rest[i]] = rest[i + 1]
    return out


def _eq_flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` arguments of argv as a dict."""
    return dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _srun_split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(srun's --name=value options, the command srun runs)."""
    assert argv[0] == "srun"
    i = 1
    while argv[i].startswith("--"):
        i += 1
    return _eq_flags(argv[1:i]), argv[i:]


# -- world and hosts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp,per_node,nodes,per_task,multi", [
    (8, 2, 8, 2, 8, True), (4, 1, 8, 1, 4, False), (8, 1, 8, 1, 8, False), (8, 3, 4, 6, 4, True),
    (6, 2, 8, 2, 6, True), (16, 4, 8, 8, 8, True)])
def test_world_and_node_math(tmp_path, hf_llama, tp, pp, per_node, nodes, per_task, multi):
    spec = _spec(tmp_path, hf_llama, parallelism={"tp": tp, "pp": pp}, gpu={"per_node": per_node})
    assert launch.world_size(spec) == tp * pp
    assert launch.node_count(spec) == nodes
    assert launch.tasks_per_node(spec) == per_task
    assert launch.tasks_per_node(spec) <= per_node and launch.tasks_per_node(spec) * nodes >= tp * pp
    assert launch.multi_node(spec) is multi


# -- command lines ---------------------------------------------------------------------------------------------


def test_trtllm_serve_line(two_nodes):
    spec, ws = two_nodes
    argv = shlex.split(launch.gpu_launch_lines(spec, ws)["trtllm_serve"])
    assert argv[:2] == ["trtllm-serve", str(served_model_dir(spec, ws))]
    opts = _options(argv, 2)
    assert set(opts) <= set(launch.serve_options())  # only options read from upstream's serve.py
    assert opts == {"--host": spec.serving.host, "--port": "9090",
                    "--extra_llm_api_options": str(ws.model_repo_dir(spec) / "trtllm-serve.yaml")}


def test_triton_launcher_line_uses_only_upstream_flags(two_nodes):
    spec, ws = two_nodes
    argv = shlex.split(launch.gpu_launch_lines(spec, ws)["triton"])
    assert argv[:2] == ["python3", "triton_backend/scripts/launch_triton_server.py"]
    flags = _eq_flags(argv[2:])
    assert len(flags) == len(argv) - 2 and set(flags) <= set(LAUNCH_FLAGS)
    # One tritonserver whose LLM() spawns the 16 ranks; a launcher world above 1 would start 16 servers.
    assert flags["--world_size"] == "1"
    assert flags["--model_repo"] == str(ws.model_repo_dir(spec))
    s = spec.serving
    assert (flags["--http_port"], flags["--grpc_port"], flags["--metrics_port"]) == (
        str(s.http_port), str(s.grpc_port), str(s.metrics_port))


def test_off_loopback_the_triton_lines_keep_the_restriction(tmp_path, hf_llama):
    """Upstream's launcher forwards no tritonserver options, so off loopback the single-host line is
    the command it runs (mpirun -n 1 tritonserver ...) with the bind addresses and the administrative
    APIs behind the key; the key is a shell reference in every printed line and script, never a value."""
    from toolchain.triton.exposure import PLACEHOLDER, restriction_args

    spec = _spec(tmp_path, hf_llama, parallelism={"tp": 8, "pp": 2}, gpu={"per_node": 8},
                 serving={"host": "0.0.0.0"})
    ws = Workspace(tmp_path / "ws")
    lines = launch.gpu_launch_lines(spec, ws)
    reference = '"${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY to the admin key}"'
    for key in ("triton", "triton_multi_node"):
        assert PLACEHOLDER not in lines[key] and lines[key].count(reference) == 2
        argv = shlex.split(lines[key].replace(reference, "KEY"))
        assert {"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=127.0.0.1",
                *restriction_args("KEY")} <= set(argv)
    assert shlex.split(lines["triton"])[:5] == ["mpirun", "--allow-run-as-root", "-n", "1",
                                                LAUNCH_FLAGS["--tritonserver"]["default"]]
    script = manifests.slurm_script(spec, ws, "triton")
    assert PLACEHOLDER not in script and script.count(reference) == 2
    assert PLACEHOLDER not in launch.planned_launch(spec, ws)["launch_command"]


def test_unknown_launcher_flag_is_a_bug_not_a_line():
    with pytest.raises(LookupError):
        launch.launch_flag("--no-such-flag")
    with pytest.raises(LookupError):
        launch.serve_option("--no-such-option")  # not declared upstream, so never emitted


def test_multi_node_lines(two_nodes):
    spec, ws = two_nodes
    lines = launch.gpu_launch_lines(spec, ws)
    for key, server in (("trtllm_serve_multi_node", "trtllm-serve"), ("triton_multi_node", "tritonserver")):
        srun, command = _srun_split(shlex.split(lines[key]))
        assert srun["--mpi"] == "pmix"
        assert (srun["--nodes"], srun["--ntasks"], srun["--ntasks-per-node"]) == ("2", "16", "8")
        assert srun["--container-image"] == "nvcr.io#" + TRITON_IMAGE.split("/", 1)[1]
        mounts = dict(m.split(":") for m in srun["--container-mounts"].split(","))
        assert all(src == dst for src, dst in mounts.items())
        assert {str(served_model_dir(spec, ws)), str(ws.model_repo_dir(spec))} <= set(mounts)
        # Upstream's rule: trtllm-llmapi-launch right before the server, on every rank.
        assert "trtllm-llmapi-launch" in RULES["llmapi_launch_prefix"]["quote"]
        assert command[0] == "trtllm-llmapi-launch" and Path(command[1]).name == server
    _, serve = _srun_split(shlex.split(lines["trtllm_serve_multi_node"]))
    assert _options(serve, 3)["--host"] == "0.0.0.0"  # reached from the other hosts
    _, triton = _srun_split(shlex.split(lines["triton_multi_node"]))
    assert triton[1] == LAUNCH_FLAGS["--tritonserver"]["default"]
    args = _eq_flags(triton[2:])
    assert args["--model-repository"] == str(ws.model_repo_dir(spec))
    assert "--disable-auto-complete-config" in triton
    assert args["--http-port"] == str(spec.serving.http_port)


def test_single_node_has_no_srun_lines(tmp_path, hf_llama):
    spec = _spec(tmp_path, hf_llama, parallelism={"tp": 4}, gpu={"per_node": 8})
    lines = launch.gpu_launch_lines(spec, Workspace(tmp_path))
    assert set(lines) == {"trtllm_serve", "triton"}
    planned = launch.planned_launch(spec, Workspace(tmp_path))
    assert shlex.split(planned["launch_command"])[0] == "python3"
    assert shlex.split(planned["openai_command"])[0] == "trtllm-serve"


def test_pyxis_image():
    assert launch.pyxis_image("nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3") == \
        "nvcr.io#nvidia/tritonserver:26.04-trtllm-python-py3"
    assert launch.pyxis_image("ubuntu:24.04") == "ubuntu:24.04"
    assert launch.pyxis_image("library/ubuntu") == "library/ubuntu"


# -- model-repo writes what the lines point at -----------------------------------------------------------------


def test_model_repo_writes_serve_yaml_and_copies_upstream_files(two_nodes, tmp_path):
    from toolchain.llmapi.repo import run_model_repo_llmapi

    spec, ws = two_nodes
    upstream_dir = tmp_path / "llmapi" / "tensorrt_llm" / "1"
    upstream_dir.mkdir(parents=True)
    (upstream_dir / "model.py").write_text("# stands in for upstream's llmapi model.py\n")
    (upstream_dir / "helpers.py").write_text("# stands in for upstream's helpers.py\n")
    run_model_repo_llmapi(spec, ws, python_models=tmp_path / "llmapi")
    argv = shlex.split(launch.gpu_launch_lines(spec, ws)["trtllm_serve"])
    config = Path(_options(argv, 2)["--extra_llm_api_options"])
    assert config.is_file()
    data = yaml.safe_load(config.read_text())
    assert data["tensor_parallel_size"] == 8 and data["pipeline_parallel_size"] == 2 and "model" not in data
    version = ws.model_repo_dir(spec) / "tensorrt_llm" / "1"
    for name in ("model.py", "helpers.py"):
        assert (version / name).read_text() == (upstream_dir / name).read_text()
    model_yaml = yaml.safe_load((version / "model.yaml").read_text())
    assert model_yaml["model"] == argv[1]  # trtllm-serve and Triton serve the same checkpoint


# -- Slurm -------------------------------------------------------------------------------------------------------


def _sbatch(text: str) -> tuple[dict[str, str], list[str]]:
    """(#SBATCH directives, the srun command) of a generated script."""
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = {}
    for line in lines[1:]:
        if not line.startswith("#SBATCH"):
            break
        key, value = line.split(None, 1)[1].split("=", 1)
        directives[key.removeprefix("--")] = value
    # sbatch stops reading directives at the first command, so all must come first.
    assert sum(line.startswith("#SBATCH") for line in lines) == len(directives)
    body = "\n".join(line for line in lines if not line.startswith("#"))
    commands = [shlex.split(c) for c in body.replace("\\\n", " ").splitlines() if c.strip()]
    assert commands[0] == ["set", "-euo", "pipefail"]
    return directives, commands[1]


@pytest.mark.parametrize("server,binary", [("trtllm-serve", "trtllm-serve"), ("triton", "tritonserver")])
def test_slurm_script(two_nodes, server, binary):
    spec, ws = two_nodes
    text = manifests.slurm_script(spec, ws, server)
    directives, srun = _sbatch(text)
    assert directives == {"job-name": f"lws-model-{server}", "nodes": "2", "ntasks": "16", "ntasks-per-node": "8",
                          "gpus-per-node": "8"}
    options, command = _srun_split(srun)
    assert options["--container-image"] == launch.pyxis_image(TRITON_IMAGE)
    assert (options["--nodes"], options["--ntasks"]) == (directives["nodes"], directives["ntasks"])
    assert command[0] == "trtllm-llmapi-launch" and Path(command[1]).name == binary
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


# -- Kubernetes --------------------------------------------------------------------------------------------------


def test_leader_worker_set(two_nodes):
    spec, ws = two_nodes
    texts = manifests.manifests(spec, ws)
    assert set(texts) == set(manifests.FILES.values()) - {"deployment.yaml"}
    lws = yaml.safe_load(texts["leaderworkerset.yaml"])
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 == launch.node_count(spec)
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    assert worker["image"] == TRITON_IMAGE and leader["image"] != TRITON_IMAGE  # Dockerfile.leader's
    for container in (leader, worker):
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        mounted = {m["mountPath"] for m in container["volumeMounts"]}
        assert {str(served_model_dir(spec, ws)), str(ws.model_repo_dir(spec)), "/dev/shm"} <= mounted
    probe = leader["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": 9090}
    assert leader["ports"] == [{"name": "openai", "containerPort": 9090}]
    script = leader["command"][2]
    last = shlex.split(script.splitlines()[-1])
    assert last[:3] == ["exec", "mpirun", "--allow-run-as-root"] and last[last.index("-n") + 1] == "16"
    i = last.index("trtllm-llmapi-launch")
    assert last[i + 1:] == launch.trtllm_serve_command(spec, ws, host="0.0.0.0")
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "sshd" not in " ".join(worker["command"]) and "kubectl exec" in script

    svc = yaml.safe_load(texts["service.yaml"])
    assert (svc["apiVersion"], svc["kind"]) == ("v1", "Service")
    assert svc["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"], "role": "leader"}
    assert template["leaderTemplate"]["metadata"]["labels"]["role"] == "leader"
    assert svc["spec"]["ports"][0]["port"] == svc["spec"]["ports"][0]["targetPort"] == 9090


def test_single_node_is_a_deployment(tmp_path, hf_llama):
    spec = _spec(tmp_path, hf_llama, parallelism={"tp": 4}, gpu={"per_node": 8})
    ws = Workspace(tmp_path)
    texts = manifests.manifests(spec, ws)
    assert "leaderworkerset.yaml" not in texts and "rbac.yaml" not in texts
    deploy = yaml.safe_load(texts["deployment.yaml"])
    (server,) = deploy["spec"]["template"]["spec"]["containers"]
    # LLM() starts a worker per GPU itself on one host: trtllm-serve alone, no mpirun.
    assert server["command"] == launch.trtllm_serve_command(spec, ws, host="0.0.0.0")
    assert server["resources"]["limits"] == {"nvidia.com/gpu": 4}
    svc = yaml.safe_load(texts["service.yaml"])
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]


def test_k8s_name(tmp_path, hf_llama):
    spec = _spec(tmp_path, hf_llama, name="9_My.Model_v2")
    assert manifests.k8s_name(spec) == "my-model-v2"


def test_manifests_refuse_cpu_target(tmp_path, hf_llama):
    spec = _spec(tmp_path, hf_llama, target="llmapi-cpu")
    with pytest.raises(ToolchainError, match="target llmapi"):
        manifests.manifests(spec, Workspace(tmp_path))


def test_write_manifests_atomic_and_guarded(two_nodes, tmp_path):
    spec, ws = two_nodes
    out = tmp_path / "out"
    paths = manifests.write_manifests(spec, ws, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)
    manifests.write_manifests(spec, ws, out)  # rewriting its own output is fine
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ToolchainError, match="other files"):
        manifests.write_manifests(spec, ws, out)
    assert (out / "notes.txt").read_text() == "mine"


# -- CLI ---------------------------------------------------------------------------------------------------------


def test_cli_print_and_manifests(two_nodes, tmp_path, capsys):
    spec, ws = two_nodes
    out = tmp_path / "manifests"
    rc = main(["--root", str(ws.root), "serve", str(spec.source), "--print", "--manifests", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    lines = [line for line in printed.splitlines() if not line.startswith(("#", "docker run"))]
    expected = launch.gpu_launch_lines(spec, ws)
    assert lines == [expected["trtllm_serve"], expected["triton"], expected["trtllm_serve_multi_node"],
                     expected["triton_multi_node"]]
    assert (out / "leaderworkerset.yaml").is_file() and f"# wrote {out / 'service.yaml'}" in printed


def test_cli_llmapi_refuses_to_run_here_and_manifests_need_llmapi(two_nodes, tmp_path, capsys):
    spec, ws = two_nodes
    # Here no TensorRT-LLM is installed: the serve preflight names the image to serve in.
    assert main(["--root", str(ws.root), "serve", str(spec.source)]) == 2
    assert "llmapi.runtime-version" in capsys.readouterr().err
    # With it (skipped here), a multi-host spec is refused naming the manifests.
    assert main(["--root", str(ws.root), "serve", str(spec.source), "--skip-check", "llmapi.runtime-version",
                 "--skip-check", "serve.ports-free"]) == 2
    assert "--manifests DIR" in capsys.readouterr().err
    cpu = _spec(tmp_path, spec.model.checkpoint, name="cpu-model", target="llmapi-cpu")
    assert main(["--root", str(ws.root), "serve", str(cpu.source), "--print", "--manifests", str(tmp_path / "m")]) == 2
    assert "--manifests is for the GPU targets trtllm and llmapi, not llmapi-cpu" in capsys.readouterr().err


@pytest.mark.parametrize("threads", [1, 2])
def test_the_cpu_openai_server_steps_the_engine_with_tritons_threads(tmp_path, hf_llama, threads):
    """llmapi-cpu: the OpenAI server's engine gets serving.engine_threads torch threads, as Triton's llmapi
    model does (its config.pbtxt parameter), not torch's default of every core; in the printed line and in
    the server deploy starts."""
    from toolchain.pipeline import openai_server
    from toolchain.llmapi.repo import model_config

    spec = _spec(tmp_path, hf_llama, target="llmapi-cpu", serving={"engine_threads": threads})
    ws = Workspace(tmp_path / "ws")
    assert model_config(spec).parameters["engine_threads"] == str(threads)
    for argv in (launch.openai_cpu_command(spec, ws), openai_server(spec, ws, tmp_path / "log").command()):
        assert argv[argv.index("--engine-threads") + 1] == str(threads)


def test_serve_and_deploy_of_llmapi_cpu_check_the_openai_port_before_anything_starts(tmp_path, capsys):
    """Issue 33: on target llmapi-cpu serve and deploy start the OpenAI server beside Triton, so
    llmapi.openai_port is checked with Triton's ports before either starts, naming the field; two servers
    given one port are refused the same way."""
    import socket

    from toolchain.checks.preflight import PreflightFailed, run_preflight

    tiny = Path(__file__).resolve().parents[1] / "build" / "tiny-llama-llmapi.yaml"
    root = tmp_path / "ws"
    free = ["--set", "serving.http_port=0", "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        taken = [*free, "--set", f"llmapi.openai_port={port}"]
        spec = load_spec(tiny, [o for o in taken if o != "--set"])
        with pytest.raises(PreflightFailed, match=f"serve.ports-free failed: llmapi.openai_port={port} already in use"):
            run_preflight(spec, "serve", Workspace(root))
        assert main(["--root", str(root), "model-repo", str(tiny)]) == 0
        for command in ("serve", "deploy"):
            capsys.readouterr()
            assert main(["--root", str(root), command, str(tiny), *taken]) == 2
            err = capsys.readouterr().err
            assert f"llmapi.openai_port={port} already in use on 127.0.0.1" in err and len(err.splitlines()) == 1, err
    log = Workspace(root).model_repo_dir(spec).parent / "tiny-llama-llmapi.tritonserver.log"
    assert not log.exists() and not (root / "reports").exists()  # no server started, nothing benched
    same = ["--set", f"serving.http_port={port}", "--set", f"llmapi.openai_port={port}", *free[2:]]
    assert main(["--root", str(root), "serve", str(tiny), *same]) == 2
    assert f"serving.http_port and llmapi.openai_port are both {port}" in capsys.readouterr().err


def test_the_printed_openai_line_runs_with_the_venvs_python(tmp_path, hf_llama):
    """Issue 33: `serve --print` (and plan) of an llmapi-cpu spec print the OpenAI server's line with this
    interpreter, the venv's, as serve starts it: a bare `python` outside the activated venv has no toolchain."""
    import sys

    from toolchain.pipeline import openai_server, print_local_launch, server_for

    spec = _spec(tmp_path, hf_llama, target="llmapi-cpu")
    ws = Workspace(tmp_path / "ws")
    printed: list[str] = []
    print_local_launch(spec, ws, server_for(spec, ws, read_key=False), lambda text: printed.extend(text.splitlines()))
    argv = shlex.split(printed[printed.index("# OpenAI server on the same LLM() arguments:") + 1])
    assert argv[:3] == [sys.executable, "-m", "toolchain.openai"]
    assert argv[0] == openai_server(spec, ws, tmp_path / "log").command()[0]
    assert shlex.split(launch.planned_launch(spec, ws)["openai_command"])[0] == sys.executable
