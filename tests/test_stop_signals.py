"""Stopped is stopped: SIGTERM, SIGINT and SIGHUP sent to a command that started servers, in the middle of its
run, end it only after everything it started is gone: no process of the run alive, no port it listened on still
held, no /dev/shm region or temporary directory of the run left.

Every run here carries a marker in its environment, inherited by everything it starts (tritonserver, its
Python-backend stubs, the OpenAI server, Dynamo's frontend and workers), so what outlived it is found in /proc
whatever process group or parent it ended up with."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from conftest import TINY_TRAINED
from toolchain.netutil import port_in_use
from toolchain.procgroup import pid_running

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from toolchain.cli import main; sys.exit(main())"
FREE_PORTS = ["--set", "serving.http_port=0", "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]
MARKER = "TOOLCHAIN_STOP_SIGNALS_TEST"

needs_tiny = pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="embedded model missing")


def _marked(marker: str) -> set[int]:
    """Live processes (zombies excluded) whose environment holds `marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if needle in env.split(b"\0") and pid_running(int(entry)):
                found.add(int(entry))
    return found


def _listening(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state on sockets that `pids` hold open."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


class Run:
    """A command run with the marker, its temporary directory under `tmp`, its output read line by line."""

    def __init__(self, argv: list[str], tmp: Path):
        self.marker = uuid.uuid4().hex
        self.tmpdir = tmp / "TMPDIR"
        self.tmpdir.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), MARKER: self.marker, "TMPDIR": str(self.tmpdir)}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=env)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready: str | Callable[[], bool], timeout: float) -> None:
        """Until a line of output matches `ready` (a pattern) or `ready()` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                line = ""
            if line is None:
                pytest.fail(f"exited (code {self.proc.wait()}) before it was ready:\n{self.text}")
            self.lines.append(line)
            if re.search(ready, line, re.M) if isinstance(ready, str) else ready():
                return
        pytest.fail(f"not ready after {timeout:.0f} s:\n{self.text}")

    def stop_with(self, sig: int, timeout: float = 120) -> int:
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout:.0f} s after {signal.Signals(sig).name}:\n{self.text}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the reader thread drains the rest of the output
            line = self._queue.get(timeout=5)
            if line is None:
                break
            self.lines.append(line)
        return rc

    def kill_leftovers(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for region in Path("/dev/shm").glob(f"tc{self.proc.pid}_*"):  # a failed run leaves no debris either
            region.unlink(missing_ok=True)


def _stopped_mid_run(argv: list[str], tmp: Path, ready: str | Callable[[Run], bool], sig: int, *, shm: bool,
                     children: bool = True, work_dir: str | None = None, settle_s: float = 2.0) -> Run:
    """Run `argv` until a line matches `ready`, let it work `settle_s`, send `sig`, and check that nothing it
    started is left. `shm`: the run's tritonservers hold /dev/shm regions (named after the command's pid);
    `children`: it starts processes; `work_dir`: the glob of a temporary directory it works in."""
    run = Run(argv, tmp)
    try:
        run.wait_for(ready if isinstance(ready, str) else lambda: ready(run), 600)
        time.sleep(settle_s)
        started = _marked(run.marker) - {run.proc.pid}
        assert bool(started) == children, f"processes of the run: {sorted(started)}\n{run.text}"
        if work_dir is not None:
            assert list(run.tmpdir.glob(work_dir)), list(run.tmpdir.iterdir())
        ports = _listening(started | {run.proc.pid})
        assert ports, f"no process of the run listens:\n{run.text}"
        regions = sorted(p.name for p in Path("/dev/shm").glob(f"tc{run.proc.pid}_*"))
        assert bool(regions) == shm, regions
        rc = run.stop_with(sig)
        left = _marked(run.marker)
        assert not left, f"still running after {signal.Signals(sig).name}: {sorted(left)}\n{run.text}"
        assert not [p for p in ports if port_in_use("127.0.0.1", p)], f"ports {sorted(ports)} still held"
        assert not list(Path("/dev/shm").glob(f"tc{run.proc.pid}_*")), "its /dev/shm regions are left"
        # Logs stay on purpose, and torch keeps its compile cache; work directories must go.
        left_tmp = [p.name for p in run.tmpdir.iterdir() if p.suffix != ".log" and not p.name.startswith("torchinductor_")]
        assert not left_tmp, f"temporary files left: {left_tmp}"
        run.rc = rc  # type: ignore[attr-defined]
        return run
    finally:
        run.kill_leftovers()


def _cli(tmp: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", CLI, "--root", str(tmp / "root"), *args]


# ---- the helper itself, on a real process group ----------------------------------------------------------------

GUARDED = """
import sys, time
from pathlib import Path
from toolchain.stopsignals import Stopped, stop_on_signals
from toolchain import procgroup

try:
    with stop_on_signals():
        proc, log = procgroup.spawn(["sleep", "600"], {"PATH": "/usr/bin:/bin"}, Path(sys.argv[1]))
        try:
            print(proc.pid, flush=True)
            time.sleep(600)
        finally:
            time.sleep(0.5)  # a second signal arrives while stopping: it must not cut the stop short
            procgroup.stop_group(proc, 5)
except Stopped as err:
    print(err, flush=True)
    sys.exit(err.exit_code)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_each_stop_signal_stops_the_group_the_block_started(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-c", GUARDED, str(tmp_path / "sleep.log")], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        proc.send_signal(sig)
        time.sleep(0.2)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid_running(child):
            os.killpg(child, signal.SIGKILL)
    assert proc.returncode == 128 + sig, out
    assert f"stopped by {sig.name}" in out
    assert not pid_running(child)


SWALLOWED = """
import os, signal, sys, time
from toolchain.stopsignals import Stopped, stop_on_signals


class Finalized:
    def __del__(self):  # the signal lands here, and Python drops an exception raised in __del__
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)


try:
    with stop_on_signals():
        Finalized()
        for _ in range(100):
            time.sleep(0.1)
        print("went on", flush=True)
except Stopped as err:
    sys.exit(err.exit_code)
"""


def test_a_stop_dropped_in_a_finalizer_is_raised_again():
    run = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 128 + signal.SIGTERM, run.stdout + run.stderr
    assert "Exception ignored" not in run.stderr


# ---- every command that starts servers -------------------------------------------------------------------------

@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_deploy_stopped_by_sigterm_while_it_benches(tmp_path):
    argv = _cli(tmp_path, "deploy", str(REPO / "build" / "tiny-llama.yaml"), *FREE_PORTS,
                "--set", "validation.workload.num_requests=5000")
    # 5000 requests keep the bench busy for minutes: the settle leaves it time to load its clients and send
    # requests on a loaded host (a stop inside its setup has measured nothing, so there is no report to keep).
    run = _stopped_mid_run(argv, tmp_path, r"\bbench\s+start", signal.SIGTERM, shm=True, settle_s=6)
    assert run.rc == 128 + signal.SIGTERM, run.text  # type: ignore[attr-defined]
    assert "stopped by SIGTERM" in run.text
    report = json.loads((tmp_path / "root" / "reports" / "tiny-llama" / "report.json").read_text())
    assert report["complete"] is False  # what the bench measured before the stop is saved


@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_deploy_llmapi_stopped_by_sighup_while_it_benches_the_openai_server(tmp_path):
    argv = _cli(tmp_path, "deploy", str(REPO / "build" / "tiny-llama-llmapi.yaml"), *FREE_PORTS,
                "--set", "llmapi.openai_port=0", "--set", "validation.workload.duration_s=4")
    run = _stopped_mid_run(argv, tmp_path, r"\bbench-openai\s+start", signal.SIGHUP, shm=False)
    assert run.rc == 128 + signal.SIGHUP, run.text  # type: ignore[attr-defined]
    reports = tmp_path / "root" / "reports" / "tiny-llama-llmapi"
    assert json.loads((reports / "report.json").read_text())["complete"] is True  # Triton's bench had finished
    assert json.loads((reports / "openai" / "report.json").read_text())["complete"] is False


@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_serve_stopped_by_sighup(tmp_path):
    spec = str(REPO / "build" / "tiny-llama.yaml")
    from toolchain.cli import main as cli_main

    for stage in ("convert", "build-engine", "model-repo"):  # in this process: only serve is under test
        assert cli_main(["--root", str(tmp_path / "root"), stage, spec, *FREE_PORTS]) == 0
    run = _stopped_mid_run(_cli(tmp_path, "serve", spec, *FREE_PORTS), tmp_path, r"^Ctrl-C to stop", signal.SIGHUP,
                           shm=True)
    assert run.rc == 0 and "tritonserver stopped" in run.text, run.text  # type: ignore[attr-defined]


@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_serve_llmapi_cpu_serves_the_openai_server_too_and_sigterm_stops_both(tmp_path):
    """Issue 33: `toolchain serve` of an llmapi-cpu spec serves what deploy serves, Triton's llmapi model and the
    OpenAI server; the printed OpenAI endpoint answers a completion, and one SIGTERM stops both."""
    import urllib.request

    spec = str(REPO / "build" / "tiny-llama-llmapi.yaml")
    from toolchain.cli import main as cli_main

    assert cli_main(["--root", str(tmp_path / "root"), "model-repo", spec]) == 0  # in this process: serve is under test
    answers = []

    def answered(run: Run) -> bool:  # once ready, the OpenAI URL serve printed completes a prompt
        if "Ctrl-C to stop" not in run.text:
            return False
        found = re.search(r"^  HTTP +(http://\S+)/v1/completions", run.text, re.M)
        assert found, f"serve printed no OpenAI endpoint:\n{run.text}"
        body = json.dumps({"model": "tiny-llama-llmapi", "prompt": "def fibonacci(n):", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{found.group(1)}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answers.append(json.loads(response.read()))
        return True

    argv = _cli(tmp_path, "serve", spec, *FREE_PORTS, "--set", "llmapi.openai_port=0")
    run = _stopped_mid_run(argv, tmp_path, answered, signal.SIGTERM, shm=True, settle_s=0.5)
    assert answers[0]["usage"]["completion_tokens"] == 4 and answers[0]["model"] == "tiny-llama-llmapi"
    assert "OpenAI server stopped\n" in run.text and "tritonserver stopped" in run.text, run.text  # stopped, no news


@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_openai_server_stopped_by_sigterm_removes_its_work_directory(tmp_path):
    config = tmp_path / "llm.yaml"
    config.write_text("tensor_parallel_size: 1\n")
    argv = [sys.executable, "-m", "toolchain.openai", str(TINY_TRAINED), "--config", str(config),
            "--served-model-name", "tiny", "--port", "0"]
    run = _stopped_mid_run(argv, tmp_path, r"Uvicorn running on", signal.SIGTERM, shm=False, children=False,
                           work_dir="openai-cpu-llm-*")
    assert run.rc == 128 + signal.SIGTERM, run.text  # type: ignore[attr-defined]


@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_dynamo_stopped_by_sighup(tmp_path):
    pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")
    argv = _cli(tmp_path, "dynamo", str(REPO / "build" / "tiny-llama-dynamo.yaml"), "--set", "dynamo.http_port=0",
                "--workers", "1", "--timeout", "240")
    run = _stopped_mid_run(argv, tmp_path, r"^Ctrl-C to stop", signal.SIGHUP, shm=False, work_dir="dynamo-*")
    assert run.rc == 0 and "Dynamo stopped" in run.text, run.text  # type: ignore[attr-defined]


@needs_tiny
@pytest.mark.slow
@pytest.mark.server
def test_perf_run_that_started_its_own_server_stopped_by_sigterm(tmp_path):
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "perf",
            str(REPO / "tests" / "perf"), "--spec", str(REPO / "build" / "tiny-llama.yaml"),
            "--set", "validation.workload.num_requests=5000", "--basetemp", str(tmp_path / "basetemp")]

    def serving(run: Run) -> bool:  # the fixture's tritonserver is up (pytest -q prints no line before then)
        return len(_listening(_marked(run.marker))) >= 3

    run = _stopped_mid_run(argv, tmp_path, serving, signal.SIGTERM, shm=True, settle_s=5)
    assert run.rc != 0, run.text  # type: ignore[attr-defined]
