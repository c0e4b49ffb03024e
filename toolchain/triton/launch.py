"""Launch target trtllm: one tritonserver per rank under mpirun, as NVIDIA's
`launch_triton_server.py` does (TensorRT-LLM triton_backend/scripts/launch_triton_server.py).

Leader mode (the default): MPMD `mpirun -n 1 <rank 0> : -n 1 <rank 1> ...`,
world size = tp x pp. Every rank gets `--disable-auto-complete-config` (the
rendered configs are the whole truth) and its own Python-backend shared-memory
prefix (`prefix<i>_`, so stubs of different ranks do not collide in /dev/shm).
Rank 0 serves HTTP/gRPC/metrics; ranks > 0 load only the TensorRT-LLM model(s)
(`--model-control-mode=explicit --load-model=tensorrt_llm`) with every endpoint
off. Draft-target needs two TensorRT-LLM models in one server, which only the
orchestrator mode allows: one tritonserver with TRTLLM_ORCHESTRATOR=1 that
spawns the executor workers itself. Several hosts come from gpu.hostfile.

Target cpu with serving.launch mpirun runs the same leader-mode line here, with
what the nvidia-pytriton wheel's server needs on top (its backend directory and
environment, per-launch shared-memory prefixes) and the rendezvous address of
the CPU engine's rank group (TOOLCHAIN_RANKS_ADDR, engine/cpu/ranks.py).

Under Open MPI 5 every rank is its own process group, so signalling mpirun's
group would reach mpirun alone, which then SIGKILLs the ranks: `stop()` sends
SIGTERM to each rank, so every tritonserver shuts down gracefully (stubs ended,
shared memory unlinked) and mpirun exits 0.

Off loopback, rank 0's administrative APIs are restricted and its metrics bind
to loopback (toolchain/triton/exposure.py). The printed lines refer to the key
(`"$VAR"` or `"$(cat FILE)"` expanded by a shell inside the container, a
Kubernetes Secret through `$(VAR)`), never hold it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from typing import IO, Any
from dataclasses import dataclass, field
from pathlib import Path

from toolchain.host import cpu_mpirun, physical_cores
from toolchain.errors import StageFailed, ToolchainError
from toolchain.versions import TRITON_IMAGE, TRTLLM_VERSION
from toolchain import procgroup
from toolchain.targets import target_of
from toolchain.triton import cluster, exposure
from toolchain.triton.endpoints import WILDCARDS, UrlAccessors, client_host, endpoints
from toolchain.triton.server import diagnose_log, free_port, is_ready, port_in_use, python_stubs
from toolchain.triton.runtime import backend_dir, resolve_binary, server_env
from toolchain.speculative import DRAFT_ENGINE, mode_of

DEFAULT_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"


def trtllm_models(spec) -> tuple[str, ...]:
    """The models backed by TensorRT-LLM engines, which every rank loads."""
    return ("tensorrt_llm", "tensorrt_llm_draft") if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE else (
        "tensorrt_llm",)


@dataclass
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1
    mode: str = "leader"
    key_reference: str | None = None  # shell word standing for exposure.PLACEHOLDER in printed lines

    @property
    def restricted(self) -> bool:
        return any(exposure.PLACEHOLDER in a for a in self.argv)

    def shell(self) -> str:
        """The line to run on the serving host; the admin key (if any) as a shell reference."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        line = " ".join(prefix + [shlex.join(self.argv)])
        return line.replace(exposure.PLACEHOLDER, self.key_reference or "<admin-key>")


def _rank_args(i: int, spec, repo: Path, tritonserver: str, ports: dict[str, int], admin_key: str | None,
               shm_prefix: str = "prefix", extra: tuple[str, ...] = (), bind: str | None = None) -> list[str]:
    args = [tritonserver, f"--model-repository={repo}", "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}{i}_", *extra]
    if i == 0:
        hosts = endpoints(spec).triton.binds
        if bind is not None:
            hosts = dict.fromkeys(hosts, bind)
        for kind in hosts:
            args += [f"--{kind}-address={hosts[kind]}", f"--{kind}-port={ports[kind]}"]
        if exposure.restricted(spec.serving):
            args += exposure.restriction_args(admin_key or exposure.PLACEHOLDER)
        return args
    args += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in trtllm_models(spec)),
             "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
    return args


