"""A bench that meets a hung endpoint says so in seconds: the request deadline derived from the workload and
the SLOs, and the stop after a streak of failed requests, against real endpoints that never answer (a stdlib
HTTP server speaking just enough OpenAI, and tritonserver with a Python model whose execute() never returns)."""

from __future__ import annotations

import json
import select
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import TINY_TRAINED
from toolchain.bench.failfast import (FALLBACK_TIMEOUT_S, derived_timeout, failure_limit, longest_output,
                                      request_deadline)
from toolchain.bench.mock import make_word_tokenizer
from toolchain.bench.run import slo_thresholds
from toolchain.cli import main as cli_main
from toolchain.spec import spec_from_dict


# ---- the derived deadline and the stop rule ------------------------------------------------------------------

def _spec(workload=None, slo=None):
    return spec_from_dict({"validation": {"workload": workload or {}, "slo": slo or {}}}, base=Path("."))


def _deadline(workload=None, slo=None, extra=(), override=None):
    spec = _spec(workload, slo)
    wl = spec.validation.workload
    osl = longest_output(wl, None, spec.limits.max_seq_len)
    return request_deadline(wl, slo_thresholds(spec, tuple(extra)), osl, override)


def test_the_deadline_comes_from_the_slos_with_a_floor():
    # 5 x (2000 ms + 512 x 60 ms) = 163.6 s: a long output under production SLOs gets a long deadline.
    d = _deadline({"output_tokens": 512}, {"ttft_p99_ms": 2000, "tpot_p99_ms": 60})
    assert d.seconds == pytest.approx(163.6) and d.source.startswith("derived")
    assert "ttft 2000 ms + 512 x tpot 60 ms" in d.source
    # A short one under tight SLOs gets the floor, not 5 x 0.18 s.
    assert _deadline({"output_tokens": 8}, {"ttft_p99_ms": 100, "tpot_p99_ms": 10}).seconds == 30.0
    # An e2e bound alone is a whole-request bound; with both, the tighter one.
    assert _deadline({"output_tokens": 32}, {"e2e_p99_ms": 8000}).seconds == 40.0
    assert _deadline({"output_tokens": 512}, {"ttft_p99_ms": 2000, "tpot_p99_ms": 60, "e2e_p99_ms": 10000}
                     ).seconds == 50.0
    # An ITL bound bounds each token too, and `--slo` strings count like the spec's fields.
    assert _deadline({"output_tokens": 100}, {"ttft_p99_ms": 1000}, extra=("itl p99 <= 100 ms",)).seconds == 55.0


def test_the_deadline_without_slos_or_set_explicitly():
    assert _deadline().seconds == FALLBACK_TIMEOUT_S  # nothing says how long a request may take
    assert _deadline(slo={"ttft_p99_ms": 500}).seconds == FALLBACK_TIMEOUT_S  # the decode is unbounded
    d = _deadline({"request_timeout_s": 12}, {"ttft_p99_ms": 100, "tpot_p99_ms": 10})
    assert (d.seconds, d.source) == (12, "validation.workload.request_timeout_s")
    assert _deadline({"request_timeout_s": 12}, override=3.5).seconds == 3.5


def test_the_longest_output_counts_classes_files_and_spread():
    spec = _spec({"output_tokens": 32, "output_tokens_stddev": 4,
                  "classes": [{"name": "a", "output_tokens": 64}, {"name": "b"}]})
    wl = spec.validation.workload
    assert longest_output(wl, None, 4096) == 64 + 12
    assert longest_output(wl, [{"turns": ["x"], "output_tokens": 300}], 4096) == 300 + 12
    assert longest_output(wl, None, 50) == 49  # never past what the engine holds
    assert derived_timeout([], 10).seconds == FALLBACK_TIMEOUT_S


def test_the_streak_limit_follows_the_concurrency():
    assert failure_limit(_spec({"concurrency": 8}).validation.workload, 8) == 8
    assert failure_limit(_spec({"concurrency": 1}).validation.workload, 1) == 3
    assert failure_limit(_spec({"mode": "rate"}).validation.workload, 50.0) == 3
    assert failure_limit(_spec({"max_consecutive_failures": 5}).validation.workload, 16) == 5


