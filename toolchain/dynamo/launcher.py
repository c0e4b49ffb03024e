"""A Dynamo deployment on this host (target llmapi-cpu): `python -m dynamo.frontend` and N CPU-engine workers.

No etcd and no NATS: file discovery in a private directory, the TCP request plane, the ZMQ event plane, every
address on loopback (the DYN_* variables the runtime reads, each looked up in the facts). Each process runs in its
own process group with its own log; the frontend and the workers find each other through the discovery directory.
Dynamo caches model cards under $HOME/.cache/dynamo and writes temporary files, so HOME and TMPDIR point into the
same private directory: `stop` removes it and leaves nothing behind.

Ready once the frontend lists the model and its /health shows every worker's instance registered. The checkpoint
is converted and sharded once, before the workers start (the same stages CpuLLM runs), so the workers reuse it.
On this host the workers share one machine's memory: each gets 1/N of kv_cache_config.free_gpu_memory_fraction.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import yaml

from toolchain import upstream
from toolchain.dynamo import flags
from toolchain.dynamo.worker import COMPONENT, ENDPOINT
from toolchain.errors import StageFailed, ToolchainError
from toolchain.netutil import free_port, port_in_use
from toolchain.spec import DeploymentSpec
from toolchain.targets import CPU, GPU, LLMAPI, named, require_target
from toolchain.triton.endpoints import LOOPBACK, endpoints
from toolchain import procgroup
from toolchain.workspace import Workspace
from toolchain.dynamo.checks import check
from toolchain.llmapi.launch import served_model_name
from toolchain.llmapi.args import serve_config
from toolchain.llmapi.stage import served_model_dir
from toolchain.dynamo.install import require
from toolchain.llmapi.cpu_llm import LlmArgsError, load_engine

HOST = LOOPBACK
STOP_WAIT_S = 10.0
# The shell variable naming the private directory in `shell_lines` (what start's temporary directory is).
DIR_VAR = "DYNAMO_DIR"


def runtime_env(name: str) -> str:
    """`name` if Dynamo's runtime reads it (found in its binary; facts runtime_env); LookupError otherwise."""
    if not upstream.facts("dynamo")["runtime_env"].get(name, {}).get("found"):
        raise LookupError(f"Dynamo's runtime does not read {name} (facts/dynamo.json runtime_env)")
    return name


def _flag_env(name: str) -> str:
    """The variable the frontend reads for flag `name` (facts frontend.flags[name].env_var)."""
    return upstream.facts("dynamo")["frontend"]["flags"][name]["env_var"]


