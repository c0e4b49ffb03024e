"""The one place that maps a spec to its path: which convert, which model repository, which server and
which printed launch lines its target takes, `serve_until_stopped`, the supervision of serve's and dynamo's
servers (any procgroup.Server), and `deploy`, every stage in order, then serve, bench and stop.

A spec's target names a row of toolchain/targets.py; the row's path (engine or llmapi) picks the stages here,
so the stages never switch to another path's. The CLI commands convert, model-repo, serve and deploy ask this
module. Each stage keeps its own caching: a second deploy with nothing changed goes straight to serving.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import signal
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

from toolchain import procgroup
from toolchain.bench.failfast import stop_line
from toolchain.errors import StageFailed, ToolchainError
from toolchain.manifest import Manifest, output_problem
from toolchain.quant.view import Quantization
from toolchain.spec import DeploymentSpec
from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.stopsignals import stop_on_signals
from toolchain.targets import LLMAPI_SERVE, TRITON_MPIRUN, target_of
from toolchain.workspace import Workspace
from toolchain.engine.build import run_build
from toolchain.triton import cluster, exposure, manifests as triton_manifests
from toolchain.triton.endpoints import endpoints
from toolchain.triton.launch import TritonLaunch, container_commands, docker_command, find_tools, launch_command
from toolchain.triton.server import TritonServer
from toolchain.llmapi import launch as llmapi_launch, manifests as llmapi_manifests
from toolchain.llmapi.cpu_llm import ENGINE_DIR_ENV
from toolchain.llmapi.launch import openai_engine_args, parser_options, serve_config_path, served_model_name
from toolchain.llmapi.stage import run_convert_llmapi, served_model_dir
from toolchain.openai.server import OpenAIServer

Progress = Callable[[str, str], None]
Echo = Callable[[str], None]
Triton = TritonServer | TritonLaunch  # what server_for returns; both are procgroup.Server


class Convert(Protocol):
    def __call__(self, spec: DeploymentSpec, workspace: Workspace, force: bool = False,
                 echo: Echo | None = None, keep_edits: bool = False) -> Manifest: ...


class ModelRepo(Protocol):
    def __call__(self, spec: DeploymentSpec, workspace: Workspace, force: bool = False,
                 python_models: Path | str | None = None, keep_edits: bool = False,
                 echo: Echo | None = None) -> Manifest: ...


# ---- the path table -----------------------------------------------------------------------------------------

def convert_for(spec: DeploymentSpec) -> Convert:
    """The convert stage of the spec's path: the TensorRT-LLM checkpoint (engine path), or the HF checkpoint
    recorded as it is or exported pre-quantized (LLM-API path)."""
    if target_of(spec).llmapi_path:
        return run_convert_llmapi
    from toolchain.checkpoint.stage import run_convert  # torch: `toolchain --help` and `plan` never need it

    return run_convert


def model_repo_for(spec: DeploymentSpec) -> ModelRepo:
    """The model-repo stage of the spec's path: tensorrtllm_backend's five models (engine path), or Triton's
    llmapi model (LLM-API path)."""
    # Both renderers import heavy packages at their top (transformers' tokenizer, the Triton protobuf).
    if target_of(spec).llmapi_path:
        from toolchain.llmapi.repo import run_model_repo_llmapi

        return run_model_repo_llmapi
    from toolchain.triton.repo import run_model_repo

    return run_model_repo


def server_log(spec: DeploymentSpec, workspace: Workspace) -> Path:
    """Where serve's tritonserver (every rank's, under mpirun) logs: next to the model repository."""
    return workspace.model_repo_dir(spec).parent / f"{spec.name}.tritonserver.log"


def openai_log(spec: DeploymentSpec, workspace: Workspace) -> Path:
    """Where the OpenAI server of target llmapi-cpu (serve's and deploy's) logs: beside tritonserver's."""
    return workspace.model_repo_dir(spec).parent / f"{spec.name}.openai.log"


