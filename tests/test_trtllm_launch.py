"""Target trtllm launch: the mpirun command of TensorRT-LLM triton_backend/scripts/launch_triton_server.py
(leader mode, orchestrator for draft-target, hostfile), the container lines,
`serve --print`, the refusal without mpirun, and start / readiness / stop of the
process group against a stand-in mpirun."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from conftest import write_spec
from toolchain.cli import main
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import load_spec
from toolchain.triton.launch import TritonLaunch, container_commands, launch_command

REPO = Path(__file__).resolve().parents[1]


def segments(argv: list[str]) -> list[list[str]]:
    """The per-rank MPMD parts of an mpirun command line (after the global options)."""
    out, cur = [], []
    start = argv.index("-n")
    for a in argv[start:]:
        if a == ":":
            out.append(cur)
            cur = []
        else:
            cur.append(a)
    return out + [cur]


def spec_with(tmp_path, **sections):
    return load_spec(write_spec(tmp_path / "s.yaml", tmp_path, target="trtllm", **sections))


def test_leader_mode_one_server_per_rank(tmp_path):
    spec = spec_with(tmp_path, parallelism={"tp": 2, "pp": 2},
                     serving={"host": "0.0.0.0", "http_port": 8000, "grpc_port": 8001, "metrics_port": 8002})
    launch = launch_command(spec, Path("/repo"), tritonserver="/opt/tritonserver/bin/tritonserver")
    assert launch.mode == "leader" and launch.world_size == 4 and launch.env == {}
    assert launch.argv[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = segments(launch.argv)
    assert len(ranks) == 4
    for i, rank in enumerate(ranks):
        assert rank[:3] == ["-n", "1", "/opt/tritonserver/bin/tritonserver"]
        assert "--model-repository=/repo" in rank and "--disable-auto-complete-config" in rank
        assert f"--backend-config=python,shm-region-prefix-name=prefix{i}_" in rank
    assert {"--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--http-address=0.0.0.0"} <= set(ranks[0])
    assert not any(a.startswith("--load-model") for a in ranks[0])
    for rank in ranks[1:]:
        assert {"--model-control-mode=explicit", "--load-model=tensorrt_llm", "--allow-http=false",
                "--allow-grpc=false", "--allow-metrics=false"} <= set(rank)
        assert not any(a.startswith(("--http-port", "--grpc-port")) for a in rank)


def test_hostfile_and_orchestrator_mode(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    spec = spec_with(tmp_path, parallelism={"tp": 8, "pp": 2}, gpu={"hostfile": str(hostfile)})
    argv = launch_command(spec, Path("/repo")).argv
    assert argv[2:4] == ["--hostfile", str(hostfile)] and len(segments(argv)) == 16
    spec = spec_with(tmp_path, speculative={"mode": "draft_target", "max_draft_len": 4},
                     serving={"streaming": False})
    launch = launch_command(spec, Path("/repo"))
    assert launch.mode == "orchestrator" and launch.env == {"TRTLLM_ORCHESTRATOR": "1"}
    [rank] = segments(launch.argv)
    assert "--cuda-memory-pool-byte-size=0:0" in rank and "--pinned-memory-pool-byte-size=0" in rank
    assert launch.shell().startswith("TRTLLM_ORCHESTRATOR=1 mpirun ")


def test_container_lines_use_the_matching_image(tmp_path):
    spec = spec_with(tmp_path, parallelism={"tp": 2})
    launch = launch_command(spec, tmp_path / "repo")
    lines = container_commands(spec, tmp_path / "repo", [tmp_path / "engines", tmp_path / "repo"])
    docker = shlex.split(lines["docker"])
    assert TRITON_IMAGE == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    assert docker[:3] == ["docker", "run", "--rm"] and TRITON_IMAGE in docker
    # The spec binds loopback: inside the container every endpoint binds every interface (a port published to
    # the container's loopback reaches nothing), and docker publishes each port on the host's loopback only.
    inside = docker[docker.index(TRITON_IMAGE) + 1:]
    assert inside == launch_command(spec, tmp_path / "repo", bind="0.0.0.0").argv
    assert [a.replace("0.0.0.0", "127.0.0.1") for a in inside] == launch.argv
    assert {"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"} <= set(inside)
    assert [docker[i + 1] for i, a in enumerate(docker) if a == "-p"] == [
        "127.0.0.1:8000:8000", "127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    assert not any("restricted" in a for a in inside)  # reached from this host only, as the spec says
    assert f"{tmp_path / 'repo'}:{tmp_path / 'repo'}" in docker
    kube = shlex.split(lines["kubernetes"])
    assert kube[:3] == ["kubectl", "run", "test-model"]
    overrides = json.loads(next(a for a in kube if a.startswith("--overrides=")).split("=", 1)[1])
    container = overrides["spec"]["containers"][0]
    assert container["command"] == launch.argv and container["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_serve_print_and_refusal_without_mpirun(tmp_path, capsys, monkeypatch):
    spec_path = REPO / "build" / "llama3-70b-sq-tp4pp2.yaml"
    root = tmp_path / "ws"
    assert main(["--root", str(root), "serve", str(spec_path), "--print"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mpirun --allow-run-as-root -n 1 ") and out[0].count(" : ") == 7
    assert out[1] == "# in a container:" and out[2].startswith("docker run") and TRITON_IMAGE in out[2]
    # serving.host 0.0.0.0: the admin key goes into a Secret first (test_exposure.py covers the lines).
    assert out[3] == "# on Kubernetes:" and "kubectl create secret generic llama3-70b-sq-tp4pp2-admin-key" in out[4]
    assert out[5].startswith("kubectl run llama3-70b-sq-tp4pp2")
    # Not printing: the repository and a 1.2 engine exist, but this host has no mpirun.
    monkeypatch.setenv("PATH", "/nonexistent")
    repo, engine = root / "model_repo" / "llama3-70b-sq-tp4pp2", root / "engines" / "llama3-70b-sq-tp4pp2" / "engine"
    repo.mkdir(parents=True)
    (repo / "manifest.json").write_text("{}")
    engine.mkdir(parents=True)
    for r in range(8):
        (engine / f"rank{r}.engine").write_bytes(b"x")
    (engine / "config.json").write_text(json.dumps({"version": "1.2.1", "pretrained_config": {"mapping": {
        "world_size": 8}}, "build_config": {"max_batch_size": 64, "max_beam_width": 1}}))
    assert main(["--root", str(root), "serve", str(spec_path), "--set", "serving.http_port=0",
                 "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]) == 2
    err = capsys.readouterr().err
    assert "mpirun not found" in err and "-trtllm-python-py3" in err and "--load-model=tensorrt_llm" in err


FAKE_MPIRUN = '''#!{python}
"""Stand-in mpirun: records its argv and environment, answers /v2/health/ready on
rank 0's --http-port, runs until SIGTERM."""
import http.server, json, os, signal, sys
argv = sys.argv[1:]
open(os.environ["FAKE_MPIRUN_RECORD"], "w").write(json.dumps({{"argv": argv,
    "orchestrator": os.environ.get("TRTLLM_ORCHESTRATOR")}}))