def launch_command(spec, repo_dir: Path, *, tritonserver: str = DEFAULT_TRITONSERVER, mpirun: str = "mpirun",
                   ports: dict[str, int] | None = None, admin_key: str | None = None, shm_prefix: str = "prefix",
                   extra_rank_args: tuple[str, ...] = (), bind: str | None = None) -> LaunchCommand:
    """The mpirun command line serving `repo_dir` for a target-trtllm spec (or target cpu with launch
    mpirun, whose runner adds `extra_rank_args` and a per-launch `shm_prefix`). Where the administrative
    APIs are restricted, the argv holds `admin_key`, or exposure.PLACEHOLDER without one (printing).
    `bind`: the address every endpoint binds instead of the spec's (a container's, which publishes the ports
    on the spec's addresses); whether the administrative APIs need the key still follows the spec."""
    s = spec.serving
    ports = ports or endpoints(spec).triton.ports
    repo = Path(repo_dir)
    head = [mpirun, "--allow-run-as-root"]
    if not target_of(spec).binds_ranks:
        # Open MPI binds each rank to one core; a CPU rank's server, stubs and gloo threads then share
        # it, and a point-to-point exchange between two ranks measured 1.2 ms bound against 0.14 ms not.
        head += ["--bind-to", "none"] + (["--oversubscribe"] if s.oversubscribe else [])
    if spec.gpu.hostfile is not None:
        head += ["--hostfile", str(spec.gpu.hostfile)]
    world = spec.parallelism.world_size
    if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE:
        # Orchestrator with spawned workers: one server process, every GPU's CUDA pool off
        # (launch_triton_server.py --multi-model).
        gpus = [f"--cuda-memory-pool-byte-size={g}:0" for g in range(world)]
        rank0 = _rank_args(0, spec, repo, tritonserver, ports, admin_key, bind=bind)
        argv = head + ["-n", "1", *rank0, "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false", *gpus]
        return LaunchCommand(argv, {"TRTLLM_ORCHESTRATOR": "1"}, 1, "orchestrator", exposure.shell_reference(s))
    argv = list(head)
    for i in range(world):
        argv += ([":"] if i else []) + ["-n", "1", *_rank_args(i, spec, repo, tritonserver, ports, admin_key,
                                                               shm_prefix, extra_rank_args, bind)]
    return LaunchCommand(argv, {}, world, "leader", exposure.shell_reference(s))


# Where the key file is mounted, read-only, inside the container.
CONTAINER_KEY_FILE = "/run/secrets/triton-admin-key"


def publish_arg(host: str, port: int) -> str:
    """docker's `-p` value publishing container port `port` on host address `host`: the bare `P:P` (every
    interface) for a wildcard, `ADDR:P:P` otherwise. docker takes an IP address there, not a name."""
    if host in WILDCARDS:
        return f"{port}:{port}"
    address = "127.0.0.1" if host.strip().lower() == "localhost" else host.strip("[]")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ToolchainError(f"serving.host {host} is a name; docker publishes a container's ports on an IP address",
                             "set serving.host (and serving.metrics_host) to this host's address, or 0.0.0.0") from None
    return f"[{ip}]:{port}:{port}" if ip.version == 6 else f"{ip}:{port}:{port}"


