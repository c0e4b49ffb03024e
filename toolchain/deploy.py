"""`deploy`: every stage in order, then serve, bench, and stop the server.

The composition of the stage functions; each stage keeps its own caching, so a
second deploy with nothing changed goes straight to serving.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from toolchain.spec import DeploymentSpec
from toolchain.workspace import Workspace
from toolchain.engine.build import run_build
from toolchain.triton import exposure
from toolchain.triton.launch import TritonLaunch
from toolchain.triton.server import TritonServer
from toolchain.llmapi.launch import openai_engine_args, serve_config_path, served_model_name
from toolchain.llmapi.stage import served_model_dir
from toolchain.openai.server import OpenAIServer
from toolchain.errors import ToolchainError

Progress = Callable[[str, str], None]


@contextmanager
def _timed(name: str, progress: Progress, timings: dict) -> Iterator[None]:
    progress(name, "start")
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 3)
    progress(name, f"done in {timings[name]:.2f}s")


def deploy(spec: DeploymentSpec, workspace: Workspace, out_dir: Path | None = None,
           progress: Progress = lambda stage, msg: None) -> dict:
    """Run convert -> build-engine -> model-repo -> serve -> bench; return the report."""
    from toolchain.bench.run import run_bench
    from toolchain.checkpoint.stage import run_convert
    from toolchain.triton.repo import run_model_repo

    if exposure.restricted(spec.serving):
        exposure.read_admin_key(spec.serving)  # a missing key fails now, not after convert and build
    timings: dict[str, float] = {}
    with _timed("convert", progress, timings):
        run_convert(spec, workspace)
    if spec.llmapi_path:
        return _deploy_llmapi(spec, workspace, out_dir or workspace.report_dir(spec), progress, timings)
    with _timed("build-engine", progress, timings):
        run_build(spec, workspace, converted=True)
    with _timed("model-repo", progress, timings):
        run_model_repo(spec, workspace)
    serving = spec.serving
    server = _triton_server(spec, workspace.model_repo_dir(spec), progress)
    try:  # from the start: a stop signal may arrive the moment start() returns
        with _timed("serve", progress, timings):
            server.start(timeout=serving.startup_timeout_s)
        with _timed("bench", progress, timings):
            # The bench reaches the server it just started, whatever ports were picked.
            url = server.http_url if spec.validation.workload.protocol == "triton-http" else server.grpc_url
            report = run_bench(spec, out_dir=out_dir or workspace.report_dir(spec), url=url,
                               metrics_url=server.metrics_url)
    finally:
        with _timed("stop", progress, timings):
            server.stop()
    report["stage_seconds"] = timings
    return report


def _triton_server(spec: DeploymentSpec, repo: Path, progress: Progress):
    """The server serve would start (admin APIs keyed off loopback, metrics on loopback), with
    serve's one-line warning."""

    server: TritonServer | TritonLaunch
    if spec.rank_processes:  # one tritonserver per rank under mpirun
        server = TritonLaunch.cpu(spec, repo, repo.parent / f"{spec.name}.tritonserver.log")
    else:
        server = TritonServer.from_spec(spec, repo)  # reads the key: a missing one fails before start
    warning = exposure.warning(spec.serving)
    if warning:
        progress("serve", warning)
    return server


def _with_workload(spec: DeploymentSpec, **values) -> DeploymentSpec:
    v = spec.validation
    workload = v.workload.model_copy(update=values)
    return spec.model_copy(update={"validation": v.model_copy(update={"workload": workload})})


def openai_server(spec: DeploymentSpec, workspace: Workspace, log_path: Path):
    """The OpenAI server on the LLM() arguments of the llmapi-cpu deployment (not started)."""

    return OpenAIServer(None, None, served_model_name(spec), spec.serving.host, spec.llmapi.openai_port,
                        model=served_model_dir(spec, workspace), config=serve_config_path(spec, workspace),
                        log_path=log_path, extra_args=openai_engine_args(spec))


def _deploy_llmapi(spec: DeploymentSpec, workspace: Workspace, out_dir: Path, progress: Progress,
                   timings: dict) -> dict:
    """The LLM-API path on this host (target llmapi-cpu): Triton's llmapi model, then the OpenAI
    server on the same LLM() arguments, each benched; the Triton report is the main one and the
    OpenAI server's is written to <out>/openai and summarised under `openai`."""
    from toolchain.bench.run import run_bench
    from toolchain.triton.repo import run_model_repo

    if spec.target != "llmapi-cpu":
        raise ToolchainError("deploy runs the LLM-API path on this host with target llmapi-cpu",
                             "on a GPU host run `toolchain model-repo` and the lines `toolchain serve --print` shows")
    with _timed("model-repo", progress, timings):
        run_model_repo(spec, workspace)
    serving = spec.serving
    repo = workspace.model_repo_dir(spec)
    server = _triton_server(spec, repo, progress)
    try:
        with _timed("serve", progress, timings):
            server.start(timeout=serving.startup_timeout_s)
        with _timed("bench", progress, timings):
            triton_spec = _with_workload(spec, protocol="triton-grpc", endpoint="tensorrt_llm")
            report = run_bench(triton_spec, out_dir=out_dir, url=server.grpc_url, metrics_url=server.metrics_url)
    finally:
        with _timed("stop", progress, timings):
            server.stop()
    name = served_model_name(spec)
    openai = openai_server(spec, workspace, repo.parent / f"{spec.name}.openai.log")
    try:
        with _timed("serve-openai", progress, timings):
            openai.start(timeout=serving.startup_timeout_s)
        with _timed("bench-openai", progress, timings):
            protocol = "openai-chat" if spec.validation.workload.protocol == "openai-chat" else "openai-completions"
            openai_spec = _with_workload(spec, protocol=protocol, endpoint=name)
            second = run_bench(openai_spec, out_dir=out_dir / "openai", url=openai.url, metrics_url="")
    finally:
        with _timed("stop-openai", progress, timings):
            openai.stop()
    report["openai"] = {"protocol": protocol, "report": str(out_dir / "openai" / "report.json"),
                        **{k: second.get(k) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "output_tokens_per_s",
                                                      "num_requests", "errors", "slo")}}
    report["stage_seconds"] = timings
    return report