def server_for(spec: DeploymentSpec, workspace: Workspace, *, log_path: Path | None = None,
               read_key: bool = True) -> Triton:
    """The Triton server the spec's target starts, not started. Target trtllm: one tritonserver per rank
    under mpirun (TensorRT-LLM's leader mode, with this host's mpirun and tritonserver); target cpu with
    serving.launch mpirun: the CPU ranks as processes under mpirun; otherwise one tritonserver (on the
    LLM-API path LLM() starts its own worker per rank, as upstream's launcher does at world size 1).
    Off loopback the admin key is read here, so a missing one fails before start; `read_key=False`
    (printing) leaves its placeholder. A launch under mpirun always logs; the single server logs to
    `log_path` when given."""
    repo = workspace.model_repo_dir(spec)
    if target_of(spec).gpu_launch == TRITON_MPIRUN:
        mpirun, binary = find_tools(spec, repo)
        return TritonLaunch(spec, repo, log_path or server_log(spec, workspace), mpirun, binary)
    if spec.rank_processes:
        return TritonLaunch.cpu(spec, repo, log_path or server_log(spec, workspace))
    return TritonServer.from_spec(spec, repo, log_path=log_path, read_key=read_key, env=_cpu_llm_env(spec, workspace))


def stage_outputs(spec: DeploymentSpec, workspace: Workspace) -> list[Path]:
    """Every output directory the stages of the spec's path write, in stage order."""
    out = [workspace.checkpoint_dir(spec)]
    if target_of(spec).builds_engine:
        out += _lora_dir(spec, workspace)
        if mode_of(spec.speculative.mode).adds == DRAFT_ENGINE:
            out.append(workspace.draft_checkpoint_dir(spec))
        out.append(workspace.engine_dir(spec))
    return out + [workspace.model_repo_dir(spec)]


def kept_edits(spec: DeploymentSpec, workspace: Workspace) -> dict[str, list[str]]:
    """The hand edits the spec's stages kept (--keep-edits), by stage, as their manifests record them:
    report.json's `edited_by_hand`. A stage reruns on a recorded edit unless asked to keep it, so after a
    deploy these are the edits it kept."""
    out = {}
    for directory in stage_outputs(spec, workspace):
        have = Manifest.read(directory)
        if have is not None and have.edited_by_hand:
            out[have.stage] = [str(directory / name) for name in have.edited_by_hand]
    return out


def served_outputs(spec: DeploymentSpec, workspace: Workspace) -> list[tuple[Path, str]]:
    """The stage outputs a server of `spec` loads, each with the command that writes it: the engine (engine
    path) or the quantized checkpoint LLM() loads (LLM-API path; an unquantized one is the user's own HF
    directory), and the model repository."""
    if target_of(spec).llmapi_path:
        loaded = [(workspace.checkpoint_dir(spec), "convert")] if Quantization.of(spec.quantization).active else []
    else:
        # The tensorrt_llm model prefetches the adapters convert wrote (its lora_prefetch_dir).
        loaded = [(workspace.engine_dir(spec), "build-engine"), *((d, "convert") for d in _lora_dir(spec, workspace))]
    return loaded + [(workspace.model_repo_dir(spec), "model-repo")]


def _lora_dir(spec: DeploymentSpec, workspace: Workspace) -> list[Path]:
    """The engine path's converted LoRA adapters (checkpoint/lora_stage.py), where the spec names adapters."""
    return [workspace.lora_dir(spec)] if spec.lora.adapters else []


def check_served_outputs(spec: DeploymentSpec, workspace: Workspace) -> None:
    """Refuse, in one line naming the file, to serve an engine or repository whose files are not those
    its stage wrote (a truncated rank file, a hand edit not kept with --keep-edits). The way out names the
    stage's own command for both: serve has no --keep-edits, the stage that wrote the files records a kept
    edit in their manifest (convert, build-engine and model-repo take the flag)."""
    for directory, command in served_outputs(spec, workspace):
        problem = output_problem(directory)
        if problem:
            again = f"toolchain {command} {spec.source or 'SPEC'}"
            raise ToolchainError(f"{problem}; refusing to serve it",
                                 f"run `{again}` to write it again, or `{again} --keep-edits` to keep a hand edit")


def _cpu_llm_env(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    """Target llmapi-cpu: where convert prepared the CPU engine LLM()'s stand-in loads, so the servers
    load it rather than each converting the checkpoint again (not part of any printed command)."""
    row = target_of(spec)
    if row.llmapi_path and row.on_cpu:
        return {ENGINE_DIR_ENV: str(workspace.cpu_llm_dir(spec).resolve())}
    return {}


def openai_server(spec: DeploymentSpec, workspace: Workspace, log_path: Path) -> OpenAIServer:
    """The OpenAI server on the LLM() arguments of the llmapi-cpu deployment (not started)."""
    openai = endpoints(spec).openai
    return OpenAIServer(None, None, served_model_name(spec), openai.bind, openai.port,
                        model=served_model_dir(spec, workspace), config=serve_config_path(spec, workspace),
                        log_path=log_path, extra_args=(*openai_engine_args(spec), *parser_options(spec)),
                        env=_cpu_llm_env(spec, workspace),
                        port_field="llmapi.openai_port")


# ---- what `serve --print` and `--manifests` show ----------------------------------------------------------

def print_gpu_launch(spec: DeploymentSpec, workspace: Workspace, echo: Echo) -> None:
    """The launch lines of a GPU target (trtllm or llmapi) for a GPU host: the command, its `docker run`
    and Kubernetes lines (engine path), or the trtllm-serve and Triton launcher lines with their containers
    and, across hosts, their Slurm lines (LLM-API path)."""
    printer = _GPU_PRINTERS.get(target_of(spec).gpu_launch)
    if printer is None:
        raise ToolchainError(f"target {spec.target} runs on this host: it has no GPU launch lines",
                             "set target: trtllm or llmapi")
    printer(spec, workspace, echo)


def _replicas(spec: DeploymentSpec, echo: Echo) -> Iterator[tuple[DeploymentSpec, str | None]]:
    """(the spec replica i serves, its GPUs as "0,1" or None for every GPU) for each of serving.replicas, each
    after its heading line where there are several."""
    n = cluster.replicas(spec)
    for i in range(n):
        where = cluster.replica_gpus(spec, i) if n > 1 else None
        if n > 1:
            echo(cluster.replica_note(spec, i))
        yield cluster.replica_spec(spec, i), where[1] if where else None


def _pinned(line: str, devices: str | None) -> str:
    return f"CUDA_VISIBLE_DEVICES={devices} {line}" if devices else line


def _print_trtllm(spec: DeploymentSpec, ws: Workspace, echo: Echo) -> None:
    repo, mounts = ws.model_repo_dir(spec), triton_manifests.mounts(spec, ws)
    for one, devices in _replicas(spec, echo):
        echo(_pinned(launch_command(one, repo).shell(), devices))
        echo(f"# in a container:\n{container_commands(one, repo, mounts, devices)['docker']}")
    lines = container_commands(spec, repo, mounts)
    n = cluster.replicas(spec)
    echo("# on Kubernetes:" if n == 1 else f"# on Kubernetes (one pod; `--manifests DIR` writes {n} replicas "
                                           "behind one Service):")
    if "kubernetes_secret" in lines:
        echo(lines["kubernetes_secret"])
    echo(lines["kubernetes"])
    if spec.gpu.hostfile is not None:
        echo("# several hosts: run the container on each host of gpu.hostfile with ssh between them")


def _print_llmapi(spec: DeploymentSpec, ws: Workspace, echo: Echo) -> None:
    for one, devices in _replicas(spec, echo):
        _print_llmapi_replica(one, ws, echo, devices)
    launch = llmapi_launch
    if launch.multi_node(spec):
        lines = launch.gpu_launch_lines(spec, ws)
        echo(f"# {launch.world_size(spec)} ranks over {launch.node_count(spec)} hosts, under Slurm"
             + (":" if cluster.replicas(spec) == 1 else " (one replica; `--manifests DIR` writes the job array):"))
        echo(lines["trtllm_serve_multi_node"])
        echo(lines["triton_multi_node"])


def _print_llmapi_replica(spec: DeploymentSpec, ws: Workspace, echo: Echo, devices: str | None) -> None:
    launch = llmapi_launch
    lines = launch.gpu_launch_lines(spec, ws)
    echo(f"# OpenAI server (trtllm-serve):\n{_pinned(lines['trtllm_serve'], devices)}")
    for name, body in launch.lora_requests(spec).items():
        echo(f"#   adapter {name}: send \"lora_request\": {json.dumps(body)} in the request body")
    how = ("the command upstream's launcher runs, with the bind addresses and the administrative APIs behind "
           "the key" if exposure.restricted(spec.serving) else "upstream's launcher, from a TensorRT-LLM 1.2.1 checkout")
    echo(f"# Triton ({how}):\n{_pinned(lines['triton'], devices)}")
    mounts = launch.container_mounts(spec, ws)
    served = endpoints(spec)
    # Inside a container every server binds every interface; docker publishes each port on the address the
    # spec binds it to on a host (a loopback spec's on 127.0.0.1).
    serve = launch.trtllm_serve_command(spec, ws, host=launch.ALL_INTERFACES)
    docker = docker_command(spec, serve, mounts, {"openai": served.openai.port}, devices=devices)
    echo(f"# in a container, the OpenAI server:\n{docker}")
    triton = ["mpirun", "--allow-run-as-root", "-n", "1", *launch.tritonserver_command(spec, ws, launch.ALL_INTERFACES)]
    echo(f"# in a container, Triton:\n{docker_command(spec, triton, mounts, served.triton.ports, devices=devices)}")


# The printer of each way a target launches on a GPU host (toolchain/targets.py, Target.gpu_launch).
_GPU_PRINTERS: dict[str | None, Callable[[DeploymentSpec, Workspace, Echo], None]] = {
    TRITON_MPIRUN: _print_trtllm, LLMAPI_SERVE: _print_llmapi}


def print_local_launch(spec: DeploymentSpec, workspace: Workspace, server: Triton, echo: Echo) -> None:
    """The command line of `server` (server_for with read_key=False) that serve starts on this host, and on
    the LLM-API path the OpenAI server's on the same LLM() arguments."""
    if isinstance(server, TritonLaunch):
        echo(server.command().shell())
        return
    echo(server.command_line(exposure.shell_reference(spec.serving)))
    if target_of(spec).llmapi_path:
        echo(f"# OpenAI server on the same LLM() arguments:\n"
             f"{shlex.join(llmapi_launch.openai_cpu_command(spec, workspace))}")


def write_manifests(spec: DeploymentSpec, workspace: Workspace, out_dir: Path) -> list[Path]:
    """The Slurm and Kubernetes manifests of a GPU target's path, written atomically into `out_dir`."""
    # The writer of the way the target launches; a target that runs here gets the LLM-API writer's refusal.
    texts = _MANIFESTS.get(target_of(spec).gpu_launch, llmapi_manifests.manifests)(spec, workspace)
    return cluster.write(out_dir, texts)


_MANIFESTS: dict[str | None, Callable[[DeploymentSpec, Workspace], dict[str, str]]] = {
    TRITON_MPIRUN: triton_manifests.manifests, LLMAPI_SERVE: llmapi_manifests.manifests}


def multi_node(spec: DeploymentSpec) -> bool:
    """An LLM-API deployment whose tp x pp spans several hosts (one `serve` cannot start it)."""
    return llmapi_launch.multi_node(spec)


def node_count(spec: DeploymentSpec) -> int:
    return llmapi_launch.node_count(spec)


# ---- serve: start servers and watch them until stopped ------------------------------------------------------

@dataclasses.dataclass
class Watched:
    """A server serve_until_stopped starts and watches, with what it prints about it: `name` in the stopping
    line, `ready_lines` once it is ready, `check(echo)` raising StageFailed once it is down (or cannot serve any
    more), `stopped(rc)` its line once stopped; `stop_timeout` (None: the server's own) a check may shorten."""
    server: procgroup.Server
    name: str
    ready_lines: Callable[[], list[str]]
    check: Callable[[Echo], None]
    stopped: Callable[[int | None], str]
    stop_timeout: float | None = None


def serve_until_stopped(watched: Sequence[Watched], timeout: float, echo: Echo) -> None:
    """Start each server in order (printing its lines once ready), then watch them until Ctrl-C, a stop signal
    (SIGTERM and SIGHUP end it like Ctrl-C: stopsignals.py) or one of them going down; stop them all, the last
    started first, either way. A server going down raises its StageFailed once every server is stopped."""
    rcs: dict[int, int | None] = {}

    def stop(i: int) -> None:
        rcs[i] = watched[i].server.stop(watched[i].stop_timeout)

    with stop_on_signals():
        with ExitStack() as stopping:  # from the start: a stop signal may arrive the moment start() returns
            for i in range(len(watched)):
                stopping.callback(stop, i)
            try:
                for w in watched:
                    w.server.start(timeout)
                    for line in w.ready_lines():
                        echo(line)
                echo("Ctrl-C to stop")
                while True:
                    for w in watched:
                        w.check(echo)
                    time.sleep(0.5)
            except KeyboardInterrupt:
                echo(f"stopping {' and '.join(w.name for w in reversed(watched))} ...")
    for i in reversed(range(len(watched))):
        echo(watched[i].stopped(rcs.get(i)))


def exit_status(rc: int | None) -> str:
    if rc is None:
        return "exit code unknown"
    return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"


DEAD_STUB_STOP_S = 3.0
_ABORT = re.compile(r"terminate called after throwing an instance of '([^']+)'")


def watch_triton(server: Triton, describe: str, models: str) -> Watched:
    """serve's tritonserver (one, or one per rank under mpirun): its endpoints once ready; down when it exits or
    a model instance's Python-backend stub dies."""
    stubs: list[dict[str, int]] = []  # the stubs up once it is ready, read at the first check

    def ready_lines() -> list[str]:
        return [f"tritonserver ready in {server.started_s:.1f}s ({describe})", f"  HTTP     {server.urls['http']}",
                f"  gRPC     {server.urls['grpc']}", f"  metrics  {server.urls['metrics']}", f"  models   {models}",
                f"  log      {server.log_path}"]

    def check(echo: Echo) -> None:
        if not stubs:
            stubs.append(server.stub_pids() if isinstance(server, TritonServer) else {})
        # Which stubs are gone, looked at before running's poll() reaps the server: the stubs of a server that
        # died outlive it briefly, the one whose death took the server down does not.
        gone = sorted(name for name, pid in stubs[0].items() if not procgroup.pid_running(pid))
        if not server.running:
            rc = server.process.returncode if server.process is not None else None
            if gone and len(gone) < len(stubs[0]):  # the server went down with (after) a model instance
                abort = _ABORT.search(server.log_text()) if isinstance(server, TritonServer) else None
                raise StageFailed(f"model instance {', '.join(gone)} died (its Python-backend stub is gone) and "
                                  f"tritonserver exited with it ({exit_status(rc)}"
                                  f"{': uncaught ' + abort.group(1) if abort else ''})",
                                  f"restart `toolchain serve`; the log: {server.log_path}")
            raise StageFailed(f"tritonserver exited unexpectedly: {server.failure_cause()}", f"full log: {server.log_path}")
        # tritonserver 2.51 neither restarts a Python-backend stub that died nor stops reporting ready, and
        # requests in flight on it never end: a dead stub ends the serve, in one line. Stopping the server
        # closes its connections, which ends every request in flight with an error.
        dead = server.dead_stubs()
        if dead:
            # The dead instance never unloads: waiting out tritonserver's exit timeout would only keep the
            # requests in flight waiting longer.
            watched.stop_timeout = DEAD_STUB_STOP_S
            echo(f"model instance {', '.join(dead)} died: stopping tritonserver ...")
            raise StageFailed(f"model instance {', '.join(dead)} died (its Python-backend stub is gone); "
                              "tritonserver would keep requests on it waiting forever",
                              f"restart `toolchain serve`; the log: {server.log_path}")

    watched = Watched(server, "tritonserver", ready_lines, check, lambda rc: f"tritonserver stopped (exit code {rc})")
    return watched


def watch_openai(server: OpenAIServer) -> Watched:
    """The OpenAI server serve starts beside tritonserver (target llmapi-cpu): down when it exits."""

    def ready_lines() -> list[str]:
        return [f"OpenAI server ready in {server.started_s:.1f}s (the same LLM() arguments)",
                f"  HTTP     {server.url}/v1/completions, /v1/chat/completions, /v1/models",
                f"  model    {server.served_model_name}", f"  log      {server.log_path}"]

    def check(echo: Echo) -> None:
        if not server.running:
            assert server.process is not None
            raise StageFailed(f"the OpenAI server exited unexpectedly "
                              f"({exit_status(server.process.returncode)}): {server.failure_cause()}",
                              f"restart `toolchain serve`; the log: {server.log_path}")

    def stopped(rc: int | None) -> str:  # SIGTERM is how it is stopped: uvicorn then exits 128 + 15, no news
        clean = rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        return "OpenAI server stopped" + ("" if clean else f" ({exit_status(rc)})")

    return Watched(server, "the OpenAI server", ready_lines, check, stopped)


# ---- deploy -------------------------------------------------------------------------------------------------

@contextmanager
def _timed(name: str, progress: Progress, timings: dict) -> Iterator[None]:
    progress(name, "start")
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 3)
    progress(name, f"done in {timings[name]:.2f}s")


def deploy(spec: DeploymentSpec, workspace: Workspace, out_dir: Path | None = None,
           progress: Progress = lambda stage, msg: None, keep_edits: bool = False) -> dict:
    """Run convert -> build-engine -> model-repo -> serve -> bench; write <out>/report.json once, with the
    stage timings (and the hand edits the stages kept, with `keep_edits`), and return the report. Each
    stage says through `progress` why it runs again when its output's files changed. With validation.quality
    bounds, the OpenAI server's quality is measured too, into report.json's `quality` (`toolchain deploy` fails
    on a missed bound, as on a missed SLO)."""
    if exposure.restricted(spec.serving):
        exposure.read_admin_key(spec.serving)  # a missing key fails now, not after convert and build
    out = out_dir or workspace.report_dir(spec)
    timings: dict[str, float] = {}
    report: dict = {}  # the main bench's report, once it has one
    with _timed("convert", progress, timings):
        convert_for(spec)(spec, workspace, echo=_echo("convert", progress), keep_edits=keep_edits)
    try:
        if target_of(spec).llmapi_path:
            _deploy_llmapi(spec, workspace, out, progress, timings, report, keep_edits)
        else:
            _deploy_engine(spec, workspace, out, progress, timings, report, keep_edits)
    except BaseException:
        if report:  # what the bench measured stays on disk when a later step fails or is stopped
            report.update(_edited(spec, workspace))
            report["stage_seconds"] = timings
            _save_report(out, report)
        raise
    report.update(_edited(spec, workspace))
    report["stage_seconds"] = timings
    _save_report(out, report)
    return report


