"""Serving off loopback: Triton's administrative APIs behind a key (restricted-API
options), metrics on loopback, the one-line warning, the key read from the
environment or a file and never printed. The restriction is checked against the
real tritonserver of the nvidia-pytriton wheel."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import write_spec
from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.versions import TRITON_IMAGE
from toolchain.spec import load_spec
from toolchain.triton import exposure
from toolchain.triton.launch import TritonLaunch, container_commands, launch_command
from toolchain.triton.server import TritonServer
from triton_helpers import stream, tensor, write_echo_model

REPO = Path(__file__).resolve().parents[1]
KEY = "k3y-for-tests-0123456789abcdef"
ENV = "TRITON_ADMIN_KEY"


def spec_with(tmp_path, **serving):
    target = serving.pop("target", "cpu")
    return load_spec(write_spec(tmp_path / "s.yaml", tmp_path, target=target,
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0, **serving}))


def exposed_address() -> str:
    """This machine's non-loopback IPv4 address if it has one (a UDP connect sends
    nothing, it only picks the outgoing interface), else 0.0.0.0."""
    candidates = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            candidates.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for ip in candidates:
        if not exposure.is_loopback(ip) and ip != "0.0.0.0":
            try:
                with socket.socket() as probe:
                    probe.bind((ip, 0))
                return ip
            except OSError:
                continue
    return "0.0.0.0"


def http(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


# ---- the rules ---------------------------------------------------------------------------------------------------

def test_loopback_and_metrics_address(tmp_path):
    assert all(exposure.is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost", "[::1]"))
    assert not any(exposure.is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "node-a", ""))
    local = spec_with(tmp_path).serving
    assert not exposure.restricted(local) and exposure.metrics_host(local) == "127.0.0.1"
    assert exposure.warning(local) is None
    wide = spec_with(tmp_path, host="0.0.0.0").serving
    assert exposure.restricted(wide) and exposure.metrics_host(wide) == "127.0.0.1"
    asked = spec_with(tmp_path, host="0.0.0.0", metrics_host="0.0.0.0").serving
    assert exposure.metrics_host(asked) == "0.0.0.0"
    line = exposure.warning(wide)
    assert line.startswith("warning: ") and "\n" not in line and "$TRITON_ADMIN_KEY" in line
    assert "metrics on 127.0.0.1" in line


def test_key_from_environment_or_file_and_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    s = spec_with(tmp_path, host="0.0.0.0").serving
    with pytest.raises(ToolchainError, match=r"\$TRITON_ADMIN_KEY is not set") as err:
        exposure.read_admin_key(s)
    assert "\n" not in str(err.value) and "openssl rand" in str(err.value)
    monkeypatch.setenv(ENV, "")
    with pytest.raises(ToolchainError, match="is empty"):
        exposure.read_admin_key(s)
    monkeypatch.setenv(ENV, "short")
    with pytest.raises(ToolchainError, match="at least 16"):
        exposure.read_admin_key(s)
    monkeypatch.setenv(ENV, KEY)
    assert exposure.read_admin_key(s) == KEY
    other = spec_with(tmp_path, host="0.0.0.0", admin_key_env="MY_KEY").serving
    assert exposure.read_admin_key(other, {"MY_KEY": KEY}) == KEY

    key_file = tmp_path / "admin.key"
    with_file = spec_with(tmp_path, host="0.0.0.0", admin_key_file="admin.key").serving
    assert with_file.admin_key_file == key_file  # relative to the spec's directory
    with pytest.raises(ToolchainError, match="admin_key_file .* cannot be read") as err:
        exposure.read_admin_key(with_file)
    assert "\n" not in str(err.value)
    key_file.write_text("\n")
    with pytest.raises(ToolchainError, match="admin_key_file .* is empty") as err:
        exposure.read_admin_key(with_file)
    assert "\n" not in str(err.value)
    key_file.write_text(KEY + "\n")
    assert exposure.read_admin_key(with_file) == KEY  # the file wins over the variable
    # A key file asks for the restriction even on loopback.
    assert exposure.restricted(spec_with(tmp_path, admin_key_file="admin.key").serving)


def test_missing_key_stops_serve_and_deploy_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    spec = spec_with(tmp_path, host="0.0.0.0", admin_key_file="missing.key")
    with pytest.raises(ToolchainError):
        TritonServer.from_spec(spec, tmp_path)
    with pytest.raises(ToolchainError):
        TritonLaunch(spec, tmp_path, tmp_path / "log", "mpirun", "tritonserver")
    # deploy reads the key before converting anything.
    assert main(["--root", str(tmp_path / "ws"), "deploy", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "missing.key cannot be read" in err[-1]
    assert not (tmp_path / "ws" / "engines").exists()


def test_command_line_flags(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    write_echo_model(repo)
    monkeypatch.setenv(ENV, KEY)
    server = TritonServer.from_spec(spec_with(tmp_path, host="0.0.0.0"), repo)
    group = "model-repository,shared-memory,statistics,trace,logging:admin-key="
    assert f"--http-restricted-api={group}{KEY}" in server.command(reveal_key=True)
    assert f"--grpc-restricted-protocol={group}{KEY}" in server.command(reveal_key=True)
    assert {"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=127.0.0.1"} <= set(server.command())
    # What is printed refers to the key.
    assert KEY not in " ".join(server.command()) and KEY not in server.command_line()
    printed = server.command_line(exposure.shell_reference(spec_with(tmp_path, host="0.0.0.0").serving))
    assert f'--http-restricted-api={group}"${{TRITON_ADMIN_KEY:?' in printed
    asked = TritonServer.from_spec(spec_with(tmp_path, host="0.0.0.0", metrics_host="0.0.0.0"), repo)
    assert "--metrics-address=0.0.0.0" in asked.command()
    local = TritonServer.from_spec(spec_with(tmp_path), repo)
    assert not any("restricted" in a for a in local.command())  # loopback: as before


# ---- against the real server -------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_restricted_apis_refuse_requests_without_the_key(tmp_path, monkeypatch):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    repo = tmp_path / "repo"
    write_echo_model(repo)
    host = exposed_address()
    monkeypatch.setenv(ENV, KEY)
    server = TritonServer.from_spec(spec_with(tmp_path, host=host), repo, log_path=tmp_path / "server.log",
                                    exit_timeout_s=5)
    with server:
        base = server.http_url
        status, body = http(f"{base}/v2/repository/index", "POST")
        assert status == 403 and "admin-key" in body
        status, body = http(f"{base}/v2/repository/index", "POST", {"admin-key": KEY + "x"})
        assert status == 403
        status, body = http(f"{base}/v2/repository/index", "POST", {"admin-key": KEY})
        assert status == 200 and json.loads(body)[0]["name"] == "echo"
        for path in ("/v2/logging", "/v2/trace/setting", "/v2/models/stats", "/v2/systemsharedmemory/status"):
            assert http(base + path)[0] == 403, path
            assert http(base + path, headers={"admin-key": KEY})[0] == 200, path
        # What a client needs before inferring stays open.
        for path in ("/v2/health/ready", "/v2", "/v2/models/echo", "/v2/models/echo/config"):
            assert http(base + path)[0] == 200, path

        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="restricted"):
                client.get_model_repository_index(as_json=True)
            index = client.get_model_repository_index(as_json=True, headers={exposure.GRPC_HEADER: KEY})
            assert [m["name"] for m in index["models"]] == ["echo"]
            with pytest.raises(InferenceServerException, match="restricted"):
                client.get_log_settings(as_json=True)
        finally:
            client.close()
        got = stream(server.grpc_url, "echo", [tensor("IN", [1, 2], "INT32", batch=False)])  # no key
        assert not got.errors and [int(a.reshape(-1)[0]) for a in got.outputs("OUT")] == [1, 2]

        assert server.metrics_url.startswith("http://127.0.0.1:")
        assert http(server.metrics_url)[0] == 200
        if host != "0.0.0.0":  # metrics are not on the exposed address
            with pytest.raises(OSError):
                socket.create_connection((host, server.ports["metrics"]), timeout=2).close()
    log = (tmp_path / "server.log").read_text()
    assert f"Started Metrics Service at 127.0.0.1:{server.ports['metrics']}" in log
    assert f"Started HTTPService at {host}:" in log


# ---- the printed lines (target trtllm) ---------------------------------------------------------------------------

FAKE_MPIRUN = f'''#!{sys.executable}
import json, os, sys
open(os.environ["ARGV_RECORD"], "w").write(json.dumps(sys.argv[1:]))
'''


def _run_line(line: str, tmp_path: Path, env: dict) -> list[str]:
    """Run a printed line with a stand-in mpirun first on PATH; returns the argv it got."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "mpirun").write_text(FAKE_MPIRUN)
    (bindir / "mpirun").chmod(0o755)
    record = tmp_path / "argv.json"
    record.unlink(missing_ok=True)
    run_env = {"PATH": f"{bindir}:/usr/bin:/bin", "ARGV_RECORD": str(record), **env}
    done = subprocess.run(["sh", "-c", line], env=run_env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(record.read_text())


def test_printed_lines_keep_the_restriction_without_the_secret(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, KEY)  # set here too: it must still not be printed
    spec = spec_with(tmp_path, target="trtllm", host="0.0.0.0", http_port=8000, grpc_port=8001, metrics_port=8002)
    launch = launch_command(spec, tmp_path / "repo")
    lines = container_commands(spec, tmp_path / "repo", [tmp_path / "repo"])
    assert all(KEY not in line for line in [launch.shell(), *lines.values()])
    group = "model-repository,shared-memory,statistics,trace,logging:admin-key="

    # mpirun on the host: the shell expands the variable into rank 0's argv; unset, it refuses.
    argv = _run_line(launch.shell(), tmp_path, {ENV: KEY})
    assert f"--http-restricted-api={group}{KEY}" in argv and f"--grpc-restricted-protocol={group}{KEY}" in argv
    done = subprocess.run(["sh", "-c", launch.shell()], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True)
    assert done.returncode != 0 and "set TRITON_ADMIN_KEY" in done.stderr

    # docker: -e VAR without a value (docker copies it from its environment), a shell in the container.
    docker = shlex.split(lines["docker"])
    assert ["-e", ENV] == docker[docker.index(ENV) - 1:docker.index(ENV) + 1]
    # Every endpoint binds every interface inside the container; metrics are published on the host's loopback
    # only (a metrics endpoint bound to the container's own loopback is reached by nothing).
    published = [docker[i + 1] for i, a in enumerate(docker) if a == "-p"]
    assert published == ["8000:8000", "8001:8001", "127.0.0.1:8002:8002"]
    image = docker.index(TRITON_IMAGE)
    assert docker[image + 1:image + 3] == ["sh", "-c"]
    argv = _run_line(docker[image + 3], tmp_path, {ENV: KEY})
    inside = launch_command(spec, tmp_path / "repo", bind="0.0.0.0")
    assert argv == [a.replace(exposure.PLACEHOLDER, KEY) for a in inside.argv[1:]]
    assert "--metrics-address=0.0.0.0" in argv and f"--http-restricted-api={group}{KEY}" in argv

    # Kubernetes: the key from a Secret, expanded by Kubernetes in the command ($(VAR)).
    kube = shlex.split(lines["kubernetes"])
    container = json.loads(next(a for a in kube if a.startswith("--overrides=")).split("=", 1)[1])["spec"]["containers"][0]
    assert f"--http-restricted-api={group}$({ENV})" in container["command"]
    assert f"--grpc-restricted-protocol={group}$({ENV})" in container["command"]
    ref = {"name": ENV, "valueFrom": {"secretKeyRef": {"name": "test-model-admin-key", "key": "admin-key"}}}
    assert ref in container["env"] and {"containerPort": 8002} not in container["ports"]
    secret = lines["kubernetes_secret"]
    assert "kubectl create secret generic test-model-admin-key --from-file=admin-key=/dev/stdin" in secret
    assert secret.startswith('printf %s "${TRITON_ADMIN_KEY:?')


def test_printed_lines_with_a_key_file(tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY + "\n")
    spec = spec_with(tmp_path, target="trtllm", host="0.0.0.0", admin_key_file="admin.key")
    launch = launch_command(spec, tmp_path / "repo")
    argv = _run_line(launch.shell(), tmp_path, {})
    assert f"--http-restricted-api=model-repository,shared-memory,statistics,trace,logging:admin-key={KEY}" in argv
    lines = container_commands(spec, tmp_path / "repo", [tmp_path / "repo"])
    assert all(KEY not in line for line in lines.values())
    docker = shlex.split(lines["docker"])
    assert f"{key_file}:/run/secrets/triton-admin-key:ro" in docker and ENV not in docker
    assert '"$(cat /run/secrets/triton-admin-key)"' in docker[-1]
    assert lines["kubernetes_secret"].startswith(f'printf %s "$(cat {key_file})" | kubectl create secret')


def test_serve_print_warns_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # printing needs no key
    assert main(["--root", str(tmp_path / "ws"), "serve", str(REPO / "build" / "llama3-70b-sq-tp4pp2.yaml"),
                 "--print"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "administrative APIs" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: tritonserver listens on 0.0.0.0")
    out = captured.out.splitlines()
    assert "--http-restricted-api=" in out[0] and "--metrics-address=127.0.0.1" in out[0]
    assert "sh -c" in out[2] and "-e TRITON_ADMIN_KEY " in out[2]


def test_launch_passes_the_key_to_rank_0(tmp_path, monkeypatch):
    from test_trtllm_launch import FAKE_MPIRUN as READY_MPIRUN

    mpirun = tmp_path / "mpirun"
    mpirun.write_text(READY_MPIRUN.format(python=sys.executable))
    mpirun.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_MPIRUN_RECORD", str(record))
    monkeypatch.setenv(ENV, KEY)
    spec = spec_with(tmp_path, target="trtllm", host="0.0.0.0")
    server = TritonLaunch(spec, tmp_path / "repo", tmp_path / "log.txt", str(mpirun), "/opt/tritonserver/bin/x")
    server.start(timeout=30)
    try:
        argv = json.loads(record.read_text())["argv"]
        assert any(a.endswith(f"admin-key={KEY}") and a.startswith("--http-restricted-api=") for a in argv)
        assert server.urls["metrics"].startswith("http://127.0.0.1:")
    finally:
        server.stop()
    assert os.path.exists(tmp_path / "log.txt")