def docker_command(spec, argv: list[str], mounts: list, ports: dict[str, int], env: dict[str, str] | None = None,
                   devices: str | None = None) -> str:
    """A `docker run` line starting `argv` in the NGC image matching TensorRT-LLM 1.2, `mounts` at the
    same place (so the absolute paths in the rendered configs hold inside the container), `ports` (kind ->
    port; 0, a port picked at start, is not published) published on the host addresses the spec binds them
    to (Endpoint.published_on: a loopback spec's on 127.0.0.1), `argv` binding every interface inside.
    `devices`: the GPUs the container gets ("0,1"), else all. Where argv holds exposure.PLACEHOLDER (the
    admin APIs restricted), the key reaches the container off the command line: `-e VAR` (copied from
    docker's own environment) or the key file mounted read-only, expanded into the argv by a shell inside
    the container."""
    s = spec.serving
    # docker reads --gpus as CSV: a device list needs the inner double quotes (`--gpus '"device=0,1"'`).
    gpus = "all" if devices is None else f'"device={devices}"'
    docker = ["docker", "run", "--rm", "--gpus", gpus, "--ipc=host", "--shm-size=2g", "--ulimit", "memlock=-1",
              "--ulimit", "stack=67108864"]
    published = endpoints(spec)
    for kind, port in ports.items():
        if port:
            on = published.openai if kind == "openai" else published.triton[kind]
            docker += ["-p", publish_arg(on.published_on, port)]
    for key, value in (env or {}).items():
        docker += ["-e", f"{key}={value}"]
    for m in sorted({str(Path(m)) for m in mounts}):
        docker += ["-v", f"{m}:{m}"]
    command = list(argv)
    if any(exposure.PLACEHOLDER in a for a in argv):
        if s.admin_key_file is not None:
            docker += ["-v", f"{s.admin_key_file}:{CONTAINER_KEY_FILE}:ro"]
            reference = exposure.shell_reference(s, CONTAINER_KEY_FILE)
        else:
            docker += ["-e", s.admin_key_env]
            reference = exposure.shell_reference(s)
        command = ["sh", "-c", "exec " + shlex.join(argv).replace(exposure.PLACEHOLDER, reference)]
    return shlex.join([*docker, TRITON_IMAGE, *command])