def _echo(stage: str, progress: Progress) -> Echo:
    """A stage's one-line messages (why it runs again), as deploy's progress lines of that stage."""
    return lambda msg: progress(stage, msg)


def _edited(spec: DeploymentSpec, workspace: Workspace) -> dict:
    """report.json's `edited_by_hand: {stage: [files]}`, when a stage kept hand edits."""
    kept = kept_edits(spec, workspace)
    return {"edited_by_hand": kept} if kept else {}


def _raise_if_stopped(report: dict, out_dir: Path) -> None:
    """A bench that gave up on its endpoint (hung or gone) ends deploy with its one line, once the server
    it benched is stopped; nothing later runs against a server that did not answer."""
    if report.get("stopped"):
        raise StageFailed(stop_line(report["stopped"]), f"partial report in {out_dir}")


def _save_report(out_dir: Path, report: dict) -> None:
    """report.json: the bench's report and the stage timings; the OpenAI server's summary (`openai`) stays
    in the returned report, its own report.json is under <out>/openai."""
    from toolchain.bench.report import write_report  # numpy, matplotlib

    write_report(out_dir, {k: v for k, v in report.items() if k != "openai"})


def _deploy_server(spec: DeploymentSpec, workspace: Workspace, progress: Progress) -> Triton:
    """The server serve would start (admin APIs keyed off loopback, metrics on loopback), with serve's
    one-line warning."""
    server = server_for(spec, workspace)  # reads the key: a missing one fails before start
    warning = exposure.warning(spec.serving)
    if warning:
        progress("serve", warning)
    return server


def _deploy_engine(spec: DeploymentSpec, workspace: Workspace, out_dir: Path, progress: Progress,
                   timings: dict, report: dict, keep_edits: bool) -> None:
    """The engine path: build the engine, render tensorrtllm_backend's repository, serve it and bench
    (into `report`)."""
    from toolchain.bench.run import run_bench  # numpy, the protocol clients

    with _timed("build-engine", progress, timings):
        run_build(spec, workspace, converted=True, keep_edits=keep_edits, echo=_echo("build-engine", progress))
    with _timed("model-repo", progress, timings):
        model_repo_for(spec)(spec, workspace, keep_edits=keep_edits, echo=_echo("model-repo", progress))
    serving = spec.serving
    server = _deploy_server(spec, workspace, progress)
    try:  # from the start: a stop signal may arrive the moment start() returns
        with _timed("serve", progress, timings):
            server.start(timeout=serving.startup_timeout_s)
        with _timed("bench", progress, timings):
            # The bench reaches the server it just started, whatever ports were picked.
            url = server.http_url if spec.validation.workload.protocol == "triton-http" else server.grpc_url
            report.update(run_bench(spec, out_dir=out_dir, url=url, metrics_url=server.metrics_url,
                                    save_report=False))
    finally:
        with _timed("stop", progress, timings):
            server.stop()
    _raise_if_stopped(report, out_dir)