port = int(next(a.split("=")[1] for a in argv if a.startswith("--http-port=")))
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
'''


@pytest.mark.parametrize("mode", ["none", "draft_target"])
def test_launch_waits_for_rank_0_and_stops_the_group(tmp_path, monkeypatch, mode):
    mpirun = tmp_path / "mpirun"
    mpirun.write_text(FAKE_MPIRUN.format(python=sys.executable))
    mpirun.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_MPIRUN_RECORD", str(record))
    spec = spec_with(tmp_path, parallelism={"tp": 2}, speculative={"mode": mode, "max_draft_len": 4},
                     serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0, "streaming": mode == "none"})
    server = TritonLaunch(spec, tmp_path / "repo", tmp_path / "log.txt", str(mpirun), "/opt/tritonserver/bin/x")
    server.start(timeout=30)
    try:
        assert server.running and server.started_s is not None
        seen = json.loads(record.read_text())
        assert seen["orchestrator"] == ("1" if mode == "draft_target" else None)
        assert len(segments(seen["argv"])) == (1 if mode == "draft_target" else 2)
        assert f"--http-port={server.ports['http']}" in seen["argv"] and server.ports["http"] != 0
    finally:
        rc = server.stop()
    assert rc == 0 and not server.running
    assert os.path.exists(tmp_path / "log.txt")


def test_leader_mode_matches_upstreams_launcher(tmp_path):
    """Each rank runs what TensorRT-LLM's triton_backend/scripts/launch_triton_server.py
    (get_cmd, facts/launch.json) runs, with our ports. Three deliberate differences:
    rank 0 also binds its addresses (metrics on loopback, host 0.0.0.0 not being
    loopback) and puts its administrative APIs behind the key, and ranks > 0 switch
    their endpoints off instead of repeating rank 0's ports (they never serve: the
    backend's leader mode keeps them in the executor loop)."""
    from toolchain.triton.exposure import PLACEHOLDER, restriction_args
    from toolchain.upstream import facts

    up = facts("launch")
    upstream = up["world_size"]["2"]
    spec = spec_with(tmp_path, parallelism={"tp": 2},
                     serving={"host": "0.0.0.0", "http_port": 8000, "grpc_port": 8001, "metrics_port": 8002})
    launch = launch_command(spec, Path(up["model_repo"]), tritonserver=up["defaults"]["tritonserver"])
    assert launch.argv[:len(upstream["mpirun"])] == upstream["mpirun"]
    ours = [rank[2:] for rank in segments(launch.argv)]
    assert len(ours) == len(upstream["ranks"])
    ports = ("--http-port=", "--grpc-port=", "--metrics-port=")
    for i, (mine, theirs) in enumerate(zip(ours, upstream["ranks"])):
        assert mine[0] == theirs[0]  # the tritonserver binary first
        want = {a for a in theirs if i == 0 or not a.startswith(ports)}
        assert want <= set(mine), (i, sorted(want - set(mine)))
        extra = set(mine) - set(theirs)
        allowed = ({"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=127.0.0.1",
                    *restriction_args(PLACEHOLDER)} if i == 0 else
                   {"--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"})
        assert extra <= allowed, (i, sorted(extra - allowed))
