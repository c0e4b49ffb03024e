"""`toolchain serve SPEC`: run tritonserver on the rendered repository until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import time

import click

from toolchain.cli._common import Context, spec_command
from toolchain.errors import StageFailed, ToolchainError
from toolchain.spec import DeploymentSpec


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


@click.command()
@click.option("--print", "print_only", is_flag=True, help="Print the tritonserver command line and exit.")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="Readiness timeout (default: serving.startup_timeout_s).")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, print_only: bool, timeout: float | None) -> None:
    """Serve model_repo/<name> for SPEC with tritonserver, print the endpoints, and stop cleanly
    on Ctrl-C or SIGTERM."""
    from toolchain.manifest import is_current
    from toolchain.triton.repo import wanted_manifest
    from toolchain.triton.server import TritonServer

    ws = ctx.workspace
    if spec.target == "trtllm":
        raise ToolchainError("`serve` for target trtllm (one tritonserver per rank under mpirun) is not supported yet",
                             f"start {ws.model_repo_dir(spec)} with NVIDIA's launch_triton_server.py "
                             f"--world_size {spec.parallelism.world_size} in a TensorRT-LLM container")
    repo = ws.model_repo_dir(spec)
    if not (repo / "manifest.json").is_file():
        raise ToolchainError(f"no model repository at {repo}", "run `toolchain model-repo SPEC` first")
    if not (ws.engine_dir(spec) / "config.json").is_file():
        raise ToolchainError(f"no engine at {ws.engine_dir(spec)}", "run `toolchain build-engine SPEC` first")
    server = TritonServer.from_spec(spec, repo, log_path=repo.parent / f"{spec.name}.tritonserver.log")
    if print_only:
        click.echo(server.command_line())
        return
    if not is_current(repo, wanted_manifest(spec, ws)):
        click.echo("warning: the model repository was rendered from a different spec, engine or tokenizer; "
                   "run `toolchain model-repo SPEC` to refresh it", err=True)

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM ends the server like Ctrl-C
    try:
        server.start(timeout=timeout or spec.serving.startup_timeout_s)
        click.echo(f"tritonserver ready in {server.started_s:.1f}s ({server.binary.source}: {server.binary.path})")
        click.echo(f"  HTTP     {server.http_url}")
        click.echo(f"  gRPC     {server.grpc_url}")
        click.echo(f"  metrics  {server.metrics_url}")
        click.echo("  models   ensemble and tensorrt_llm_bls (text), tensorrt_llm (token ids)")
        click.echo(f"  log      {server.log_path}")
        click.echo("Ctrl-C to stop")
        while server.running:
            time.sleep(0.5)
        raise StageFailed(f"tritonserver exited unexpectedly: {server.failure_cause()}", f"full log: {server.log_path}")
    except KeyboardInterrupt:
        click.echo("stopping tritonserver ...")
    finally:
        signal.signal(signal.SIGTERM, previous)
        rc = server.stop()
    click.echo(f"tritonserver stopped (exit code {rc})")
