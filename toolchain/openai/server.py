"""Start, watch and stop `python -m toolchain.openai` as a subprocess.

Like `TritonServer`: explicit host, a free port for port 0, its own process
group with output to a log file, ready once GET /health answers 200, and a
one-line cause when it dies during start-up (the last error line of its log).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolchain.errors import StageFailed, ToolchainError
from toolchain.netutil import free_port, port_in_use
from toolchain import procgroup
from toolchain.triton.server import is_ready


class OpenAIServer(procgroup.GroupServer):
    """One OpenAI-compatible CPU-engine server, a procgroup.Server. Use as a context manager or call
    `start()` / `stop()`; `extra_args` are more `python -m toolchain.openai` flags."""

    def __init__(self, engine_dir: Path | str | None, tokenizer_dir: Path | str | None, served_model_name: str,
                 host: str = "127.0.0.1", port: int = 0, *, log_path: Path | str | None = None,
                 extra_args: tuple[str, ...] = (), python: str | None = None, stop_timeout_s: float = 15.0,
                 model: Path | str | None = None, config: Path | str | None = None,
                 env: dict[str, str] | None = None, port_field: str | None = None):
        # Either a built engine (engine path) or MODEL + --config, as trtllm-serve takes them (LLM-API path).
        if model is not None:
            self.source = [str(Path(model).resolve())] + (["--config", str(Path(config).resolve())] if config else [])
        elif engine_dir is not None and tokenizer_dir is not None:
            self.source = ["--engine-dir", str(Path(engine_dir).resolve()), "--tokenizer", str(Path(tokenizer_dir).resolve())]
        else:
            raise ValueError("OpenAIServer needs engine_dir and tokenizer_dir, or model")
        self.served_model_name = served_model_name
        self.host, self.port = host, port
        self.port_field = port_field  # the spec field the port came from, named when it is taken
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = tuple(extra_args)
        self.python = python or sys.executable
        self.stop_timeout_s = stop_timeout_s
        self.env = dict(env or {})  # added to the server's environment
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None
        self._log_fh = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def urls(self) -> dict[str, str]:
        return {"http": self.url}

    @property
    def logs(self) -> dict[str, Path]:
        return {"openai": self.log_path} if self.log_path else {}

    @property
    def ready(self) -> bool:
        return self.running and is_ready(f"{self.url}/health")

    def command(self) -> list[str]:
        return [self.python, "-m", "toolchain.openai", *self.source, "--served-model-name", self.served_model_name,
                "--host", self.host, "--port", str(self.port), *self.extra_args]

    def start(self, timeout: float = 120.0) -> "OpenAIServer":
        if self.process is not None:
            raise RuntimeError("server already started")
        if self.port and port_in_use(self.host, self.port):
            raise ToolchainError(f"port {self.port} on {self.host} is already in use",
                                 f"stop whatever listens there or pass --set {self.port_field}=<free port> (0 picks one)"
                                 if self.port_field else "stop whatever listens there or pass port 0 to pick a free one")
        self.port = self.port or free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="openai-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = {**os.environ, **self.env}
        # The child must import this very toolchain, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        t0 = time.monotonic()
        self.process, self._log_fh = procgroup.spawn(self.command(), env, self.log_path)
        try:
            procgroup.wait_ready(self.process, lambda: is_ready(f"{self.url}/health"), timeout,
                                 lambda rc: StageFailed(f"the OpenAI server exited during start-up (exit code {rc}): "
                                                        f"{self.failure_cause()}", f"full log: {self.log_path}"),
                                 lambda: StageFailed(f"the OpenAI server was not ready after {timeout:.0f} s",
                                                     f"read {self.log_path}"), poll_s=0.1)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def failure_cause(self) -> str:
        lines = [ln.strip() for ln in self.log_text().splitlines() if ln.strip()]
        for line in reversed(lines):
            if line.startswith("error:") or "Error" in line:
                return line
        return lines[-1] if lines else "no output; see the log"

    def stop_wait_s(self) -> float:
        return self.stop_timeout_s  # uvicorn shuts down and stops the batcher on SIGTERM
