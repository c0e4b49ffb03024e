"""Start, watch and stop a real tritonserver.

The launcher always binds explicit addresses (tritonserver defaults to
0.0.0.0), picks free ports for port 0, runs the server in its own process
group with output to a log file, and waits for `/v2/health/ready`. When the
server dies during start-up the log is read back and the cause reported in
one line: the port already in use, or the model that failed to load and its
first error line.
"""

from __future__ import annotations

import contextlib
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
from toolchain import procgroup
from toolchain.triton import exposure
from toolchain.triton.endpoints import UrlAccessors, endpoints
from toolchain.triton.runtime import ServerBinary, backend_dir, resolve_binary, server_env

STUB_GRACE_S = 3.0  # a stub gone during start-up: how long the server may take to report it itself
_PORT_FIELDS = {"http": "serving.http_port", "grpc": "serving.grpc_port", "metrics": "serving.metrics_port"}


def _port_error(kind: str, host: str, port: int) -> ToolchainError:
    return ToolchainError(f"{kind} port {port} on {host} is already in use",
                          f"stop whatever listens there or pass --set {_PORT_FIELDS[kind]}=<free port> (0 picks one)")


class TritonServer(procgroup.GroupServer, UrlAccessors):
    """One tritonserver process serving `repo_dir`, a procgroup.Server. Use as a context manager or
    call `start()` / `stop()`."""

    def __init__(self, repo_dir: Path | str, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, binary: Path | str | None = None, *, log_path: Path | str | None = None,
                 exit_timeout_s: int = 10, extra_args: tuple[str, ...] = (), metrics_host: str | None = None,
                 admin_key: str | None = None, env: dict[str, str] | None = None):
        """`admin_key` puts the administrative APIs behind that key (exposure.RESTRICTED_APIS);
        `metrics_host` defaults to `host`; `env` is added to the server's environment (its
        Python-backend stubs inherit it)."""
        self.repo_dir = Path(repo_dir).resolve()
        self.host = host
        self.hosts = {"http": host, "grpc": host, "metrics": metrics_host or host}
        self.admin_key = admin_key
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.binary: ServerBinary = resolve_binary(binary)
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        # Python-backend stubs of concurrent servers must not share /dev/shm regions.
        self.shm_prefix = f"tc{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None  # seconds from spawn to ready
        self._log_fh = None
        self._stubs: dict[str, int] = {}

    @classmethod
    def from_spec(cls, spec, repo_dir: Path | str, *, read_key: bool = True, **kwargs) -> "TritonServer":
        """The server `spec.serving` describes; off loopback its administrative APIs take the key from
        serving.admin_key_file or $serving.admin_key_env, read here so a missing key fails before start.
        `read_key=False` (only printing the command) leaves the placeholder in its place."""
        s = spec.serving
        key = None
        if exposure.restricted(s):
            key = exposure.read_admin_key(s) if read_key else exposure.PLACEHOLDER
        triton = endpoints(spec).triton
        return cls(repo_dir, triton.http.bind, triton.http.port, triton.grpc.port, triton.metrics.port, s.tritonserver,
                   metrics_host=triton.metrics.bind, admin_key=key, **kwargs)

    # ---- addresses -------------------------------------------------------------------------------------------
    def _url_host(self, kind: str = "http") -> str:
        host = self.hosts[kind]
        return f"[{host}]" if ":" in host else host

    @property
    def urls(self) -> dict[str, str]:
        return {"http": f"http://{self._url_host('http')}:{self.ports['http']}",
                "grpc": f"{self._url_host('grpc')}:{self.ports['grpc']}",
                "metrics": f"http://{self._url_host('metrics')}:{self.ports['metrics']}/metrics"}

    @property
    def logs(self) -> dict[str, Path]:
        return {"tritonserver": self.log_path} if self.log_path else {}

    @property
    def ready(self) -> bool:
        """Started, still running, answering /v2/health/ready and no Python-backend stub dead.

        tritonserver 2.51 keeps answering ready (server and model) after a model's
        triton_python_backend_stub dies, and never ends the requests that were in flight on it."""
        return self.running and is_ready(f"{self.http_url}/v2/health/ready") and not self.dead_stubs()

    def stub_pids(self) -> dict[str, int]:
        """Model instance name (e.g. tensorrt_llm_0_0) -> pid of its live triton_python_backend_stub."""
        return python_stubs(self.process.pid) if self.process is not None and self.running else {}

    def dead_stubs(self) -> list[str]:
        """Instances whose stub, alive when the server became ready, is gone (killed, crashed)."""
        if not self._stubs:
            return []
        alive = self.stub_pids()
        return sorted(name for name, pid in self._stubs.items() if alive.get(name) != pid)

    # ---- command ----------------------------------------------------------------------------------------------
    def command(self, reveal_key: bool = False) -> list[str]:
        """The command line (ports still 0 stay 0 until `start()` picks them). The admin key is in
        it only with `reveal_key` (for the process itself); otherwise exposure.PLACEHOLDER stands for it."""
        cmd = [str(self.binary.path), f"--model-repository={self.repo_dir}"]
        if self.binary.needs_backend_dir:
            cmd.append(f"--backend-directory={backend_dir(self.binary)}")
        for kind in ("http", "grpc", "metrics"):
            cmd += [f"--{kind}-address={self.hosts[kind]}", f"--{kind}-port={self.ports[kind]}"]
        if self.admin_key is not None:
            cmd += exposure.restriction_args(self.admin_key if reveal_key else exposure.PLACEHOLDER)
        cmd += [
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--disable-auto-complete-config",  # the rendered configs are the whole truth
            "--allow-gpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        return cmd + list(self.extra_args)

    def command_line(self, key_reference: str | None = None) -> str:
        """The command line for printing: the key (if any) as `key_reference`, a shell word
        such as '"$TRITON_ADMIN_KEY"', never the secret itself."""
        line = shlex.join(self.command())
        return line.replace(exposure.PLACEHOLDER, key_reference or "<admin-key>")

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def _preflight(self) -> None:
        if not self.repo_dir.is_dir():
            raise ToolchainError(f"model repository not found: {self.repo_dir}",
                                 "run `toolchain model-repo SPEC` first")
        for kind, port in self.ports.items():
            if port and port_in_use(self.hosts[kind], port):
                raise _port_error(kind, self.hosts[kind], port)
        for kind, port in self.ports.items():
            if not port:
                taken = {p for p in self.ports.values() if p}
                while port in taken or not port:
                    port = free_port(self.hosts[kind])
                self.ports[kind] = port

    def start(self, timeout: float = 180.0) -> "TritonServer":
        if self.process is not None:
            raise RuntimeError("server already started")
        if self.admin_key == exposure.PLACEHOLDER:
            raise RuntimeError("built with read_key=False: for printing only")
        self._preflight()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        t0 = time.monotonic()
        self.process, self._log_fh = procgroup.spawn(self.command(reveal_key=True),
                                                     {**server_env(self.binary), **self.env}, self.log_path)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        # The stubs first: once started_s is set, dead_stubs() knows every instance that was up.
        self._stubs = self.stub_pids()
        self.started_s = time.monotonic() - t0
        return self

    def _wait_ready(self, timeout: float) -> None:
        url = f"{self.urls['http']}/v2/health/ready"

        def exited(rc: int) -> Exception:
            in_use = _SOCKET_IN_USE.search(self.log_text())
            if in_use:  # lost a race for a port after the preflight check
                kind = in_use.group("kind").lower()
                return _port_error(kind, self.hosts[kind], int(in_use.group("port")))
            return StageFailed(f"tritonserver exited during start-up (exit code {rc}): {self.failure_cause()}",
                               f"full log: {self.log_path}")

        def timed_out() -> Exception:
            cause = self.failure_cause(default="")
            return StageFailed(f"tritonserver not ready after {timeout:.0f} s" + (f": {cause}" if cause else ""),
                               f"raise serving.startup_timeout_s or read {self.log_path}")

        process = self.process
        if process is None:
            raise RuntimeError("start() spawns the process first")
        seen: dict[str, int] = {}
        gone_since: list[float] = []

        def ready() -> bool:
            # A stub killed while its model loads leaves tritonserver waiting out the whole timeout; a
            # model whose initialize() failed ends its stub too, but then the server exits within a
            # moment and its own message is the better one, so a vanished stub gets a short grace.
            alive = python_stubs(process.pid)
            for name, pid in alive.items():
                seen.setdefault(name, pid)
            gone = sorted(name for name, pid in seen.items() if alive.get(name) != pid)
            if gone and not gone_since:
                gone_since.append(time.monotonic())
            if gone and time.monotonic() - gone_since[0] > STUB_GRACE_S and process.poll() is None:
                # A model that failed to load takes the others' stubs down while the server still
                # unloads them: its log line is then the cause.
                cause = self.failure_cause(default="")
                raise StageFailed(f"model instance {', '.join(gone)} died during start-up (its Python-backend stub "
                                  "is gone)" + (f": {cause}" if cause else
                                                "; tritonserver would wait for it until the timeout"),
                                  f"full log: {self.log_path}")
            return is_ready(url)

        procgroup.wait_ready(process, ready, timeout, exited, timed_out, poll_s=0.1)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def failure_cause(self, default: str = "see the log") -> str:
        return diagnose_log(self.log_text(), self.host, self.ports) or default

    def stop_wait_s(self) -> float:
        return self.exit_timeout_s + 5  # tritonserver's own exit timeout, then a margin

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the process group, then remove the /dev/shm regions left under this server's own prefix:
        tritonserver unlinks a stub's region when its model unloads, which a model whose stub died never
        does, and a server killed or aborted unloads nothing."""
        rc = super().stop(timeout)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(OSError):
                region.unlink()
        return rc


def python_stubs(server_pid: int) -> dict[str, int]:
    """Instance name -> pid of each triton_python_backend_stub child of `server_pid` (Linux /proc;
    empty elsewhere). The stub's argv names the instance (e.g. `tensorrt_llm_0_0`) after the
    shared-memory sizes, parent pid and library path."""
    out: dict[str, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) != server_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if argv and argv[0].endswith(b"triton_python_backend_stub") and len(argv) > 8:
            out[argv[8].decode(errors="replace")] = int(entry)
    return out


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
_HARMLESS = ("CudaDriverHelper has not been initialized", "Failed to initialize NVML", "DCGM",
             "CUDA driver version is insufficient")


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
