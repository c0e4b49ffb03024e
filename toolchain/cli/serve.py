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

from pathlib import Path

import click

from toolchain import pipeline
from toolchain.cli._common import Context, spec_command
from toolchain.errors import ToolchainError
from toolchain.manifest import is_current
from toolchain.spec import DeploymentSpec
from toolchain.targets import LLMAPI_SERVE, TARGETS, target_of
from toolchain.triton import exposure
from toolchain.triton.server import TritonServer


def _write_manifests(spec: DeploymentSpec, ws, manifests_dir: Path | None) -> None:
    """--manifests DIR: the Slurm and Kubernetes manifests of the spec's path, written atomically."""
    if manifests_dir is None:
        click.echo("# Slurm batch script, Kubernetes Deployment or LeaderWorkerSet with a Service: add --manifests DIR")
        return
    for path in pipeline.write_manifests(spec, ws, manifests_dir):
        click.echo(f"# wrote {path}")


def _describe(spec: DeploymentSpec, server: pipeline.Triton) -> str:
    """What serve's ready line says it started: the binary, and under mpirun how many ranks."""
    if isinstance(server, TritonServer):
        return f"{server.binary.source}: {server.binary.path}"
    if target_of(spec).on_gpu:
        return f"{spec.parallelism.world_size} rank(s) under {server.mpirun}, {server.tritonserver}"
    return f"{spec.parallelism.world_size} CPU rank process(es) under {server.mpirun}, {server.tritonserver}"


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
    row = target_of(spec)
    if manifests_dir is not None and row.gpu_launch is None:
        gpu = [t.name for t in TARGETS.values() if t.gpu_launch is not None]
        raise ToolchainError(f"--manifests is for the GPU targets {' and '.join(gpu)}, not {spec.target}",
                             f"set target: {' or '.join(gpu)}, or drop --manifests")
    warning = exposure.warning(spec.serving)
    if warning and not (row.gpu_launch == LLMAPI_SERVE and (print_only or manifests_dir is not None)):
        click.echo(warning, err=True)
    if row.gpu_launch is not None and (print_only or manifests_dir is not None):
        pipeline.print_gpu_launch(spec, ws, click.echo)
        _write_manifests(spec, ws, manifests_dir)
        return
    if spec.serving.replicas > 1:  # one process group per serve: the replicas' lines say where the others go
        click.echo(f"note: serving.replicas {spec.serving.replicas}: serve starts one replica here (replica 0: the "
                   "spec's ports, the GPUs this process sees); `toolchain serve SPEC --print` prints every replica's "
                   "lines", err=True)
    if row.gpu_launch == LLMAPI_SERVE and pipeline.multi_node(spec):
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
        watched = [pipeline.watch_triton(server, _describe(spec, server), "tensorrt_llm (LLM API)")]
        if target_of(spec).openai_beside_triton:
            watched.append(pipeline.watch_openai(pipeline.openai_server(spec, ws, pipeline.openai_log(spec, ws))))
        pipeline.serve_until_stopped(watched, timeout or spec.serving.startup_timeout_s, click.echo)
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
    watched = [pipeline.watch_triton(server, describe, "ensemble and tensorrt_llm_bls (text), tensorrt_llm (token ids)")]
    pipeline.serve_until_stopped(watched, timeout or spec.serving.startup_timeout_s, click.echo)