# ---- an OpenAI endpoint that never answers -------------------------------------------------------------------

class _Hung(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "hung", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        with server.lock:
            server.posted += 1
        if server.send_headers:  # the answer starts, then stalls
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
        # Never answer; wait for the client to hang up, which is how it cancels.
        while not server.closing:
            if select.select([self.connection], [], [], 0.1)[0]:
                if not self.connection.recv(1):
                    with server.lock:
                        server.hung_up += 1
                    break
        self.close_connection = True


@pytest.fixture(params=["silent", "headers-then-nothing"])
def hung_openai(request):
    """(base URL, server) of an OpenAI endpoint that lists model 'hung' and never answers a completion."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hung)
    server.daemon_threads = True
    server.lock, server.posted, server.hung_up, server.closing = threading.Lock(), 0, 0, False
    server.send_headers = request.param == "headers-then-nothing"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.closing = True
    server.shutdown()
    server.server_close()


def _bench_spec(root: Path, url: str, slo=None, **workload) -> Path:
    tok = make_word_tokenizer(root / "tok")
    wl = {"protocol": "openai-completions", "endpoint": "hung", "url": url, "num_requests": 8,
          "warmup_requests": 1, "concurrency": 2, "input_tokens": 16, "output_tokens": 8, **workload}
    path = root / "hung.yaml"
    path.write_text(yaml.safe_dump({"name": "hung", "model": {"checkpoint": str(tok)},
                                    "validation": {"workload": wl, "slo": slo or {}}}))
    return path


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _wait_for(cond, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_a_hung_openai_endpoint_stops_the_bench_with_one_line(hung_openai, tmp_path, capsys):
    url, server = hung_openai
    spec = _bench_spec(tmp_path, url, request_timeout_s=2, warmup_requests=0)
    out = tmp_path / "out"
    rc = cli_main(["bench", str(spec), "--out", str(out), "--no-plots"])
    errors = _errors(capsys.readouterr().err)

    assert rc == 1
    # The level's first two timed out together, then the one sent after them: three in a row at concurrency 2.
    assert len(errors) == 1 and errors[0].startswith(
        f"error: bench stopped at level 0: 3 consecutive requests timed out after 2 s, model 'hung' at {url}; "
        "last response seen: ")
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is False and report["slo"]["passed"] is False
    stopped = report["stopped"]
    assert stopped["url"] == url and stopped["model"] == "hung" and stopped["level"] == 0
    assert stopped["reason"] == "3 consecutive requests timed out after 2 s" and len(stopped["failed_requests"]) == 3
    assert report["workload"]["request_timeout_s"] == 2
    assert report["workload"]["request_timeout_from"] == "validation.workload.request_timeout_s"
    last = stopped["last_response"]
    if server.send_headers:
        assert last["status"] == "HTTP 200" and last["responses"] == 0
        assert "HTTP 200, nothing streamed for request" in errors[0]
    else:
        assert last is None and errors[0].endswith("last response seen: none, no request got any answer "
                                                   f"(partial report in {out})")
    # The level sent no more than its concurrency after the stop began, and every request it sent was
    # cancelled: the server saw each connection closed.
    assert server.posted <= 4
    assert _wait_for(lambda: server.hung_up == server.posted), (server.hung_up, server.posted)


@pytest.mark.slow
def test_the_derived_deadline_stops_a_hung_endpoint_within_a_minute(hung_openai, tmp_path, capsys):
    """No request_timeout_s: the SLOs give 5 x (100 ms + 8 x 10 ms), so the 30 s floor. Both warm-up requests
    time out together and the run stops there, after one deadline: no level waits out another."""
    url, server = hung_openai
    if server.send_headers:
        pytest.skip("one variant is enough for the 30 s wait")
    spec = _bench_spec(tmp_path, url, slo={"ttft_p99_ms": 100, "tpot_p99_ms": 10}, warmup_requests=2,
                       concurrency=4, num_requests=16)
    out = tmp_path / "out"
    assert cli_main(["bench", str(spec), "--out", str(out), "--no-plots"]) == 1
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "stopped at the warm-up: all 2 warm-up requests timed out after 30 s" in errors[0], errors
    report = json.loads((out / "report.json").read_text())
    assert report["workload"]["request_timeout_s"] == 30.0
    assert report["workload"]["request_timeout_from"].startswith("derived: max(30 s, 5 x (ttft 100 ms + 8 x tpot")
    assert report["stopped"]["level"] == "warmup" and report["complete"] is False
    assert server.posted == 2  # nothing sent after the warm-up


# ---- tritonserver with a model whose execute() never returns -------------------------------------------------

HUNG_CONFIG = """\
name: "hung"
backend: "python"
max_batch_size: 0
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

HUNG_MODEL = textwrap.dedent("""\
    import time


    class TritonPythonModel:
        def execute(self, requests):
            while True:  # a generation loop that never finishes
                time.sleep(1)
""")


@pytest.mark.e2e
def test_a_hung_triton_model_stops_the_bench_and_the_server_still_stops(tmp_path, capsys):
    from test_triton_server import _group_alive
    from toolchain.triton.server import TritonServer

    repo = tmp_path / "repo"
    (repo / "hung" / "1").mkdir(parents=True)
    (repo / "hung" / "config.pbtxt").write_text(HUNG_CONFIG)
    (repo / "hung" / "1" / "model.py").write_text(HUNG_MODEL)
    server = TritonServer(repo, log_path=tmp_path / "server.log", exit_timeout_s=3)
    with server:
        spec = _bench_spec(tmp_path, server.grpc_url, protocol="triton-grpc", streaming=False, warmup_requests=0,
                           concurrency=3, request_timeout_s=2)
        out = tmp_path / "out"
        rc = cli_main(["bench", str(spec), "--out", str(out), "--no-plots", "--metrics-url", server.metrics_url])
        errors = _errors(capsys.readouterr().err)
        pgid = server.process.pid
    assert rc == 1
    assert len(errors) == 1 and errors[0].startswith(
        f"error: bench stopped at level 0: 3 consecutive requests timed out after 2 s, model 'hung' at "
        f"{server.grpc_url}; last response seen: none")
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is False and report["stopped"]["reason"].startswith("3 consecutive requests timed out")
    assert not server.running and not _group_alive(pgid)  # the stub stuck in execute() went down with it


# ---- deploy: the same line, and nothing left running ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.server
@pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="embedded model missing")
def test_deploy_ends_on_the_stop_line_with_nothing_left_running(tmp_path):
    """Every request of the embedded model's deploy misses a 1 ms deadline: the bench stops on the streak,
    deploy stops tritonserver and exits with the bench's line; no process it started outlives it."""
    import os
    import subprocess
    import sys
    import uuid

    from test_stop_signals import CLI, MARKER, REPO, _marked

    marker = uuid.uuid4().hex
    argv = [sys.executable, "-c", CLI, "--root", str(tmp_path / "root"), "deploy", str(REPO / "build" / "tiny-llama.yaml")]
    for item in ("serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
                 "validation.workload.request_timeout_s=0.001"):
        argv += ["--set", item]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(REPO), MARKER: marker})
    assert run.returncode == 1, run.stdout + run.stderr
    errors = _errors(run.stderr)
    # Neither warm-up request answered: the run stops there, no level is sent.
    assert len(errors) == 1 and errors[0].startswith(
        "error: bench stopped at the warm-up: all 2 warm-up requests timed out after 0.001 s, model 'ensemble' at "
        "127.0.0.1:"), run.stderr
    assert not _marked(marker), "a process deploy started outlived it"
    report = json.loads((tmp_path / "root" / "reports" / "tiny-llama" / "report.json").read_text())
    assert report["complete"] is False and report["stopped"]["level"] == "warmup"
    assert {"bench", "stop"} <= set(report["stage_seconds"])  # the server was stopped before deploy ended
