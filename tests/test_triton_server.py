"""The tritonserver launcher against the real server from the nvidia-pytriton wheel."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from toolchain.errors import StageFailed, ToolchainError
from toolchain.triton.runtime import resolve_binary, server_env
from toolchain.triton.server import TritonServer, diagnose_log, port_in_use
from triton_helpers import stream, tensor, write_echo_model


@pytest.fixture
def echo_repo(tmp_path):
    repo = tmp_path / "repo"
    write_echo_model(repo)
    (repo / "manifest.json").write_text("{}")  # a plain file at the root must not bother the server
    return repo


def _group_alive(pgid: int, wait_s: float = 5.0) -> bool:
    """True while a live (non-zombie) process of group `pgid` exists. Zombies are
    ignored: in a container PID 1 may never reap the orphaned stubs."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive = True
                break
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.e2e
def test_streams_from_a_decoupled_model_and_stops(echo_repo, tmp_path):
    server = TritonServer(echo_repo, log_path=tmp_path / "server.log", exit_timeout_s=5)
    with server:
        assert server.ready and server.started_s is not None
        assert all(server.ports[k] > 0 for k in ("http", "grpc", "metrics"))
        assert len(set(server.ports.values())) == 3
        got = stream(server.grpc_url, "echo", [tensor("IN", [4, 5, 6], "INT32", batch=False)])
        assert not got.errors, got.errors
        assert [int(a.reshape(-1)[0]) for a in got.outputs("OUT")] == [4, 5, 6]
        assert got.finals == 1
        pgid = server.process.pid
    assert not server.running
    assert not _group_alive(pgid)  # stubs went down with the server
    log = (tmp_path / "server.log").read_text()
    assert "Started GRPCInferenceService at 127.0.0.1:" in log  # bound to the address asked for


def test_port_in_use_is_refused_before_start(echo_repo):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        server = TritonServer(echo_repo, http_port=port)
        with pytest.raises(ToolchainError) as err:
            server.start(timeout=30)
    message = str(err.value)
    assert f"http port {port}" in message and "serving.http_port" in message and "\n" not in message
    assert server.process is None


@pytest.mark.e2e
def test_model_load_failure_names_the_model(tmp_path):
    repo = tmp_path / "repo"
    write_echo_model(repo, "healthy")
    write_echo_model(repo, "broken", fail_with="tokenizer_dir is wrong\nsecond line")
    server = TritonServer(repo, log_path=tmp_path / "server.log", exit_timeout_s=2)
    with pytest.raises(StageFailed) as err:
        server.start(timeout=120)
    message = str(err.value)
    assert "model 'broken' failed to load" in message
    assert "tokenizer_dir is wrong" in message and "second line" not in message
    assert "\n" not in message
    assert not server.running


def test_diagnose_log_lines_of_tritonserver_2_51():
    grpc = ('E1129 19:25:43.483047 6361 main.cc:245] "failed to start GRPC service: Unavailable - '
            "Socket '127.0.0.1:46075' already in use \"")
    http = ('E1129 19:25:44.727395 6416 main.cc:257] "failed to start HTTP service: Unavailable - '
            "Socket '127.0.0.1:18000' already in use \"")
    harmless = 'E1129 19:25:43.382745 6361 server.cc:241] "CudaDriverHelper has not been initialized."'
    bad_proto = ("[libprotobuf ERROR text_format.cc:337] Error parsing text-format inference.ModelConfig: "
                 "3:17: Expected integer, got: $\n"
                 'E1129 model_repository_manager.cc:1460] "Poll failed for model directory \'x\': '
                 'failed to read text proto from /r/x/config.pbtxt"')
    assert "grpc port 46075" in diagnose_log(harmless + "\n" + grpc, "127.0.0.1")
    assert "serving.http_port" in diagnose_log(http)
    assert diagnose_log(harmless) is None
    line = diagnose_log(bad_proto)
    assert line.startswith("model 'x' failed to load") and "Expected integer" in line


def test_binary_resolution_and_environment(tmp_path, monkeypatch):
    with pytest.raises(ToolchainError, match="serving.tritonserver"):
        resolve_binary(tmp_path / "no-such-tritonserver")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: the wheel's server
    found = resolve_binary()
    assert found.source == "nvidia-pytriton" and found.needs_backend_dir
    env = server_env(found, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["PATH"].split(os.pathsep)[0].endswith("bin") and env["PATH"].endswith("/usr/bin")
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[-1] == "/opt/lib" and any(p.endswith("nvidia_pytriton.libs") for p in libs)


def test_command_line_binds_every_endpoint(echo_repo):
    server = TritonServer(echo_repo, host="127.0.0.1", http_port=18100, grpc_port=18101, metrics_port=18102,
                          exit_timeout_s=7)
    cmd = server.command()
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--http-port=18100", "--grpc-port=18101", "--metrics-port=18102", "--exit-timeout-secs=7",
                 "--disable-auto-complete-config", "--allow-gpu-metrics=false"):
        assert flag in cmd
    backend = next(a for a in cmd if a.startswith("--backend-directory=")).split("=", 1)[1]
    stub = os.path.join(backend, "python", "triton_python_backend_stub")
    assert os.access(stub, os.X_OK)


@pytest.mark.e2e
def test_stop_kills_a_server_that_ignores_sigterm(echo_repo, tmp_path):
    server = TritonServer(echo_repo, log_path=tmp_path / "server.log", exit_timeout_s=30)
    server.start(timeout=60)
    pgid = server.process.pid
    os.kill(pgid, signal.SIGSTOP)  # a hung server: SIGTERM alone would never end it
    rc = server.stop(timeout=1)
    assert rc == -signal.SIGKILL
    assert not _group_alive(pgid)
