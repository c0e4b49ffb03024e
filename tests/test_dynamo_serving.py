"""Dynamo serving for real on this host: Dynamo 1.6.1's frontend with its KV-aware router in front of two
CPU-engine workers (build/tiny-llama-dynamo.yaml). Completions and chat, streamed and not, equal the CPU engine's
own greedy output; requests sharing a prefix go to the worker whose cache holds it (its KV-block events reached
the router); a worker killed mid-request hands the request to the other worker; after stop no process and no
shared memory of the deployment is left. One deployment for the module (start-up dominates)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import needs_extras, starts_server

pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")

from toolchain.dynamo.install import problem  # noqa: E402
from toolchain.spec import load_spec  # noqa: E402
from toolchain.workspace import Workspace  # noqa: E402

if problem():
    pytest.skip(f"Dynamo cannot run: {problem()}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "build" / "tiny-llama-dynamo.yaml"
PREFIX = " ".join(f"item{i}" for i in range(40))  # > 2 blocks of 32 tokens


@pytest.fixture(scope="module")
@starts_server
@needs_extras
def deployment(tmp_path_factory):
    from toolchain.dynamo.launcher import DynamoDeployment

    spec = load_spec(SPEC, ["dynamo.http_port=0"])
    dep = DynamoDeployment(spec, Workspace(REPO), log_dir=tmp_path_factory.mktemp("dynamo-logs"))
    dep.start(timeout=240)
    pids, tmp = dep.pids(), dep.tmp
    yield dep
    dep.stop()
    # Nothing left behind: processes, the private directory, shared memory named after them.
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert tmp is not None and not tmp.exists()
    leftovers = [f for f in os.listdir("/dev/shm") if any(f"_{pid}_" in f or f"tc{pid}_" in f for pid in pids)]
    assert leftovers == []


@pytest.fixture(scope="module")
def engine(deployment, tmp_path_factory):
    """The CPU engine the workers run, loaded here from the same LLM-API arguments, with its tokenizer."""
    from toolchain.llmapi.cpu_llm import load_engine
    from toolchain.remote_code import auto_tokenizer

    args = {**deployment.engine_args(), "model": str(deployment.spec.model.checkpoint)}
    eng, _, spec = load_engine(args, tmp_path_factory.mktemp("engine"), 1)
    return eng, auto_tokenizer(spec.model.tokenizer_dir)


def post(dep, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(dep.url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def stream(dep, path: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(dep.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def greedy_text(engine, ids: list[int], n: int) -> str:
    from toolchain.engine.cpu import SamplingParams

    eng, tok = engine
    out = eng.generate(ids, SamplingParams(max_new_tokens=n, end_id=tok.eos_token_id))
    return tok.decode(out, skip_special_tokens=True)


def test_two_workers_registered_behind_the_router(deployment):
    assert len(deployment.instances()) == 2
    models = urllib.request.urlopen(deployment.url + "/v1/models", timeout=5).read()
    assert deployment.model_name in models.decode()


def test_completion_is_the_engines_greedy_output(deployment, engine):
    prompt = "def fibonacci(n):"
    body = {"model": deployment.model_name, "prompt": prompt, "max_tokens": 12}
    out = post(deployment, "/v1/completions", body)
    # Dynamo's frontend tokenizes a completion prompt without the BOS token.
    ids = engine[1].encode(prompt, add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["text"] == greedy_text(engine, ids, 12)
    streamed = "".join(c["choices"][0]["text"] for c in stream(deployment, "/v1/completions", body) if c["choices"])
    assert streamed == out["choices"][0]["text"]


def test_chat_streams_the_engines_greedy_output(deployment, engine):
    messages = [{"role": "user", "content": "import numpy as np"}]
    body = {"model": deployment.model_name, "messages": messages, "max_tokens": 10}
    out = post(deployment, "/v1/chat/completions", body)
    text = engine[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = engine[1].encode(text, add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == greedy_text(engine, ids, 10)
    chunks = list(stream(deployment, "/v1/chat/completions", body))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        out["choices"][0]["message"]["content"]


def test_kv_routing_sends_a_shared_prefix_to_the_worker_holding_it(deployment):
    before = [deployment.worker_stats(i) for i in range(2)]
    first = post(deployment, "/v1/completions",
                 {"model": deployment.model_name, "prompt": PREFIX + " first", "max_tokens": 2})
    assert first["usage"]["prompt_tokens"] > 64
    after_first = [deployment.worker_stats(i) for i in range(2)]
    holder = next(i for i in range(2) if after_first[i]["requests"] > before[i]["requests"])
    # Its full blocks reached the router as stored events before the next requests are routed.
    deadline = time.monotonic() + 10
    while deployment.worker_stats(holder)["kv_stored_events"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    for k in range(4):
        out = post(deployment, "/v1/completions",
                   {"model": deployment.model_name, "prompt": PREFIX + f" q{k}", "max_tokens": 2})
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    after = [deployment.worker_stats(i) for i in range(2)]
    assert after[holder]["requests"] - after_first[holder]["requests"] == 4
    assert after[1 - holder]["requests"] == after_first[1 - holder]["requests"]
    assert after[holder]["reused_blocks"] - after_first[holder]["reused_blocks"] >= 4 * 2


def test_a_worker_killed_mid_request_hands_it_to_the_other(deployment):
    """Runs last: it kills a worker. The frontend migrates the stream (dynamo.migration_limit) and it completes."""
    body = {"model": deployment.model_name, "prompt": "hello world", "max_tokens": 200, "ignore_eos": True,
            "min_tokens": 200, "stream_options": {"include_usage": True}}
    before = [deployment.worker_stats(i)["requests"] for i in range(2)]
    text, killed, finish, usage = [], None, None, None
    t0 = time.monotonic()
    for chunk in stream(deployment, "/v1/completions", body, timeout=60):
        if "error" in chunk:
            pytest.fail(f"the request failed instead of failing over: {chunk}")
        usage = chunk.get("usage") or usage
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        if choice.get("text"):
            text.append(choice["text"])
        finish = choice.get("finish_reason") or finish
        if killed is None and len(text) >= 10:
            now = [deployment.worker_stats(i)["requests"] for i in range(2)]
            killed = next(i for i in range(2) if now[i] > before[i])
            deployment.kill_worker(killed)
    assert killed is not None and finish == "length" and time.monotonic() - t0 < 60
    # Every token, some from each worker: counted by the usage chunk, since a streamed chunk's text can hold two
    # tokens or none (the detokenizer holds back a partial character), so the chunks need not number 200.
    assert usage is not None and usage["completion_tokens"] == 200 and len(text) > 10
    assert deployment.dead_workers() == [f"worker{killed}"]
    assert deployment.worker_stats(1 - killed)["requests"] > before[1 - killed]
