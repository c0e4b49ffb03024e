"""Start, watch and stop a real tritonserver.

The launcher always binds explicit addresses (tritonserver defaults to
0.0.0.0), picks free ports for port 0, runs the server in its own process
group with output to a log file, and waits for `/v2/health/ready`. When the
server dies during start-up the log is read back and the cause reported in
one line: the port already in use, or the model that failed to load and its
first error line.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from toolchain.errors import StageFailed, ToolchainError
from toolchain.netutil import free_port, port_in_use  # noqa: F401  (free_port is re-exported)
from toolchain.triton import procgroup
from toolchain.triton.runtime import ServerBinary, backend_dir, resolve_binary, server_env

_PORT_FIELDS = {"http": "serving.http_port", "grpc": "serving.grpc_port", "metrics": "serving.metrics_port"}


def _port_error(kind: str, host: str, port: int) -> ToolchainError:
    return ToolchainError(f"{kind} port {port} on {host} is already in use",
                          f"stop whatever listens there or pass --set {_PORT_FIELDS[kind]}=<free port> (0 picks one)")


class TritonServer(procgroup.GroupServer):
    """One tritonserver process serving `repo_dir`. Use as a context manager or
    call `start()` / `stop()`."""

    def __init__(self, repo_dir: Path | str, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, binary: Path | str | None = None, *, log_path: Path | str | None = None,
                 exit_timeout_s: int = 10, extra_args: tuple[str, ...] = ()):
        self.repo_dir = Path(repo_dir).resolve()
        self.host = host
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.binary: ServerBinary = resolve_binary(binary)
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path else None
        # Python-backend stubs of concurrent servers must not share /dev/shm regions.
        self.shm_prefix = f"tc{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None  # seconds from spawn to ready
        self._log_fh = None

    @classmethod
    def from_spec(cls, spec, repo_dir: Path | str, **kwargs) -> "TritonServer":
        s = spec.serving
        return cls(repo_dir, s.host, s.http_port, s.grpc_port, s.metrics_port, s.tritonserver, **kwargs)

    # ---- addresses -------------------------------------------------------------------------------------------
    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def urls(self) -> dict[str, str]:
        h = self._url_host()
        return {"http": f"http://{h}:{self.ports['http']}", "grpc": f"{h}:{self.ports['grpc']}",
                "metrics": f"http://{h}:{self.ports['metrics']}/metrics"}

    @property
    def http_url(self) -> str:
        return self.urls["http"]

    @property
    def grpc_url(self) -> str:
        """host:port, as tritonclient.grpc.InferenceServerClient takes it."""
        return self.urls["grpc"]

    @property
    def metrics_url(self) -> str:
        return self.urls["metrics"]

    @property
    def ready(self) -> bool:
        """Started, still running and answering /v2/health/ready."""
        return self.running and is_ready(f"{self.http_url}/v2/health/ready")

    # ---- command ----------------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The command line (ports still 0 stay 0 until `start()` picks them)."""
        cmd = [str(self.binary.path), f"--model-repository={self.repo_dir}"]
        if self.binary.needs_backend_dir:
            cmd.append(f"--backend-directory={backend_dir(self.binary)}")
        for kind in ("http", "grpc", "metrics"):
            cmd += [f"--{kind}-address={self.host}", f"--{kind}-port={self.ports[kind]}"]
        cmd += [
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--disable-auto-complete-config",  # the rendered configs are the whole truth
            "--allow-gpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        return cmd + list(self.extra_args)

    def command_line(self) -> str:
        return shlex.join(self.command())

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def _preflight(self) -> None:
        if not self.repo_dir.is_dir():
            raise ToolchainError(f"model repository not found: {self.repo_dir}",
                                 "run `toolchain model-repo SPEC` first")
        for kind, port in self.ports.items():
            if port and port_in_use(self.host, port):
                raise _port_error(kind, self.host, port)
        for kind, port in self.ports.items():
            if not port:
                taken = {p for p in self.ports.values() if p}
                while port in taken or not port:
                    port = free_port(self.host)
                self.ports[kind] = port

    def start(self, timeout: float = 180.0) -> "TritonServer":
        if self.process is not None:
            raise RuntimeError("server already started")
        self._preflight()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        t0 = time.monotonic()
        self.process, self._log_fh = procgroup.spawn(self.command(), server_env(self.binary), self.log_path)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _wait_ready(self, timeout: float) -> None:
        url = f"{self.urls['http']}/v2/health/ready"

        def exited(rc: int) -> Exception:
            in_use = _SOCKET_IN_USE.search(self.log_text())
            if in_use:  # lost a race for a port after the preflight check
                return _port_error(in_use.group("kind").lower(), self.host, int(in_use.group("port")))
            return StageFailed(f"tritonserver exited during start-up (exit code {rc}): {self.failure_cause()}",
                               f"full log: {self.log_path}")

        def timed_out() -> Exception:
            cause = self.failure_cause(default="")
            return StageFailed(f"tritonserver not ready after {timeout:.0f} s" + (f": {cause}" if cause else ""),
                               f"raise serving.startup_timeout_s or read {self.log_path}")

        procgroup.wait_ready(self.process, lambda: is_ready(url), timeout, exited, timed_out, poll_s=0.1)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def failure_cause(self, default: str = "see the log") -> str:
        return diagnose_log(self.log_text(), self.host, self.ports) or default

    def stop_wait_s(self) -> float:
        return self.exit_timeout_s + 5  # tritonserver's own exit timeout, then a margin


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# How tritonserver 2.51 reports a model that did not load (messages keep their
# newlines escaped as a literal backslash-n, so the first line is cut there).
_LOAD_FAILED = [
    re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?P<msg>.+)"),
    re.compile(r"Poll failed for model directory '(?P<model>[^']+)': (?P<msg>.+)"),
]
_PROTO_ERROR = re.compile(r"Error parsing text-format inference\.ModelConfig: (?P<msg>.+)")
_SOCKET_IN_USE = re.compile(
    r"failed to start (?P<kind>HTTP|GRPC|Metrics) service: .*Socket '[^']*:(?P<port>\d+)' already in use", re.I)
# Logged as errors on every CPU-only start; never the cause of a failure.
_HARMLESS = ("CudaDriverHelper has not been initialized", "Failed to initialize NVML", "DCGM")


def _first_line(msg: str) -> str:
    return msg.split("\\n")[0].split("\n")[0].strip().rstrip('"').strip()


def diagnose_log(log: str, host: str = "", ports: dict[str, int] | None = None) -> str | None:
    """One line naming why tritonserver did not come up, or None."""
    m = _SOCKET_IN_USE.search(log)
    if m:
        return str(_port_error(m.group("kind").lower(), host or "its address", int(m.group("port"))))
    hits = [m for pattern in _LOAD_FAILED if (m := pattern.search(log))]
    if hits:
        first = min(hits, key=lambda m: m.start())
        msg = _first_line(first.group("msg"))
        proto = _PROTO_ERROR.search(log)
        if "text proto" in msg and proto:
            msg += f" ({_first_line(proto.group('msg'))})"
        return f"model '{first.group('model')}' failed to load: {msg}"
    for line in log.splitlines():
        if (line.startswith("E") or line.startswith("error")) and not any(h in line for h in _HARMLESS):
            return _first_line(line)
    return None
