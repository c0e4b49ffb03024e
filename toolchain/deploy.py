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
    from toolchain.engine.build import run_build
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer

    timings: dict[str, float] = {}
    with _timed("convert", progress, timings):
        run_convert(spec, workspace)
    with _timed("build-engine", progress, timings):
        run_build(spec, workspace, converted=True)
    with _timed("model-repo", progress, timings):
        run_model_repo(spec, workspace)
    serving = spec.serving
    with _timed("serve", progress, timings):
        server = TritonServer(workspace.model_repo_dir(spec), host=serving.host, http_port=serving.http_port,
                              grpc_port=serving.grpc_port, metrics_port=serving.metrics_port,
                              binary=serving.tritonserver)
        server.start(timeout=serving.startup_timeout_s)
    try:
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
