"""The OpenAI-compatible protocols against the in-process mock server (known timing)."""

from __future__ import annotations

import asyncio
import csv
import json
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from toolchain.bench.mock import make_word_tokenizer, openai_app
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

TTFT_MS, STEP_MS = 30, 5


def serve_in_thread(app):
    """Serve an aiohttp `app` in a thread with its own event loop; yields its base URL, then stops it."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def start():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"], box["port"] = runner, site._server.sockets[0].getsockname()[1]
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{box['port']}"
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The mock in a thread with its own event loop; yields (base URL, tokenizer dir, root)."""
    root = tmp_path_factory.mktemp("openai")
    tok = make_word_tokenizer(root / "tok")
    for url in serve_in_thread(openai_app(model="mock", ttft_ms=TTFT_MS, step_ms=STEP_MS, precise=False)):
        yield url, tok, root


def spec(root: Path, tok: Path, name: str, **workload):
    wl = {"num_requests": 8, "warmup_requests": 1, "concurrency": 2, "input_tokens": 16, "output_tokens": 6,
          "endpoint": "mock", "protocol": "openai-chat", **workload}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "model": {"checkpoint": str(tok)}, "validation": {"workload": wl}}))
    return load_spec(path)


def test_chat_stream_role_chunk_is_ttfr_not_ttft_and_usage_counts(server):
    from toolchain.bench.run import run_bench

    url, tok, root = server
    report = run_bench(spec(root, tok, "chat"), url=url, out_dir=root / "chat", plots=False)
    assert report["errors"] == 0 and report["num_requests"] == 8
    assert report["token_count_source"] == "server-total"
    assert report["osl"]["min"] == report["osl"]["max"] == 6 and report["osl_mismatches"] == 0
    assert report["token_count_check"]["mismatches"] == 0  # the tokenizer agrees with usage here
    assert report["ttfr_ms"]["p50"] < TTFT_MS / 2 < report["ttft_ms"]["p50"]  # role-only chunk came first
    assert report["itl_ms"]["n"] == 8 * 5
    assert report["transport"]["protocol"] == "openai-chat"
    assert {"ignore_eos", "min_tokens", "stream_options", "messages"} <= set(report["workload"]["inputs_sent"])


def test_completions_non_streaming_and_cancellation(server):
    from toolchain.bench.run import run_bench

    url, tok, root = server
    r = run_bench(spec(root, tok, "plain", protocol="openai-completions", streaming=False), url=url,
                  out_dir=root / "plain", plots=False)
    assert r["errors"] == 0 and r["ttft_ms"]["p50"] == pytest.approx(r["e2e_ms"]["p50"])
    assert r["tpot_ms"]["n"] == 0  # one response: nothing to time per token
    c = run_bench(spec(root, tok, "cancel", protocol="openai-completions", cancel_fraction=0.5, num_requests=20,
                       output_tokens=10), url=url, out_dir=root / "cancel", plots=False)
    assert c["cancelled"] > 0 and c["errors"] == 0 and c["num_requests"] + c["cancelled"] == 20
    assert c["slo"]["passed"] is True  # cancelling on purpose is not a failure
    rows = list(csv.DictReader((root / "cancel" / "requests.csv").open()))
    cancelled = [r for r in rows if r["cancelled"] == "1"]
    assert len(cancelled) == c["cancelled"] and all(r["ttft_ms"] == "" or r["e2e_ms"] for r in cancelled)


def test_rate_mode_with_classes_and_exporter(server):
    from toolchain.bench.run import run_bench
    from toolchain.triton.server import free_port

    url, tok, root = server
    port = free_port("127.0.0.1")
    scraped = {}

    def on_level(level):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            scraped[level["level"]] = resp.read().decode()

    s = spec(root, tok, "rate", protocol="openai-completions", mode="rate", sweep=[20, 40], num_requests=16,
             classes=[{"name": "fast", "share": 1, "priority": 2}, {"name": "slow", "share": 1, "output_tokens": 3}])
    r = run_bench(s, url=url, out_dir=root / "rate", prometheus_port=port, on_level=on_level, slo_extra=("ttft_p99_ms<=5000",))
    assert [lv["load"]["value"] for lv in r["levels"]] == [20.0, 40.0]
    assert set(r["per_class"]) == {"fast", "slow"} and r["per_class"]["slow"]["osl"]["max"] == 3
    assert r["send_lag_ms"]["n"] == 16 and r["ttft_sched_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert r["sweep"]["max_load_meeting_slo"] == 40.0 and r["slo"]["passed"]
    assert "llm_ttft_seconds_count" in scraped[0] and "llm_tokens_generated_total" in scraped[1]
    assert 'llm_requests_total{cls="fast",level="0",outcome="ok"}' in scraped[0]
    assert all((root / "rate" / p).is_file() for p in r["plots"]) and len(r["plots"]) == 3
    assert json.loads((root / "rate" / "report.json").read_text())["levels"][1]["load"]["mode"] == "rate"


def test_wrong_model_and_no_openai_api(server, tmp_path):
    from toolchain.bench.run import run_bench
    from toolchain.triton.server import free_port

    url, tok, root = server
    with pytest.raises(ToolchainError, match=r"model 'nope' not served .*it serves: mock"):
        run_bench(spec(root, tok, "nope", endpoint="nope"), url=url, out_dir=tmp_path)
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(ToolchainError, match="not reachable at"):
        run_bench(spec(root, tok, "dead"), url=dead, out_dir=tmp_path)


def test_server_dying_mid_run_leaves_a_partial_report(tmp_path):
    import subprocess
    import sys
    import time

    from toolchain.bench.run import run_bench
    from toolchain.triton.server import free_port

    tok = make_word_tokenizer(tmp_path / "tok")
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "toolchain.bench.mock", "openai", "--port", str(port),
                             "--ttft-ms", "5", "--step-ms", "2", "--coarse"])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "mock did not start"
                time.sleep(0.1)
        metrics_port = free_port("127.0.0.1")

        def kill_after_answers(answers: int = 15) -> None:
            # Kill once the bench has counted some answers (its own Prometheus exporter says so), not after a
            # fixed time: on a loaded host the bench's start-up alone can outlast any fixed delay.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).read()
                    ok = sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
                             if line.startswith("llm_requests_total{") and 'outcome="ok"' in line)
                    if ok >= answers:
                        break
                except OSError:
                    pass
                time.sleep(0.05)
            proc.kill()

        threading.Thread(target=kill_after_answers, daemon=True).start()
        s = spec(tmp_path, tok, "dies", protocol="openai-completions", mode="rate", rate=50, duration_s=30,
                 sweep=[50, 60], warmup_requests=0)
        r = run_bench(s, url=f"http://127.0.0.1:{port}", out_dir=tmp_path / "out", plots=False,
                      prometheus_port=metrics_port)
    finally:
        proc.kill()
        proc.wait()
    # The requests in flight when it dies fail first ("closed the connection mid-response"), then new ones are
    # refused: whichever rule sees it first (the streak, or a refused connection) stops the run.
    assert r["complete"] is False and r["stopped"]["level"] == 0, r.get("aborted")
    assert "server stopped responding" in r["aborted"] or "consecutive requests failed" in r["aborted"], r["aborted"]
    assert len(r["levels"]) == 1 and r["num_requests"] > 10  # what it measured before the server died
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["complete"] is False and saved["slo"]["passed"] is False
