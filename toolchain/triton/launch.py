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
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolchain.errors import StageFailed, ToolchainError
from toolchain.plan.versions import TRITON_IMAGE, TRTLLM_VERSION
from toolchain.triton import procgroup
from toolchain.triton.server import diagnose_log, free_port, is_ready

DEFAULT_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"


def trtllm_models(spec) -> tuple[str, ...]:
    """The models backed by TensorRT-LLM engines, which every rank loads."""
    return ("tensorrt_llm", "tensorrt_llm_draft") if spec.speculative.mode == "draft_target" else ("tensorrt_llm",)


@dataclass
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1
    mode: str = "leader"

    def shell(self) -> str:
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(prefix + [shlex.join(self.argv)])


def _rank_args(i: int, spec, repo: Path, tritonserver: str, ports: dict[str, int]) -> list[str]:
    args = [tritonserver, f"--model-repository={repo}", "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name=prefix{i}_"]
    if i == 0:
        for kind in ("http", "grpc", "metrics"):
            args += [f"--{kind}-address={spec.serving.host}", f"--{kind}-port={ports[kind]}"]
        return args
    args += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in trtllm_models(spec)),
             "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
    return args


def launch_command(spec, repo_dir: Path, *, tritonserver: str = DEFAULT_TRITONSERVER, mpirun: str = "mpirun",
                   ports: dict[str, int] | None = None) -> LaunchCommand:
    """The mpirun command line serving `repo_dir` for a target-trtllm spec."""
    s = spec.serving
    ports = ports or {"http": s.http_port, "grpc": s.grpc_port, "metrics": s.metrics_port}
    repo = Path(repo_dir)
    head = [mpirun, "--allow-run-as-root"]
    if spec.gpu.hostfile is not None:
        head += ["--hostfile", str(spec.gpu.hostfile)]
    world = spec.parallelism.world_size
    if spec.speculative.mode == "draft_target":
        # Orchestrator with spawned workers: one server process, every GPU's CUDA pool off
        # (launch_triton_server.py --multi-model).
        gpus = [f"--cuda-memory-pool-byte-size={g}:0" for g in range(world)]
        rank0 = _rank_args(0, spec, repo, tritonserver, ports)
        argv = head + ["-n", "1", *rank0, "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false", *gpus]
        return LaunchCommand(argv, {"TRTLLM_ORCHESTRATOR": "1"}, 1, "orchestrator")
    argv = list(head)
    for i in range(world):
        argv += ([":"] if i else []) + ["-n", "1", *_rank_args(i, spec, repo, tritonserver, ports)]
    return LaunchCommand(argv, {}, world, "leader")


def container_commands(spec, launch: LaunchCommand, mounts: list[Path]) -> dict[str, str]:
    """A `docker run` and a `kubectl run` line that start `launch` in the NGC image
    matching TensorRT-LLM 1.2. Paths are mounted at the same place, so the absolute
    engine and tokenizer paths in the rendered configs hold inside the container."""
    s = spec.serving
    published = [p for p in (s.http_port, s.grpc_port, s.metrics_port) if p]
    docker = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--shm-size=2g", "--ulimit", "memlock=-1",
              "--ulimit", "stack=67108864"]
    for port in published:
        docker += ["-p", f"{port}:{port}"]
    for key, value in launch.env.items():
        docker += ["-e", f"{key}={value}"]
    unique = sorted({str(Path(m)) for m in mounts})
    for m in unique:
        docker += ["-v", f"{m}:{m}"]
    docker += [TRITON_IMAGE, *launch.argv]
    name = spec.name.lower().replace("_", "-").replace(".", "-")
    container = {
        "name": name, "image": TRITON_IMAGE, "command": launch.argv,
        "env": [{"name": k, "value": v} for k, v in launch.env.items()],
        "ports": [{"containerPort": p} for p in published],
        "resources": {"limits": {"nvidia.com/gpu": min(launch.world_size if launch.mode == "leader"
                                                       else spec.parallelism.world_size, spec.gpu.per_node)}},
        "volumeMounts": [{"name": f"v{i}", "mountPath": m} for i, m in enumerate(unique)]
                        + [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    overrides = {"spec": {"containers": [container],
                          "volumes": [{"name": f"v{i}", "hostPath": {"path": m}} for i, m in enumerate(unique)]
                          + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    kubectl = ["kubectl", "run", name, f"--image={TRITON_IMAGE}", "--restart=Never",
               f"--overrides={json.dumps(overrides, separators=(',', ':'))}"]
    return {"docker": shlex.join(docker), "kubernetes": shlex.join(kubectl)}


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


class TritonLaunch:
    """The mpirun process group serving a trtllm repository; the same surface as
    TritonServer (start, stop, running, urls, failure_cause, log_path)."""

    def __init__(self, spec, repo_dir: Path, log_path: Path, mpirun: str, tritonserver: str):
        self.spec, self.repo_dir, self.log_path = spec, Path(repo_dir), Path(log_path)
        self.mpirun, self.tritonserver = mpirun, tritonserver
        s = spec.serving
        self.ports = {"http": s.http_port, "grpc": s.grpc_port, "metrics": s.metrics_port}
        host = _first_host(spec.gpu.hostfile) or s.host
        # A server bound to every interface is reached on loopback.
        self.host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None
        self._log = None

    @property
    def urls(self) -> dict[str, str]:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return {"http": f"http://{h}:{self.ports['http']}", "grpc": f"{h}:{self.ports['grpc']}",
                "metrics": f"http://{h}:{self.ports['metrics']}/metrics"}

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> LaunchCommand:
        return launch_command(self.spec, self.repo_dir, tritonserver=self.tritonserver, mpirun=self.mpirun,
                              ports=self.ports)

    def start(self, timeout: float) -> "TritonLaunch":
        for kind, port in self.ports.items():
            if not port:
                self.ports[kind] = free_port(self.spec.serving.host if self.spec.serving.host != "0.0.0.0"
                                             else "127.0.0.1")
        launch = self.command()
        t0 = time.monotonic()
        # Its own process group: stop() signals mpirun and every rank.
        self.process, self._log = procgroup.spawn(launch.argv, {**os.environ, **launch.env}, self.log_path)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _wait_ready(self, timeout: float) -> None:
        url = f"{self.urls['http']}/v2/health/ready"
        procgroup.wait_ready(
            self.process, lambda: is_ready(url), timeout,
            exited=lambda rc: StageFailed(f"mpirun exited during start-up (exit code {rc}): {self.failure_cause()}",
                                          f"full log: {self.log_path}"),
            timed_out=lambda: StageFailed(f"rank 0 not ready after {timeout:.0f} s",
                                          f"raise serving.startup_timeout_s or read {self.log_path}"),
            poll_s=0.5)

    def failure_cause(self, default: str = "see the log") -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        return diagnose_log(text, self.host, self.ports) or default

    def stop(self, timeout: float = 30.0) -> int | None:
        proc, self.process = self.process, None
        rc = None
        if proc is not None:
            rc = procgroup.stop_group(proc, timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc
