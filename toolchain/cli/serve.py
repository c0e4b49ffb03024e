"""`toolchain serve SPEC`: run tritonserver on the rendered repository until Ctrl-C or SIGTERM.

Target cpu: one tritonserver (the nvidia-pytriton wheel's, or one on PATH).
Target trtllm: one tritonserver per rank under mpirun (toolchain/triton/launch.py);
`--print` also prints the container and Kubernetes lines for the NGC image, and `--manifests DIR` writes
the Slurm and Kubernetes manifests (toolchain/triton/manifests.py).
Target llmapi (a GPU host with TensorRT-LLM 1.2.1, checked by llmapi.runtime-version): one tritonserver on
the llmapi repository; `--print` shows the trtllm-serve and Triton launcher lines (toolchain/llmapi/launch.py)
and their `docker run` lines, and `--manifests DIR` writes the Slurm and Kubernetes manifests
(toolchain/llmapi/manifests.py). Writing manifests is printing: the preflight checks only warn.
Target llmapi-cpu: the same on this host, with the CPU stand-in for LLM() (there is no engine), and the
OpenAI-compatible server on the same LLM() arguments beside it (llmapi.openai_port), as deploy serves the two;
serve.ports-free checks every port of both before either starts, and either one exiting stops the other.

Off loopback (serving.host), Triton's administrative APIs need a key (toolchain/triton/exposure.py):
serve reads it before starting, warns in one line, and the printed lines refer to the key, never hold it.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Callable

import click

from toolchain import pipeline, procgroup
from toolchain.cli._common import Context, spec_command
from toolchain.errors import StageFailed, ToolchainError
from toolchain.manifest import is_current
from toolchain.openai.server import OpenAIServer
from toolchain.spec import DeploymentSpec
from toolchain.stopsignals import stop_on_signals
from toolchain.triton import exposure
from toolchain.triton.server import TritonServer


def _write_manifests(spec: DeploymentSpec, ws, manifests_dir: Path | None) -> None:
    """--manifests DIR: the Slurm and Kubernetes manifests of the spec's path, written atomically."""
    if manifests_dir is None:
        click.echo("# Slurm batch script, Kubernetes Deployment or LeaderWorkerSet with a Service: add --manifests DIR")
        return
    for path in pipeline.write_manifests(spec, ws, manifests_dir):
        click.echo(f"# wrote {path}")


def _describe(spec: DeploymentSpec, server: pipeline.Server) -> str:
    """What serve's ready line says it started: the binary, and under mpirun how many ranks."""
    if isinstance(server, TritonServer):
        return f"{server.binary.source}: {server.binary.path}"
    if spec.target == "trtllm":
        return f"{spec.parallelism.world_size} rank(s) under {server.mpirun}, {server.tritonserver}"
    return f"{spec.parallelism.world_size} CPU rank process(es) under {server.mpirun}, {server.tritonserver}"


def _exit_status(rc: int | None) -> str:
    if rc is None:
        return "exit code unknown"
    return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"


DEAD_STUB_STOP_S = 3.0
_ABORT = re.compile(r"terminate called after throwing an instance of '([^']+)'")


