"""`make perf`: the spec's SLOs asserted against a live deployment.

    pytest -m perf tests/perf                                # stage and serve the spec's deployment itself
    pytest -m perf tests/perf --server 127.0.0.1:8001        # bench a running server (gRPC host:port)
    pytest -m perf tests/perf --spec build/llama31-8b.yaml --set validation.workload.concurrency=16

The report lands in reports/<name>-perf/ (report.json, requests.csv, plots).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    group = parser.getgroup("perf", "live-deployment SLO checks (make perf)")
    group.addoption("--server", default=None, metavar="HOST:PORT",
                    help="Triton gRPC endpoint of a running deployment (default: start the spec's own)")
    group.addoption("--spec", default=str(REPO / "build" / "tiny-llama.yaml"), help="deployment spec")
    group.addoption("--set", dest="perf_overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="spec override, as for the toolchain CLI (repeatable)")
    group.addoption("--metrics-url", default=None, help="the server's Prometheus endpoint (cross-check)")


def _opt(config, name, default=None):
    try:
        return config.getoption(name)
    except ValueError:  # this conftest was not an initial one: its options are not registered
        return default


@pytest.fixture(scope="session")
def perf_spec(pytestconfig):
    from toolchain.spec import load_spec

    return load_spec(_opt(pytestconfig, "--spec", str(REPO / "build" / "tiny-llama.yaml")),
                     _opt(pytestconfig, "perf_overrides", []) or [])


@pytest.fixture(scope="session")
def deployment(pytestconfig, perf_spec, tmp_path_factory):
    """{'grpc': host:port, 'metrics': url or None}: the given server, or the spec's deployment started here."""
    server = _opt(pytestconfig, "--server")
    if server:
        yield {"grpc": server, "metrics": _opt(pytestconfig, "--metrics-url")}
        return
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.stopsignals import stop_on_signals
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer
    from toolchain.workspace import Workspace

    ws = Workspace(tmp_path_factory.mktemp("perf-ws"))
    run_convert(perf_spec, ws)
    run_build(perf_spec, ws)
    run_model_repo(perf_spec, ws)
    s = perf_spec.serving
    # pytest dies on SIGTERM and SIGHUP without tearing fixtures down: the server would outlive the run. Under
    # the guard every stop signal interrupts the session like Ctrl-C, and the teardown stops the server.
    with stop_on_signals(), TritonServer(ws.model_repo_dir(perf_spec), s.host, 0, 0, 0, s.tritonserver,
                                         log_path=ws.report_dir(perf_spec) / "tritonserver.log") as srv:
        yield {"grpc": srv.grpc_url, "metrics": srv.metrics_url}