def container_commands(spec, repo_dir: Path, mounts: list, devices: str | None = None) -> dict[str, str]:
    """A `docker run` (docker_command; every endpoint bound to every interface inside the container, the
    ports published where the spec binds them) and a `kubectl run` line (the spec's own line) that start
    `launch_command(spec, repo_dir)` in the NGC image matching TensorRT-LLM 1.2. With the administrative
    APIs restricted, Kubernetes reads the key from a Secret (`kubernetes_secret`, the line creating it)
    and expands `$(VAR)` in the container command itself. `toolchain serve --manifests` writes the
    Deployment or LeaderWorkerSet with a Service and probes (triton/manifests.py)."""
    launch = launch_command(spec, repo_dir)
    triton = endpoints(spec).triton
    unique = sorted({str(Path(m)) for m in mounts})
    name = cluster.k8s_name(spec)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in launch.env.items()]
    out: dict[str, Any] = {}
    if launch.restricted:
        env += cluster.key_env(spec)
        out["kubernetes_secret"] = cluster.secret_line(spec)
    container = {
        "name": name, "image": TRITON_IMAGE,
        "command": cluster.k8s_command(launch.argv, spec),
        "env": env,
        "ports": [{"containerPort": p} for p in triton.declared.values()],
        "resources": {"limits": {cluster.GPU_RESOURCE: min(launch.world_size if launch.mode == "leader"
                                                           else spec.parallelism.world_size, spec.gpu.per_node)}},
        "volumeMounts": [{"name": f"v{i}", "mountPath": m} for i, m in enumerate(unique)]
                        + [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    overrides = {"spec": {"containers": [container],
                          "volumes": [{"name": f"v{i}", "hostPath": {"path": m}} for i, m in enumerate(unique)]
                          + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    kubectl = ["kubectl", "run", name, f"--image={TRITON_IMAGE}", "--restart=Never",
               f"--overrides={json.dumps(overrides, separators=(',', ':'))}"]
    inside = launch_command(spec, repo_dir, bind=cluster.ALL_INTERFACES)
    docker = docker_command(spec, inside.argv, mounts, triton.ports, inside.env, devices)
    return {"docker": docker, "kubernetes": shlex.join(kubectl), **out}


def find_tools(spec, repo_dir: Path) -> tuple[str, str]:
    """(mpirun, tritonserver) on this host; a ToolchainError naming the command to run otherwise."""
    mpirun = shutil.which("mpirun")
    explicit = spec.serving.tritonserver
    server = str(explicit) if explicit else (shutil.which("tritonserver") or DEFAULT_TRITONSERVER)
    server = server if "/" in server else (shutil.which(server) or server)
    if mpirun is None or not Path(server).is_file():
        missing = "mpirun" if mpirun is None else f"tritonserver ({server})"
        line = launch_command(spec, repo_dir).shell()
        raise ToolchainError(f"{missing} not found; target trtllm serves one tritonserver per rank under mpirun",
                             f"inside the {TRITON_IMAGE} image (TensorRT-LLM {TRTLLM_VERSION}) run: {line}")
    return mpirun, server


def _first_host(hostfile: Path | None) -> str | None:
    if hostfile is None:
        return None
    for line in Path(hostfile).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return line.split()[0]
    return None


# prterun's line when a rank ends the job, e.g. "prterun noticed that process rank 1 with PID 4242 on node vm
# exited on signal 9 (Killed)."
_RANK_ENDED = re.compile(r"noticed that process rank (?P<rank>\d+) with PID (?P<pid>\d+) on node \S+ "
                         r"exited on (?P<how>signal \d+(?: \([^)]*\))?|(?:non-zero )?status \d+)", re.S)
_NOT_ENOUGH_SLOTS = re.compile(r"There are not enough slots available in the system to satisfy the (\d+)")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def rank_pids(mpirun_pid: int) -> dict[int, int]:
    """MPI rank -> pid of its process, from mpirun's descendants' environments (Linux /proc)."""
    out: dict[int, int] = {}
    todo = _children(mpirun_pid)
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        rank = next((v.split(b"=", 1)[1] for v in env if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None and rank.isdigit():
            out[int(rank)] = pid
        else:
            todo += _children(pid)
    return out


class TritonLaunch(UrlAccessors):
    """The mpirun process group serving an engine repository, one tritonserver per rank; the same
    surface as TritonServer (procgroup.Server's start, stop, running, ready, urls and logs; dead_stubs,
    failure_cause, log_path).

    `cpu()` builds it for target cpu on this host: the wheel's tritonserver, the rank group's
    rendezvous address, shared-memory prefixes of its own and a slot check before start."""

    def __init__(self, spec, repo_dir: Path, log_path: Path, mpirun: str, tritonserver: str):
        self.spec, self.repo_dir, self.log_path = spec, Path(repo_dir), Path(log_path)
        self.mpirun, self.tritonserver = mpirun, tritonserver
        s = spec.serving
        # Rank 0 binds serving.host on the first host of gpu.hostfile, where its clients reach it.
        self.endpoints = endpoints(spec).triton.reached_at(_first_host(spec.gpu.hostfile) or s.host)
        self.ports = self.endpoints.ports
        # Read before start so a missing key is a one-line error; only ever passed to the process.
        self.admin_key = exposure.read_admin_key(s) if exposure.restricted(s) else None
        self.host = client_host(self.endpoints.http.bind)
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None
        self._log: IO[bytes] | None = None
        self.env: dict[str, str] = dict(os.environ)
        self.shm_prefix = "prefix"
        self.extra_rank_args: tuple[str, ...] = ()
        self.slots: int | None = None  # cores the ranks may use (CPU ranks); None: not checked here
        self._ranks: dict[int, int] = {}
        self._stubs: dict[str, tuple[int, int]] = {}  # "instance (rank r)" -> (rank, stub pid)

    @classmethod
    def cpu(cls, spec, repo_dir: Path, log_path: Path) -> "TritonLaunch":
        binary = resolve_binary(spec.serving.tritonserver)
        launch = cls(spec, repo_dir, log_path, cpu_mpirun(), str(binary.path))
        launch.env = server_env(binary)
        # The single server's bounded shutdown: a rank whose model died must not wait out the default 30 s.
        launch.extra_rank_args = ("--exit-timeout-secs=10",)
        if binary.needs_backend_dir:
            launch.extra_rank_args += (f"--backend-directory={backend_dir(binary)}",)
        # Concurrent launches on one host must not share /dev/shm regions.
        launch.shm_prefix = f"tc{os.getpid()}_{uuid.uuid4().hex[:8]}_r"
        launch.slots = physical_cores()
        return launch

    @property
    def urls(self) -> dict[str, str]:
        return self.endpoints.with_ports(self.ports).urls

    @property
    def logs(self) -> dict[str, Path]:
        return {"mpirun": self.log_path}  # every rank's tritonserver writes into mpirun's output

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def ready(self) -> bool:
        return self.running and is_ready(f"{self.http_url}/v2/health/ready") and not self.dead_stubs()

    def command(self) -> LaunchCommand:
        return launch_command(self.spec, self.repo_dir, tritonserver=self.tritonserver, mpirun=self.mpirun,
                              ports=self.ports, admin_key=self.admin_key, shm_prefix=self.shm_prefix,
                              extra_rank_args=self.extra_rank_args)

    def _preflight(self) -> None:
        world = self.spec.parallelism.world_size
        if self.slots is not None and world > self.slots and not self.spec.serving.oversubscribe:
            raise ToolchainError(f"{world} ranks (tp x pp) but mpirun has {self.slots} slot(s) here (one per core)",
                                 "lower parallelism.tp/pp, or set serving.oversubscribe: true to share cores")
        for kind, port in self.ports.items():
            if port and port_in_use(self.host, port):
                raise ToolchainError(f"{kind} port {port} on {self.host} is already in use",
                                     f"stop whatever listens there or pass --set serving.{kind}_port=0")

    def start(self, timeout: float) -> "TritonLaunch":
        self._preflight()
        for kind, port in self.ports.items():
            if not port:
                taken = set(self.ports.values())
                while port in taken or not port:
                    port = free_port(self.host)
                self.ports[kind] = port
        launch = self.command()
        env = {**self.env, **launch.env}
        if self.slots is not None:  # CPU ranks: where rank 0 gathers the group (engine/cpu/ranks.py)
            from toolchain.engine.cpu.comm import ADDR_ENV

            env[ADDR_ENV] = f"127.0.0.1:{free_port('127.0.0.1')}"
        t0 = time.monotonic()
        # Its own session: stop() reaches mpirun and, through their pids, every rank.
        self.process, self._log = procgroup.spawn(launch.argv, env, self.log_path)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self._ranks = rank_pids(self.process.pid)
        self._stubs = {f"{name} (rank {rank})": (rank, stub) for rank, pid in self._ranks.items()
                       for name, stub in python_stubs(pid).items()}
        self.started_s = time.monotonic() - t0
        return self

    def _wait_ready(self, timeout: float) -> None:
        url = f"{self.urls['http']}/v2/health/ready"
        assert self.process is not None, "start() spawns the process first"
        procgroup.wait_ready(
            self.process, lambda: is_ready(url), timeout,
            exited=lambda rc: StageFailed(f"mpirun exited during start-up (exit code {rc}): {self.failure_cause()}",
                                          f"full log: {self.log_path}"),
            timed_out=lambda: StageFailed(f"rank 0 not ready after {timeout:.0f} s",
                                          f"raise serving.startup_timeout_s or read {self.log_path}"),
            poll_s=0.2)

    def dead_stubs(self) -> list[str]:
        """Instances (named with their rank) whose stub or whole rank is gone since start: tritonserver
        keeps a dead stub's requests waiting, and a rank group cannot compute without every member."""
        dead = [f"tritonserver (rank {r})" for r, pid in sorted(self._ranks.items()) if not procgroup.pid_running(pid)]
        live = {r: python_stubs(pid) for r, pid in self._ranks.items()}
        dead += [name for name, (rank, stub) in sorted(self._stubs.items()) if stub not in live[rank].values()]
        return dead

    def failure_cause(self, default: str = "see the log") -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        ended = _RANK_ENDED.search(text)
        if ended:
            how = " ".join(ended.group("how").split())
            return f"rank {ended.group('rank')} (pid {ended.group('pid')}) exited on {how}"
        slots = _NOT_ENOUGH_SLOTS.search(text)
        if slots:
            return (f"mpirun has not enough slots for {slots.group(1)} ranks; "
                    "set serving.oversubscribe: true or lower tp x pp")
        return diagnose_log(text, self.host, self.ports) or default

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM every rank (each is its own process group under Open MPI 5) so each tritonserver
        shuts down gracefully, then wait for mpirun; what is left after `timeout` (default 30 s) is
        killed, and the shared-memory regions of a rank that could not clean up are removed."""
        timeout = 30.0 if timeout is None else timeout
        proc, self.process = self.process, None
        rc = None
        if proc is not None:
            ranks = rank_pids(proc.pid) or self._ranks
            for pid in ranks.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout if ranks else 0.1)
            except subprocess.TimeoutExpired:
                rc = None
            for pid in ranks.values():  # a rank that did not exit in time, with its stubs
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            rc = procgroup.stop_group(proc, 5.0) if rc is None else rc
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.shm_prefix != "prefix":
            for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
                with contextlib.suppress(OSError):
                    leftover.unlink()
        return rc

    def __enter__(self) -> "TritonLaunch":
        return self.start(self.spec.serving.startup_timeout_s)

    def __exit__(self, *exc) -> None:
        self.stop()
