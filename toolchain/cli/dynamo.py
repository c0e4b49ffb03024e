"""`toolchain dynamo SPEC`: serve the LLM-API path behind NVIDIA Dynamo's frontend and router (docs/dynamo.md).

Target llmapi-cpu: starts the frontend and dynamo.workers CPU-engine workers on this host and serves until Ctrl-C
or SIGTERM (a worker that dies is reported and its requests fail over to the others); `--print` shows the commands.
Target llmapi: prints the frontend and `python3 -m dynamo.trtllm` command lines of a GPU host; `--manifests DIR`
writes the DynamoGraphDeployment and its ConfigMap.
"""

from __future__ import annotations

from pathlib import Path

import click

from toolchain import pipeline
from toolchain.cli._common import Context, spec_command
from toolchain.errors import StageFailed, ToolchainError
from toolchain.spec import DeploymentSpec
from toolchain.dynamo import render
from toolchain.dynamo.checks import check
from toolchain.dynamo.launcher import DynamoDeployment
from toolchain.dynamo.manifests import write_manifests
from toolchain.dynamo.launcher import DIR_VAR

ROUTERS = ("kv", "round-robin", "random", "least-loaded")


def _print_gpu(spec: DeploymentSpec, ws, manifests_dir: Path | None) -> None:
    click.echo(f"# NVIDIA Dynamo on one GPU host ({render.gpus_needed(spec)} GPUs; file discovery, no etcd/NATS).")
    click.echo(f"# The workers read {ws.model_repo_dir(spec) / 'trtllm-serve.yaml'} (`toolchain model-repo SPEC`).")
    note = render.version_note()
    if note:
        click.echo(f"# Note: {note}.")
    for line in render.gpu_commands(spec, ws):
        click.echo(line)
    if manifests_dir is not None:

        for path in write_manifests(spec, ws, manifests_dir):
            click.echo(f"# wrote {path}")
    else:
        click.echo("# Kubernetes (the Dynamo operator's DynamoGraphDeployment): add --manifests DIR")


def _watch(deployment: DynamoDeployment) -> pipeline.Watched:
    """The deployment as serve_until_stopped watches it: a worker that exits is reported (the router sends its
    requests to the others); down when every worker or the frontend has exited."""
    reported: set[str] = set()

    def ready_lines() -> list[str]:
        return [f"Dynamo ready in {deployment.started_s:.1f}s: frontend (router {deployment.router}) + "
                f"{deployment.workers} CPU-engine worker(s)",
                f"  OpenAI   {deployment.url}/v1 (model {deployment.model_name})",
                *(f"  log      {name}: {log}" for name, log in deployment.logs.items())]

    def check(echo) -> None:
        if not deployment.running:
            raise StageFailed("the Dynamo frontend exited unexpectedly", f"log: {deployment.logs.get('frontend')}")
        dead = [w for w in deployment.dead_workers() if w not in reported]
        if dead:
            reported.update(dead)
            click.echo(f"warning: {', '.join(dead)} exited; the router sends requests to the other worker(s)",
                       err=True)
        if len(reported) == deployment.workers:
            raise StageFailed("every Dynamo worker has exited", "restart `toolchain dynamo`; logs above")

    return pipeline.Watched(deployment, "Dynamo", ready_lines, check, lambda rc: "Dynamo stopped")


@click.command()
@click.option("--workers", type=click.IntRange(1, 64), default=None, help="Workers behind the router (default: dynamo.workers).")
@click.option("--router", type=click.Choice(ROUTERS), default=None, help="The frontend's --router-mode (default: dynamo.router).")
@click.option("--print", "print_only", is_flag=True, help="Print the commands and exit.")
@click.option("--manifests", "manifests_dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Target llmapi: write the DynamoGraphDeployment and its ConfigMap to DIR (implies --print).")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="Readiness timeout (default: dynamo.startup_timeout_s).")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, workers: int | None, router: str | None, print_only: bool,
            manifests_dir: Path | None, timeout: float | None) -> None:
    """Serve SPEC's LLM-API path behind NVIDIA Dynamo: frontend + KV-aware router + engine workers."""

    if workers is not None:
        spec.dynamo.workers = workers
    if router is not None:
        spec.dynamo.router = router  # type: ignore[assignment]  # click.Choice holds it to ROUTERS
    check(spec)
    ws = ctx.workspace
    if manifests_dir is not None and spec.target != "llmapi":
        raise ToolchainError(f"--manifests is for target llmapi, not {spec.target}", "set target: llmapi, or drop --manifests")
    if spec.target == "llmapi":
        _print_gpu(spec, ws, manifests_dir)
        return

    deployment = DynamoDeployment(spec, ws, log_dir=ws.report_dir(spec) / "dynamo")
    if print_only:

        click.echo(f"# Dynamo on this host as `toolchain dynamo` starts it ({deployment.workers} worker(s), router "
                   f"{deployment.router}); paste into bash. Ports are free now; stop with: "
                   f'kill %1 ... %{deployment.workers + 1}; rm -rf "${DIR_VAR}"')
        for line in deployment.shell_lines():
            click.echo(line)
        return
    pipeline.serve_until_stopped([_watch(deployment)], timeout or spec.dynamo.startup_timeout_s, click.echo)
