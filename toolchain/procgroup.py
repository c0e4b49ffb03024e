"""A server process in its own process group: start with output to a log,
wait for its readiness URL, stop it (SIGTERM, bounded wait, SIGKILL the group).

Shared by the single tritonserver launcher (CPU and one-GPU hosts) and the
mpirun launch of one tritonserver per rank; the group is what lets a stop
reach the Python-backend stubs and every MPI rank. `Server` is the surface every
server the toolchain starts offers, so pipeline.serve_until_stopped watches any of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Callable, Protocol, runtime_checkable


@runtime_checkable
class Server(Protocol):
    """One server protocol: tritonserver (triton/server.py TritonServer), the ranks under mpirun
    (triton/launch.py TritonLaunch), the OpenAI server (openai/server.py OpenAIServer) and a Dynamo
    deployment (dynamo/launcher.py DynamoDeployment). Built not started; `start` returns once ready
    (or raises, having stopped what it spawned); `stop` is bounded, safe before start and twice, and
    returns the exit code where there is one process to have it."""

    started_s: float | None  # seconds from spawn to ready, once started

    def start(self, timeout: float) -> "Server": ...

    def stop(self, timeout: float | None = None) -> int | None: ...

    @property
    def running(self) -> bool: ...

    @property
    def ready(self) -> bool:
        """Started, running and answering its readiness check."""

    @property
    def urls(self) -> dict[str, str]:
        """Where it answers, by kind (http, grpc, metrics), as the server computes them."""

    @property
    def logs(self) -> dict[str, Path]:
        """Its log files by process name (empty until start picks a temporary one)."""


def pid_running(pid: int) -> bool:
    """`pid` exists and is neither a zombie nor dead: from /proc where there is one (Linux), else by
    signal 0 (where a process of another user counts as running)."""
    if Path("/proc/self/stat").exists():
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
            return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")
        except (OSError, ValueError):
            return False
    try:  # pragma: no cover - hosts without /proc
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen, IO[bytes]]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    return proc, log


def wait_ready(proc: subprocess.Popen, is_ready: Callable[[], bool], timeout: float,
               exited: Callable[[int], Exception], timed_out: Callable[[], Exception], poll_s: float) -> None:
    """Return once `is_ready()`; raise `exited(rc)` if the process dies first,
    `timed_out()` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        rc = proc.poll()
        if rc is not None:
            raise exited(rc)
        if is_ready():
            return
        if time.monotonic() > deadline:
            raise timed_out()
        time.sleep(poll_s)


def stop_group(proc: subprocess.Popen, wait_s: float) -> int:
    """SIGTERM the group, wait up to `wait_s`, then SIGKILL whatever is left of
    it (stubs of a server that did not exit cleanly). Returns the exit code."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        rc = None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait() if rc is None else rc


class GroupServer:
    """Stop, liveness and `with` support of a server that runs as one process group: the
    subclass sets `process` (the Popen), `_log_fh` (its open log) and `stop_wait_s()`, and
    defines `start()`."""

    process: subprocess.Popen | None = None
    _log_fh: IO[bytes] | None = None

    def stop_wait_s(self) -> float:
        raise NotImplementedError

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM the process group, wait (bounded), then SIGKILL it. Returns the exit code."""
        proc, self.process = self.process, None
        rc = stop_group(proc, self.stop_wait_s() if timeout is None else timeout) if proc is not None else None
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return rc

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self):
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