@dataclass
class _Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen | None = None
    fh: IO[bytes] | None = None
    system_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class DynamoDeployment:
    """The frontend (router) and `workers` CPU-engine workers, a procgroup.Server. Use as a context manager or
    `start()` / `stop()`."""

    def __init__(self, spec: DeploymentSpec, workspace: Workspace, *, workers: int | None = None,
                 router: str | None = None, http_port: int | None = None, kv_events: bool = True,
                 engine_threads: int | None = None, log_dir: Path | str | None = None, python: str | None = None):

        require_target(spec, f"a Dynamo deployment runs on this host for target {named(LLMAPI, CPU)}, not {spec.target}",
                f"target {named(LLMAPI, GPU)} renders the GPU deployment: `toolchain dynamo SPEC --print`",
                path=LLMAPI, device=CPU)
        check(spec)
        self.spec, self.workspace = spec, workspace
        self.workers = workers or spec.dynamo.workers
        self.router = router or spec.dynamo.router
        if self.router not in flags.choices("frontend", "--router-mode"):
            raise ToolchainError(f"--router {self.router!r} is not one of the frontend's --router-mode choices")
        self.http_port = endpoints(spec).dynamo.port if http_port is None else http_port
        self.kv_events = kv_events
        self.engine_threads = spec.serving.engine_threads if engine_threads is None else engine_threads
        self.model_name = served_model_name(spec)
        self.python = python or sys.executable
        self.log_dir = Path(log_dir) if log_dir else None
        self.tmp: Path | None = None
        self.frontend: _Proc | None = None
        self.worker_procs: list[_Proc] = []
        self.started_s: float | None = None

    # -- what runs -------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return replace(endpoints(self.spec).dynamo, port=self.http_port).url

    @property
    def urls(self) -> dict[str, str]:
        return {"http": self.url}

    def engine_args(self) -> dict[str, Any]:
        """The LLM-API YAML each worker takes: the spec's trtllm-serve config, with the KV share split N ways
        (the workers share one host's memory; on GPUs each has its own)."""

        args = serve_config(self.spec)
        kv = dict(args.get("kv_cache_config") or {})
        kv["free_gpu_memory_fraction"] = round(kv.get("free_gpu_memory_fraction", 0.9) / self.workers, 6)
        return {**args, "kv_cache_config": kv}

    def frontend_argv(self, http_port: int | None = None) -> list[str]:
        f = flags.frontend
        port = self.http_port if http_port is None else http_port
        argv = [self.python, "-m", "dynamo.frontend", f("--http-host"), HOST, f("--http-port"), str(port),
                f("--router-mode"), self.router, f("--namespace"), self.spec.dynamo.namespace,
                f("--discovery-backend"), "file", f("--request-plane"), "tcp", f("--event-plane"), "zmq",
                f("--migration-limit"), str(self.spec.dynamo.migration_limit)]
        if self.router == "kv" and not self.kv_events:
            argv.append(f("--no-router-kv-events"))  # the router then predicts the caches from its own routing
        return argv

    def worker_argv(self, work_dir: Path, config: Path) -> list[str]:
        return [self.python, "-m", "toolchain.dynamo.worker", str(served_model_dir(self.spec, self.workspace)),
                "--config", str(config), "--served-model-name", self.model_name,
                "--namespace", self.spec.dynamo.namespace, "--engine-threads", str(self.engine_threads),
                "--work-dir", str(work_dir), "--kv-events" if self.kv_events else "--no-kv-events"]

    def own_env(self, tmp: Path) -> dict[str, str]:
        """The variables the launcher sets for every process, over the inherited environment."""
        root = str(Path(__file__).resolve().parents[2])  # the children import this very toolchain
        return {
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
            _flag_env("--discovery-backend"): "file", runtime_env("DYN_FILE_KV"): str(tmp / "discovery"),
            _flag_env("--request-plane"): "tcp", _flag_env("--event-plane"): "zmq",
            runtime_env("DYN_TCP_RPC_HOST"): HOST, runtime_env("DYN_TCP_RESPONSE_STREAM_HOST"): HOST,
            runtime_env("DYN_EVENT_PLANE_HOST"): HOST, runtime_env("DYN_SYSTEM_HOST"): HOST,
            "HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1",
            # dynamo.runtime.logging writes a logging config to a NamedTemporaryFile(delete=False) in every
            # process (ai-dynamo 1.6.1, dynamo/runtime/logging.py): kept in the private directory, it goes too.
            "TMPDIR": str(tmp / "tmp"),
        }

    def base_env(self, tmp: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "NATS_", "ETCD_"))}
        return {**env, **self.own_env(tmp)}

    @staticmethod
    def worker_env(port: int) -> dict[str, str]:
        """A worker's own system server (health, /engine/stats) on `port`."""
        return {runtime_env("DYN_SYSTEM_PORT"): str(port), runtime_env("DYN_SYSTEM_ENABLED"): "true"}

    def shell_lines(self) -> list[str]:
        """What `start` runs, as lines to paste into bash on this host: a private directory (shell variable
        DIR_VAR) in place of start's temporary one, the engine-args YAML written there (as JSON, which YAML
        reads), concrete ports (the frontend's from the spec, or one free now; each worker's system port free
        now), and each worker converting into its own work directory (start converts once, before the workers)."""
        tmp = Path("$" + DIR_VAR)
        config = tmp / "engine-args.yaml"
        http_port = self.http_port or free_port(HOST)
        frontend = self.frontend_argv(http_port)
        env = _shell_assignments(self.own_env(tmp))
        lines = [f'{DIR_VAR}="$(mktemp -d)" && mkdir "${DIR_VAR}/home" "${DIR_VAR}/tmp"',
                 f"printf '%s\\n' {shlex.quote(json.dumps(self.engine_args()))} > {_shell_word(str(config))}",
                 f"{env} {_shell_join(frontend)} &"]
        ports: list[int] = []
        for i in range(self.workers):
            ports.append(system_port(exclude=ports + [http_port]))
            argv = self.worker_argv(tmp / f"engine-{i}", config)
            lines.append(f"{env} {_shell_assignments(self.worker_env(ports[-1]))} {_shell_join(argv)} &")
        return lines

    # -- start / stop ----------------------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> "DynamoDeployment":
        if self.tmp is not None:
            raise RuntimeError("deployment already started")
        require()
        timeout = timeout or self.spec.dynamo.startup_timeout_s
        if self.http_port and port_in_use(HOST, self.http_port):
            raise ToolchainError(f"port {self.http_port} on {HOST} is already in use",
                                 "stop whatever listens there or set dynamo.http_port (0 picks a free one)")
        t0 = time.monotonic()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"dynamo-{self.spec.name}-"))
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _start(self, timeout: float) -> None:
        assert self.tmp is not None
        tmp = self.tmp
        (tmp / "home").mkdir()
        (tmp / "tmp").mkdir()
        logs = self.log_dir or tmp / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        config = tmp / "engine-args.yaml"
        config.write_text(yaml.safe_dump(self.engine_args(), sort_keys=False))
        work_dir = tmp / "engine"
        self._prepare_engine(config, work_dir)
        self.http_port = self.http_port or free_port(HOST)
        env = self.base_env(tmp)
        self.frontend = _Proc("frontend", self.frontend_argv(), env, logs / "frontend.log")
        for i in range(self.workers):
            port = system_port()
            wenv = dict(env, **self.worker_env(port))
            self.worker_procs.append(_Proc(f"worker{i}", self.worker_argv(work_dir, config), wenv,
                                           logs / f"worker{i}.log", system_port=port))
        for proc in [self.frontend, *self.worker_procs]:
            proc.popen, proc.fh = procgroup.spawn(proc.argv, proc.env, proc.log)
        self._wait_ready(timeout)

    def _prepare_engine(self, config: Path, work_dir: Path) -> None:
        """Convert and shard the checkpoint once (the workers then load it from `work_dir`), refusing in one line
        what the CPU engine cannot run before any process starts."""

        try:
            load_engine({**self.engine_args(), "model": str(served_model_dir(self.spec, self.workspace))}, work_dir, 1)
        except LlmArgsError as err:
            raise ToolchainError(str(err)) from None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for proc in [self.frontend, *self.worker_procs]:
                assert proc is not None and proc.popen is not None
                rc = proc.popen.poll()
                if rc is not None:
                    raise StageFailed(f"Dynamo {proc.name} exited during start-up (exit code {rc}): "
                                      f"{failure_cause(proc.log)}", f"full log: {proc.log}")
            if self.ready:
                return
            if time.monotonic() > deadline:
                raise StageFailed(f"the Dynamo deployment was not ready after {timeout:.0f} s "
                                  f"({len(self.instances())} of {self.workers} workers registered)",
                                  f"read the logs in {self.frontend.log.parent if self.frontend else '?'}")
            time.sleep(0.2)

    def instances(self) -> list[dict]:
        """The worker instances the frontend's /health lists for this deployment's endpoint."""
        health = _get_json(f"{self.url}/health")
        ns = self.spec.dynamo.namespace
        return [i for i in (health or {}).get("instances", [])
                if (i.get("namespace"), i.get("component"), i.get("endpoint")) == (ns, COMPONENT, ENDPOINT)]

    @property
    def ready(self) -> bool:
        models = _get_json(f"{self.url}/v1/models") or {}
        listed = any(m.get("id") == self.model_name for m in models.get("data", []))
        return listed and len(self.instances()) >= sum(1 for p in self.worker_procs if p.popen and
                                                          p.popen.poll() is None)

    def stop(self, timeout: float | None = None) -> None:
        """Workers, then the frontend: SIGTERM each group, wait (`timeout`, default STOP_WAIT_S each), SIGKILL
        what is left; then the private directory (discovery, model-card cache, converted engine) goes."""
        for proc in [*self.worker_procs, self.frontend]:
            if proc is not None and proc.popen is not None:
                procgroup.stop_group(proc.popen, STOP_WAIT_S if timeout is None else timeout)
                proc.popen = None
            if proc is not None and proc.fh is not None:
                proc.fh.close()
                proc.fh = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def kill_worker(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill worker `index`'s whole process group (a crash, for the failover tests and benchmarks)."""
        proc = self.worker_procs[index]
        if proc.popen is not None:
            try:
                os.killpg(proc.popen.pid, sig)
            except ProcessLookupError:
                pass
            proc.popen.wait()

    @property
    def running(self) -> bool:
        return self.frontend is not None and self.frontend.popen is not None and self.frontend.popen.poll() is None

    def dead_workers(self) -> list[str]:
        return [p.name for p in self.worker_procs if p.popen is not None and p.popen.poll() is not None]

    def worker_stats(self, index: int) -> dict:
        """What worker `index` served (its GET /engine/stats on the system port)."""
        port = self.worker_procs[index].system_port
        return _get_json(f"http://{HOST}:{port}/engine/stats") or {}

    def pids(self) -> list[int]:
        return [p.popen.pid for p in [self.frontend, *self.worker_procs] if p is not None and p.popen is not None]

    @property
    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in [self.frontend, *self.worker_procs] if p is not None}

    def __enter__(self) -> "DynamoDeployment":
        return self.start() if self.tmp is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def system_port(tries: int = 200, exclude: list[int] | tuple[int, ...] = ()) -> int:
    """A free port for a worker's system server: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as a signed 16-bit value
    ("expected i16"), so it must be below 32768, where the kernel's ephemeral range (free_port's) is not.
    `exclude`: ports already handed out but not bound yet."""
    import random

    for _ in range(tries):
        port = random.randint(20000, 32767)
        if port not in exclude and not port_in_use(HOST, port):
            return port
    raise StageFailed("no free port below 32768 for a Dynamo worker's system server")


def _get_json(url: str, method: str = "GET", body: bytes | None = None) -> Any:
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2.0) as resp:
            return json.loads(resp.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def failure_cause(log: Path) -> str:
    """The last line of a log that reads like the cause (the worker's `error:` line, a Python exception,
    Dynamo's ERROR), else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line or " ERROR " in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output; see the log"


def _shell_word(value: str) -> str:
    """`value` quoted for bash; a path below $DIR_VAR in double quotes, so that the variable expands."""
    head = "$" + DIR_VAR
    if value == head or value.startswith(head + "/"):
        rest = value[len(head):]
        if not rest or shlex.quote(rest) == rest:  # nothing in it that double quotes would still expand
            return f'"{value}"'
    return shlex.quote(value)


def _shell_join(argv: list[str]) -> str:
    return " ".join(_shell_word(arg) for arg in argv)


def _shell_assignments(env: dict[str, str]) -> str:
    return " ".join(f"{key}={_shell_word(value)}" for key, value in sorted(env.items()))
