"""procgroup.Server, the one server protocol (start, stop, running, ready, urls, logs), and
pipeline.serve_until_stopped, the supervision serve and dynamo share. No server starts here: the servers are
built (as serve builds them) and checked unstarted, and the loop is driven by servers defined here."""

import os
import stat

import pytest

from toolchain import pipeline, procgroup
from toolchain.dynamo.launcher import DynamoDeployment
from toolchain.errors import StageFailed
from toolchain.openai.server import OpenAIServer
from toolchain.spec import DeploymentSpec
from toolchain.targets import TARGETS
from toolchain.triton.launch import TritonLaunch
from toolchain.triton.runtime import resolve_binary
from toolchain.triton.server import TritonServer
from toolchain.workspace import Workspace

ROWS = [(name, launch) for name, row in TARGETS.items() for launch in (row.launches or (None,))]


def _unstarted(server) -> None:
    assert isinstance(server, procgroup.Server)
    assert not server.running and not server.ready and server.started_s is None
    assert server.stop() is None  # safe before start, and again
    assert server.stop() is None


def test_the_rows_cover_every_target():
    assert {name for name, _ in ROWS} == set(TARGETS)
    assert ("cpu", "mpirun") in ROWS and ("cpu", "single") in ROWS


@pytest.mark.parametrize("target, launch", ROWS)
def test_every_target_row_gets_a_server_of_the_protocol(tmp_path, monkeypatch, target, launch):
    # Target trtllm's launch looks for mpirun and tritonserver on this host (triton/launch.py find_tools): an
    # mpirun that is only a file on PATH and the wheel's tritonserver stand in for the Triton image's.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "mpirun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    serving = {"http_port": 18000, "grpc_port": 18001, "metrics_port": 18002}
    if launch is not None:
        serving["launch"] = launch
    if target == "trtllm":
        serving["tritonserver"] = str(resolve_binary(None).path)
    spec = DeploymentSpec(target=target, serving=serving)
    ws = Workspace(tmp_path)
    server = pipeline.server_for(spec, ws, log_path=tmp_path / "s.log")
    assert type(server) is (TritonLaunch if launch == "mpirun" else TritonServer)
    _unstarted(server)
    # What the server computes, unchanged: Triton's three endpoints on the spec's ports.
    assert server.urls == {"http": "http://127.0.0.1:18000", "grpc": "127.0.0.1:18001",
                           "metrics": "http://127.0.0.1:18002/metrics"}
    assert list(server.logs.values()) == [tmp_path / "s.log"]


def test_the_openai_server_and_dynamo_are_servers_of_the_protocol(tmp_path):
    spec = DeploymentSpec(target="llmapi-cpu", llmapi={"openai_port": 18010}, dynamo={"http_port": 18020})
    ws = Workspace(tmp_path)
    openai = pipeline.openai_server(spec, ws, tmp_path / "openai.log")
    assert type(openai) is OpenAIServer
    _unstarted(openai)
    assert openai.urls == {"http": "http://127.0.0.1:18010"} and openai.logs == {"openai": tmp_path / "openai.log"}
    dynamo = DynamoDeployment(spec, ws)
    _unstarted(dynamo)
    assert dynamo.urls == {"http": "http://127.0.0.1:18020"} and dynamo.logs == {}
    # A single tritonserver without a log path picks a temporary one at start: no log yet.
    assert TritonServer(tmp_path).logs == {}


class _Server:
    """A server of the protocol with no process: `down_after` checks it goes down; a check may also raise
    KeyboardInterrupt, as Ctrl-C does in the loop."""

    def __init__(self, name: str, events: list[str]):
        self.name, self.events = name, events
        self.started_s: float | None = None
        self.process_up = False

    def start(self, timeout: float):
        self.events.append(f"start {self.name} {timeout}")
        self.process_up, self.started_s = True, 0.25
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        self.events.append(f"stop {self.name} {timeout}")
        up, self.process_up = self.process_up, False
        return 0 if up else None

    @property
    def running(self) -> bool:
        return self.process_up

    @property
    def ready(self) -> bool:
        return self.process_up

    @property
    def urls(self) -> dict[str, str]:
        return {"http": f"http://127.0.0.1:1/{self.name}"}

    @property
    def logs(self) -> dict:
        return {}


def _watched(server: _Server, fail_on: int, error: BaseException) -> pipeline.Watched:
    checks = []

    def check(echo) -> None:
        checks.append(1)
        if len(checks) == fail_on:
            raise error

    return pipeline.Watched(server, server.name, lambda: [f"{server.name} ready"], check,
                            lambda rc: f"{server.name} stopped ({rc})")


def test_ctrl_c_stops_every_server_the_last_started_first():
    events: list[str] = []
    a, b = _Server("a", events), _Server("b", events)
    assert isinstance(a, procgroup.Server)
    pipeline.serve_until_stopped([_watched(a, 0, StageFailed("-")), _watched(b, 2, KeyboardInterrupt())],
                                 7.0, events.append)
    assert events == ["start a 7.0", "a ready", "start b 7.0", "b ready", "Ctrl-C to stop", "stopping b and a ...",
                      "stop b None", "stop a None", "b stopped (0)", "a stopped (0)"]


def test_a_server_going_down_stops_the_others_and_raises_its_line():
    events: list[str] = []
    a, b = _Server("a", events), _Server("b", events)
    watched = [_watched(a, 1, StageFailed("a went down")), _watched(b, 0, StageFailed("-"))]
    watched[0].stop_timeout = 3.0
    with pytest.raises(StageFailed, match="a went down"):
        pipeline.serve_until_stopped(watched, 5.0, events.append)
    assert events[-2:] == ["stop b None", "stop a 3.0"] and not a.running and not b.running


def test_a_server_that_fails_to_start_stops_those_started_before_it():
    events: list[str] = []
    a, b = _Server("a", events), _Server("b", events)

    def fail(timeout: float):
        raise StageFailed("b did not start")

    b.start = fail  # type: ignore[method-assign]
    with pytest.raises(StageFailed, match="b did not start"):
        pipeline.serve_until_stopped([_watched(a, 0, StageFailed("-")), _watched(b, 0, StageFailed("-"))],
                                     5.0, events.append)
    assert events == ["start a 5.0", "a ready", "stop b None", "stop a None"] and not a.running