def _run_until_stopped(server, timeout: float, describe: str,
                       models: str = "ensemble and tensorrt_llm_bls (text), tensorrt_llm (token ids)",
                       openai: OpenAIServer | None = None) -> None:
    """Start `server` (and then `openai`, the OpenAI server of target llmapi-cpu), print their endpoints and
    watch them until Ctrl-C, a stop signal, or one of them going down; stop both either way."""
    stop_timeout: float | None = None  # the server's own bounded shutdown
    # SIGTERM and SIGHUP end the server like Ctrl-C (stopsignals.py)
    with stop_on_signals():
        try:
            server.start(timeout=timeout)
            click.echo(f"tritonserver ready in {server.started_s:.1f}s ({describe})")
            click.echo(f"  HTTP     {server.urls['http']}")
            click.echo(f"  gRPC     {server.urls['grpc']}")
            click.echo(f"  metrics  {server.urls['metrics']}")
            click.echo(f"  models   {models}")
            click.echo(f"  log      {server.log_path}")
            if openai is not None:
                openai.start(timeout=timeout)
                click.echo(f"OpenAI server ready in {openai.started_s:.1f}s (the same LLM() arguments)")
                click.echo(f"  HTTP     {openai.url}/v1/completions, /v1/chat/completions, /v1/models")
                click.echo(f"  model    {openai.served_model_name}")
                click.echo(f"  log      {openai.log_path}")
            click.echo("Ctrl-C to stop")
            # tritonserver 2.51 neither restarts a Python-backend stub that died nor stops reporting ready,
            # and requests in flight on it never end: a dead stub ends the serve, in one line. Stopping the
            # server closes its connections, which ends every request in flight with an error.
            dead_stubs: Callable[[], list[str]] = getattr(server, "dead_stubs", lambda: [])
            stubs: dict[str, int] = getattr(server, "stub_pids", dict)()
            while True:
                # Which stubs are gone, looked at before running's poll() reaps the server: the stubs of a
                # server that died outlive it briefly, the one whose death took the server down does not.
                gone = sorted(name for name, pid in stubs.items() if not procgroup.pid_running(pid))
                if not server.running:
                    break
                if openai is not None and not openai.running:
                    assert openai.process is not None
                    raise StageFailed(f"the OpenAI server exited unexpectedly "
                                      f"({_exit_status(openai.process.returncode)}): {openai.failure_cause()}",
                                      f"restart `toolchain serve`; the log: {openai.log_path}")
                dead = dead_stubs()
                if dead:
                    # The dead instance never unloads: waiting out tritonserver's exit timeout would only
                    # keep the requests in flight waiting longer.
                    stop_timeout = DEAD_STUB_STOP_S
                    click.echo(f"model instance {', '.join(dead)} died: stopping tritonserver ...")
                    raise StageFailed(f"model instance {', '.join(dead)} died (its Python-backend stub is gone); "
                                      "tritonserver would keep requests on it waiting forever",
                                      f"restart `toolchain serve`; the log: {server.log_path}")
                time.sleep(0.5)
            rc = server.process.returncode if server.process is not None else None
            if gone and len(gone) < len(stubs):  # the server went down with (after) a model instance
                abort = _ABORT.search(server.log_text()) if hasattr(server, "log_text") else None
                raise StageFailed(f"model instance {', '.join(gone)} died (its Python-backend stub is gone) and "
                                  f"tritonserver exited with it ({_exit_status(rc)}"
                                  f"{': uncaught ' + abort.group(1) if abort else ''})",
                                  f"restart `toolchain serve`; the log: {server.log_path}")
            raise StageFailed(f"tritonserver exited unexpectedly: {server.failure_cause()}", f"full log: {server.log_path}")
        except KeyboardInterrupt:
            click.echo("stopping tritonserver ..." if openai is None else "stopping the OpenAI server and tritonserver ...")
        finally:
            try:
                if openai is not None:
                    openai_rc = openai.stop()
            finally:
                rc = server.stop(stop_timeout)
    if openai is not None:  # SIGTERM is how it is stopped: uvicorn then exits 128 + 15, which is no news
        clean = openai_rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        click.echo("OpenAI server stopped" + ("" if clean else f" ({_exit_status(openai_rc)})"))
    click.echo(f"tritonserver stopped (exit code {rc})")


def _check_outputs(spec: DeploymentSpec, ws) -> None:
    """Before any server starts: the engine and repository hold the files their stages wrote (refused in one
    line naming the file otherwise), and the hand edits kept with --keep-edits are named."""
    pipeline.check_served_outputs(spec, ws)
    for stage, files in pipeline.kept_edits(spec, ws).items():
        click.echo(f"note: serving files edited by hand ({stage} kept them): {', '.join(files)}", err=True)


@click.command()
@click.option("--print", "print_only", is_flag=True,
              help="Print the launch command (target trtllm: mpirun, container and Kubernetes lines) and exit.")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="Readiness timeout (default: serving.startup_timeout_s).")