def _with_workload(spec: DeploymentSpec, **values) -> DeploymentSpec:
    v = spec.validation
    workload = v.workload.model_copy(update=values)
    return spec.model_copy(update={"validation": v.model_copy(update={"workload": workload})})


def _deploy_llmapi(spec: DeploymentSpec, workspace: Workspace, out_dir: Path, progress: Progress,
                   timings: dict, report: dict, keep_edits: bool) -> None:
    """The LLM-API path on this host (target llmapi-cpu): Triton's llmapi model, then the OpenAI
    server on the same LLM() arguments, each benched; the Triton report is the main one and the
    OpenAI server's is written to <out>/openai and summarised under `openai`."""
    from toolchain.bench.run import run_bench  # numpy, the protocol clients

    if spec.target != "llmapi-cpu":
        raise ToolchainError("deploy runs the LLM-API path on this host with target llmapi-cpu",
                             "on a GPU host run `toolchain model-repo` and the lines `toolchain serve --print` shows")
    with _timed("model-repo", progress, timings):
        model_repo_for(spec)(spec, workspace, keep_edits=keep_edits, echo=_echo("model-repo", progress))
    serving = spec.serving
    server = _deploy_server(spec, workspace, progress)
    try:
        with _timed("serve", progress, timings):
            server.start(timeout=serving.startup_timeout_s)
        with _timed("bench", progress, timings):
            # Triton's llmapi model takes no LoRA adapter per request at TensorRT-LLM 1.2 (bench's check_lora):
            # this leg sends every class to the base model; the OpenAI leg below serves the adapters.
            base_classes = [c.model_copy(update={"adapter": None}) for c in spec.validation.workload.classes]
            triton_spec = _with_workload(spec, protocol="triton-grpc", endpoint="tensorrt_llm", classes=base_classes)
            report.update(run_bench(triton_spec, out_dir=out_dir, url=server.grpc_url,
                                    metrics_url=server.metrics_url, save_report=False))
    finally:
        with _timed("stop", progress, timings):
            server.stop()
    _raise_if_stopped(report, out_dir)
    name = served_model_name(spec)
    openai = openai_server(spec, workspace, openai_log(spec, workspace))
    quality = None
    try:
        with _timed("serve-openai", progress, timings):
            openai.start(timeout=serving.startup_timeout_s)
        with _timed("bench-openai", progress, timings):
            protocol = "openai-chat" if spec.validation.workload.protocol == "openai-chat" else "openai-completions"
            openai_spec = _with_workload(spec, protocol=protocol, endpoint=name)
            second = run_bench(openai_spec, out_dir=out_dir / "openai", url=openai.url, metrics_url="")
        if spec.validation.quality.bounds() and not second.get("stopped"):
            from toolchain.eval.served import deploy_quality  # torch, transformers

            with _timed("quality", progress, timings):
                quality = deploy_quality(spec, openai.url, name, _echo("quality", progress))
    finally:
        with _timed("stop-openai", progress, timings):
            openai.stop()
    _raise_if_stopped(second, out_dir / "openai")
    report["openai"] = {"protocol": protocol, "report": str(out_dir / "openai" / "report.json"),
                        **{k: second.get(k) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "output_tokens_per_s",
                                                      "num_requests", "errors", "slo")}}
    if quality is not None:  # beside the latency verdict in report.json
        report["quality"] = quality
