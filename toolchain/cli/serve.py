"""`toolchain serve SPEC`: run tritonserver on the rendered repository until Ctrl-C or SIGTERM.

Target cpu: one tritonserver (the nvidia-pytriton wheel's, or one on PATH).
Target trtllm: one tritonserver per rank under mpirun (toolchain/triton/launch.py);
`--print` also prints the container and Kubernetes lines for the NGC image.
"""

from __future__ import annotations

import signal
import time

import click

from toolchain.cli._common import Context, spec_command
from toolchain.errors import StageFailed, ToolchainError
from toolchain.spec import DeploymentSpec


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _print_trtllm(spec: DeploymentSpec, ws) -> None:
    from toolchain.triton.launch import container_commands, launch_command

    repo = ws.model_repo_dir(spec)
    launch = launch_command(spec, repo)
    click.echo(launch.shell())
    mounts = [ws.engine_root(spec), repo, spec.model.tokenizer_dir]
    lines = container_commands(spec, launch, mounts)
    click.echo(f"# in a container:\n{lines['docker']}")
    click.echo(f"# on Kubernetes:\n{lines['kubernetes']}")
    if spec.gpu.hostfile is not None:
        click.echo("# several hosts: run the container on each host of gpu.hostfile with ssh between them")


def _run_until_stopped(server, timeout: float, describe: str) -> None:
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM ends the server like Ctrl-C
    try:
        server.start(timeout=timeout)
        click.echo(f"tritonserver ready in {server.started_s:.1f}s ({describe})")
        click.echo(f"  HTTP     {server.urls['http']}")
        click.echo(f"  gRPC     {server.urls['grpc']}")
        click.echo(f"  metrics  {server.urls['metrics']}")
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


@click.command()
@click.option("--print", "print_only", is_flag=True,
              help="Print the launch command (target trtllm: mpirun, container and Kubernetes lines) and exit.")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="Readiness timeout (default: serving.startup_timeout_s).")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, print_only: bool, timeout: float | None) -> None:
    """Serve model_repo/<name> for SPEC with tritonserver (one per rank under mpirun for
    target trtllm), print the endpoints, and stop cleanly on Ctrl-C or SIGTERM."""
    from toolchain.manifest import is_current
    from toolchain.triton.repo import wanted_manifest

    ws = ctx.workspace
    repo = ws.model_repo_dir(spec)
    if spec.target == "trtllm" and print_only:
        _print_trtllm(spec, ws)
        return
    if not (repo / "manifest.json").is_file():
        raise ToolchainError(f"no model repository at {repo}", "run `toolchain model-repo SPEC` first")
    if not (ws.engine_dir(spec) / "config.json").is_file():
        raise ToolchainError(f"no engine at {ws.engine_dir(spec)}", "run `toolchain build-engine SPEC` first")
    log = repo.parent / f"{spec.name}.tritonserver.log"
    if spec.target == "trtllm":
        from toolchain.triton.launch import TritonLaunch, find_tools

        mpirun, binary = find_tools(spec, repo)
        server = TritonLaunch(spec, repo, log, mpirun, binary)
        describe = f"{spec.parallelism.world_size} rank(s) under {mpirun}, {binary}"
    else:
        from toolchain.triton.server import TritonServer

        server = TritonServer.from_spec(spec, repo, log_path=log)
        if print_only:
            click.echo(server.command_line())
            return
        describe = f"{server.binary.source}: {server.binary.path}"
    if not is_current(repo, wanted_manifest(spec, ws)):
        click.echo("warning: the model repository was rendered from a different spec, engine or tokenizer; "
                   "run `toolchain model-repo SPEC` to refresh it", err=True)
    _run_until_stopped(server, timeout or spec.serving.startup_timeout_s, describe)
