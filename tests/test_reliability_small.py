"""Small-scale reliability checks against the embedded default deployment (benchmarks/reliability.py
runs them at scale): hostile requests leave the server answering valid ones correctly, cancelled
streams leave no KV block in use, a killed `toolchain convert` reruns byte-identical, a dead
tensorrt_llm stub makes TritonServer.ready false, and `toolchain serve` ends the requests in flight on
it, exits non-zero in one line and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import starts_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import reliability as R  # noqa: E402


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory):
    spec, ws, server = R.deploy(tmp_path_factory.mktemp("rel"))
    with server:
        yield spec, ws, server


def test_hostile_requests_leave_the_server_serving_correctly(served):
    spec, ws, server = served
    got = R.part_a(server, spec, ws, 200, seed=3)
    assert got["hostile_requests"] >= 200 and got["valid_requests"] >= 20
    assert got["server_crashes"] == 0 and got["model_instance_deaths"] == 0
    assert got["valid_outputs_wrong"] == 0 and got["unanswered_requests"] == 0, got


def test_cancelled_streams_leave_no_block_or_request_in_use(served):
    _, _, server = served
    got = R.part_b(server, 50)
    assert got["kv_used_after"] == 0 and got["active_requests_after"] == 0, got
    assert got["kv_or_slots_leaked"] == 0 and got["threads_leaked"] <= 0 and got["serves_after"], got
    assert "hung" not in got["outcomes"], got


def test_a_killed_convert_reruns_byte_identical(tmp_path):
    got = R.part_d(3, tmp_path, seed=5, stages=("convert",))
    assert got["kills"] == 3 and got["rerun_mismatches"] == 0 and got["partial_outputs_used"] == 0, got
    assert got["leftover_tmp_dirs"] == 0, got  # the reruns swept what the killed runs left


def test_a_stub_killed_while_loading_fails_the_start_fast(tmp_path):
    """tritonserver would wait out the whole start timeout for a model whose stub died; start() fails
    within the grace instead, naming the instance, and leaves nothing behind."""
    spec, ws, server = R.deploy(tmp_path)
    got = R.part_e_load(spec, ws, tmp_path)
    assert got["killed_stub"] and not got["start_hung"], got
    assert "tensorrt_llm_0_0 died during start-up" in got["outcome"] and got["start_s"] < 30, got


def test_a_dead_tensorrt_llm_stub_makes_ready_false(tmp_path):
    spec, ws, server = R.deploy(tmp_path)
    with server:
        assert server.ready and not server.dead_stubs()
        os.kill(server.stub_pids()["tensorrt_llm_0_0"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.ready and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.ready and server.dead_stubs() == ["tensorrt_llm_0_0"]


def test_serve_ends_in_one_line_when_a_model_stub_dies(tmp_path):
    """tritonserver keeps reporting ready with a dead stub; `toolchain serve` must not wait forever."""
    import threading

    from toolchain import pipeline
    from toolchain.errors import StageFailed

    spec, ws, server = R.deploy(tmp_path)

    def kill_when_ready():
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and server.started_s is None:  # start() done, stubs recorded
                time.sleep(0.2)
            os.kill(server.stub_pids()["tensorrt_llm_0_0"], signal.SIGKILL)
        except Exception:
            server.stop()  # the serve loop then ends ("exited unexpectedly") and the test fails, never hangs

    killer = threading.Thread(target=kill_when_ready, daemon=True)
    killer.start()
    with pytest.raises(StageFailed, match="tensorrt_llm_0_0 died") as err:
        pipeline.serve_until_stopped([pipeline.watch_triton(server, "test", "test")], 120, print)  # main thread only: SIGTERM handler
    killer.join(5)
    assert "\n" not in str(err.value) and not server.running


def test_toolchain_serve_ends_requests_in_flight_on_a_dead_stub(tmp_path):
    """The path users run, a `toolchain serve` subprocess: the tensorrt_llm stub killed with streams in
    flight ends every one of them with an error in bounded time; serve exits 1 with one line naming the
    instance and leaves no tritonserver, stub or /dev/shm region of its server behind."""
    R.deploy(tmp_path)
    got = R.part_e_serve(tmp_path, n_inflight=2, bound_s=45)
    assert "failure" not in got and got["streaming_before_kill"] == 2, got
    assert got["hung_requests"] == 0 and got["all_ended_s"] < 45 and got["errors"], got
    assert got["serve_exit_code"] == 1 and got["one_line_naming_instance"], got
    assert not got["serve_stopped_by_benchmark"], got
    assert got["processes_left"] == [] and got["shm_regions_left"] == [], got