@click.option("--manifests", "manifests_dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Targets trtllm and llmapi: write a Slurm batch script and a Kubernetes Deployment (one host) "
                   "or LeaderWorkerSet (several) with a Service and probes to DIR (implies --print).")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, print_only: bool, timeout: float | None,
            manifests_dir: Path | None) -> None:
    """Serve model_repo/<name> for SPEC with tritonserver (one per rank under mpirun for
    target trtllm; with the OpenAI server beside it for target llmapi-cpu), print the endpoints,
    and stop cleanly on Ctrl-C or SIGTERM."""
    from toolchain.triton.repo import wanted_manifest  # the renderer imports the tokenizer's packages

    ws = ctx.workspace
    repo = ws.model_repo_dir(spec)
    if manifests_dir is not None and spec.target not in ("trtllm", "llmapi"):
        raise ToolchainError(f"--manifests is for the GPU targets trtllm and llmapi, not {spec.target}",
                             "set target: trtllm or llmapi, or drop --manifests")
    warning = exposure.warning(spec.serving)
    if warning and not (spec.target == "llmapi" and (print_only or manifests_dir is not None)):
        click.echo(warning, err=True)
    if spec.target in ("trtllm", "llmapi") and (print_only or manifests_dir is not None):
        pipeline.print_gpu_launch(spec, ws, click.echo)
        _write_manifests(spec, ws, manifests_dir)
        return
    if spec.serving.replicas > 1:  # one process group per serve: the replicas' lines say where the others go
        click.echo(f"note: serving.replicas {spec.serving.replicas}: serve starts one replica here (replica 0: the "
                   "spec's ports, the GPUs this process sees); `toolchain serve SPEC --print` prints every replica's "
                   "lines", err=True)
    if spec.target == "llmapi" and pipeline.multi_node(spec):
        raise ToolchainError(f"tp x pp spans {pipeline.node_count(spec)} hosts: one `serve` cannot start them",
                             "write the Slurm or Kubernetes manifests with `toolchain serve SPEC --manifests DIR`")
    if not (repo / "manifest.json").is_file():
        raise ToolchainError(f"no model repository at {repo}", "run `toolchain model-repo SPEC` first")
    log = pipeline.server_log(spec, ws)
    if spec.llmapi_path:
        # The LLM-API path has no engine: the repository's model.yaml points LLM() at the checkpoint.
        # One tritonserver (the container's, on a GPU host; llmapi.runtime-version checked TensorRT-LLM)
        # runs LLM(), which starts its own worker per rank, as upstream's launcher does at world size 1.
        server = pipeline.server_for(spec, ws, log_path=log, read_key=not print_only)
        if print_only:
            pipeline.print_local_launch(spec, ws, server, click.echo)
            return
        _check_outputs(spec, ws)
        # llmapi-cpu serves what deploy serves: Triton's llmapi model and the OpenAI server (on a GPU host
        # trtllm-serve is its own command, printed by --print).
        openai = pipeline.openai_server(spec, ws, pipeline.openai_log(spec, ws)) if spec.target == "llmapi-cpu" else None
        _run_until_stopped(server, timeout or spec.serving.startup_timeout_s, _describe(spec, server),
                           models="tensorrt_llm (LLM API)", openai=openai)
        return
    if not (ws.engine_dir(spec) / "config.json").is_file():
        raise ToolchainError(f"no engine at {ws.engine_dir(spec)}", "run `toolchain build-engine SPEC` first")
    server = pipeline.server_for(spec, ws, log_path=log, read_key=not print_only)
    if print_only:  # target cpu (target trtllm printed its GPU lines above)
        pipeline.print_local_launch(spec, ws, server, click.echo)
        return
    describe = _describe(spec, server)
    _check_outputs(spec, ws)
    if not is_current(repo, wanted_manifest(spec, ws)):
        click.echo("warning: the model repository was rendered from a different spec, engine or tokenizer; "
                   "run `toolchain model-repo SPEC` to refresh it", err=True)
    _run_until_stopped(server, timeout or spec.serving.startup_timeout_s, describe)
