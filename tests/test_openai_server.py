"""The OpenAI-compatible server (`python -m toolchain.openai`) over HTTP: a real
uvicorn subprocess serving a CPU engine built from the tiny word-level Llama.
Greedy text equals `CpuEngine.generate`, streams concatenate to the same text,
usage and finish reasons, stop strings, refusals with trtllm-serve's error body,
/metrics iteration stats, Prometheus counters, and cancellation by disconnect."""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import starts_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TPB = 16
LIMITS = {"max_batch_size": 8, "max_input_len": 64, "max_seq_len": 512, "max_num_tokens": 256}
POOL_TOKENS = 2048
MODEL = "tiny-words"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory, hf_llama_words):
    """(engine dir, tokenizer dir without a chat template, copy with one)."""
    from conftest import write_spec
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    root = tmp_path_factory.mktemp("openai")
    spec = load_spec(write_spec(root / "spec.yaml", hf_llama_words, limits=LIMITS, build={"tokens_per_block": TPB}))
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    chat_dir = root / "tokenizer-chat"
    chat_dir.mkdir()
    for f in hf_llama_words.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, chat_dir / f.name)
    cfg = json.loads((chat_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Path(ws.engine_dir(spec)), Path(hf_llama_words), chat_dir


def _server(engine_dir, tokenizer_dir, log_path):
    from toolchain.openai import OpenAIServer

    return OpenAIServer(engine_dir, tokenizer_dir, MODEL, log_path=log_path,
                        extra_args=("--max-tokens-in-paged-kv-cache", str(POOL_TOKENS), "--engine-threads", "1",
                                    "--log-level", "warning"))


@pytest.fixture(scope="module")
@starts_server
def server(built, tmp_path_factory):
    engine_dir, _, chat_dir = built
    with _server(engine_dir, chat_dir, tmp_path_factory.mktemp("log") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(built):
    """generate(prompt ids, max_tokens, **sampling) -> (text, token count, finish_reason) straight from
    CpuEngine.generate, with the end id the server resolves (the tokenizer's </s>, 2)."""
    from transformers import AutoTokenizer

    from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SamplingParams

    engine_dir, tok_dir, _ = built
    engine = CpuEngine.load(engine_dir, kv_cache=KvCacheConfig(max_tokens=POOL_TOKENS))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))

    def generate(ids, n):
        out = engine.generate(list(ids), SamplingParams(max_new_tokens=n, end_id=2, temperature=0.0))
        return tok.decode(out, skip_special_tokens=True), len(out), "length" if len(out) == n else "stop"
    return generate


# -- HTTP helpers ----------------------------------------------------------------------------


def request(server, method, path, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            payload = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        payload, status = err.read(), err.code
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def stream(server, path, body) -> list:
    """The SSE `data:` payloads of one streamed request, [DONE] included as the string."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = []
    for line in resp.read().decode().split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def prom(server) -> dict:
    """Prometheus samples: (name, frozenset(labels)) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = request(server, "GET", "/prometheus/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def iteration_stats(server, completed: int, timeout: float = 10.0) -> list:
    """Drain /metrics until the records hold `completed` finished requests: a step's record is
    written right after the step, so it may trail the response it finished by a moment."""
    records, deadline = [], time.monotonic() + timeout
    while sum(r["numCompletedRequests"] for r in records) < completed and time.monotonic() < deadline:
        status, got = request(server, "GET", "/metrics")
        assert status == 200 and isinstance(got, list)
        records += got
        time.sleep(0.05)
    return records


def completion(prompt, max_tokens, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


PROMPT = "w5 w6 w7 w8"
PROMPT_IDS = [5, 6, 7, 8]  # word-level: `w<i>` is token i, no BOS added


# -- tests ------------------------------------------------------------------------------------


def test_small_endpoints(server):
    assert request(server, "GET", "/health")[0] == 200
    status, body = request(server, "GET", "/health_generate")
    assert status == 200 and "OK" in body
    status, body = request(server, "GET", "/version")
    assert status == 200 and body["version"]
    status, body = request(server, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [(MODEL, "model", "tensorrt_llm")]


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_IDS], ids=["text", "token-ids"])
def test_greedy_completion_matches_the_engine(server, reference, prompt):
    text, n_out, finish = reference(PROMPT_IDS, 12)
    status, body = request(server, "POST", "/v1/completions", completion(prompt, 12))
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == finish
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": n_out, "total_tokens": 4 + n_out}


def test_finish_reason_length_and_stop(server, reference):
    # Whichever the tiny model does at its end id, both reasons are checked against the engine.
    for n in (1, 3, 40):
        text, n_out, finish = reference(PROMPT_IDS, n)
        _, body = request(server, "POST", "/v1/completions", completion(PROMPT, n))
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (text, finish)
        assert body["usage"]["completion_tokens"] == n_out
    _, body = request(server, "POST", "/v1/completions", completion(PROMPT, 3, ignore_eos=True))
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def test_stop_string_ends_the_text_before_it(server, reference):
    text, _, _ = reference(PROMPT_IDS, 12)
    words = text.split()
    stop = " " + words[2]
    expected = text[:text.index(stop)]
    _, body = request(server, "POST", "/v1/completions", completion(PROMPT, 12, stop=[stop, "never-there"]))
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
    events = stream(server, "/v1/completions", completion(PROMPT, 12, stop=stop))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_streaming_concatenates_to_the_non_streamed_text(server, reference):
    text, n_out, finish = reference(PROMPT_IDS, 20)
    events = stream(server, "/v1/completions", completion(PROMPT, 20, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert len(chunks) > 1, "tokens should arrive in several chunks"
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [finish]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == n_out
    assert usage_chunk["usage"]["total_tokens"] == 4 + n_out
    # Without stream_options, no usage chunk.
    plain = stream(server, "/v1/completions", completion(PROMPT, 5))
    assert all("usage" not in e for e in plain[:-1])


def _chat_prompt_ids(built, messages):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built[2]))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_chat_completion_uses_the_chat_template(server, built, reference):
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]
    ids = _chat_prompt_ids(built, messages)
    assert ids == [20, 21, 30, 31, 32, 9]
    text, n_out, finish = reference(ids, 10)
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    status, resp = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, resp
    assert resp["object"] == "chat.completion" and resp["id"].startswith("chatcmpl-")
    choice = resp["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == finish
    assert resp["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

    events = stream(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == finish
    assert events[-2]["usage"]["completion_tokens"] == n_out


def test_chat_without_a_template_is_a_400_naming_the_fix(built, tmp_path):
    engine_dir, plain_dir, _ = built
    with _server(engine_dir, plain_dir, tmp_path / "plain.log") as srv:
        status, body = request(srv, "POST", "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2})
        assert status == 400 and body["object"] == "error" and body["code"] == 400
        assert "no chat template" in body["message"] and "chat_template" in body["message"]
        assert request(srv, "POST", "/v1/completions", completion(PROMPT, 2))[0] == 200


BAD = [
    ("malformed-json", None, b'{"model": "tiny-words", "prompt": ', 400, "JSON"),
    ("unknown-model", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 2}, None, 404, "gpt-4"),
    ("prompt-type", {"model": MODEL, "prompt": 123, "max_tokens": 2}, None, 400, "prompt"),
    ("max-tokens-type", {"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, None, 400, "max_tokens"),
    ("max-tokens-zero", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, None, 400, "max_tokens"),
    ("beyond-max-seq-len", {"model": MODEL, "prompt": PROMPT, "max_tokens": 509}, None, 400, "max_seq_len"),
    ("empty-prompt", {"model": MODEL, "prompt": "", "max_tokens": 2}, None, 400, "empty"),
    ("empty-token-list", {"model": MODEL, "prompt": [], "max_tokens": 2}, None, 400, "empty"),
    ("prompt-too-long", {"model": MODEL, "prompt": " ".join(["w5"] * 65), "max_tokens": 2}, None, 400,
     "max_input_len"),
    ("token-outside-vocab", {"model": MODEL, "prompt": [5, 999], "max_tokens": 2}, None, 400, "vocabulary"),
    ("n-2-greedy", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2, "temperature": 0}, None, 400,
     "multiple returns"),
    ("suffix", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "suffix": "w9"}, None, 400, "suffix"),
    ("logprobs-over-limit", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logprobs": 21}, None, 400,
     "logprobs"),
    ("stream-options-unstreamed", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                   "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("unknown-field", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "best_guess": 1}, None, 400, "best_guess"),
    ("negative-temperature", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": -1}, None, 400,
     "temperature"),
]


@pytest.mark.parametrize("name,body,raw,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_an_error_body_and_the_server_keeps_serving(server, name, body, raw, status, needle):
    got, resp = request(server, "POST", "/v1/completions", body, raw=raw)
    assert got == status, resp
    assert set(resp) == {"object", "message", "type", "param", "code"} and resp["object"] == "error"
    assert resp["code"] == status and resp["type"]
    assert needle.lower() in resp["message"].lower() and "\n" not in resp["message"]
    ok, good = request(server, "POST", "/v1/completions", completion(PROMPT, 2))
    assert ok == 200 and good["usage"]["prompt_tokens"] == 4


def test_unseeded_sampled_requests_differ_and_a_seed_repeats(server):
    """trtllm-serve's PyTorch backend samples an unseeded request from one shared generator, so two such
    requests differ; a request's own seed still makes its text repeat."""
    def sampled(**extra):
        _, body = request(server, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0,
                           "ignore_eos": True, **extra})
        return body["choices"][0]["text"]

    unseeded = [sampled() for _ in range(4)]
    assert len(set(unseeded)) > 1, unseeded
    assert sampled(seed=1234) == sampled(seed=1234)


def test_max_tokens_absent_is_what_max_seq_len_leaves(server):
    """As trtllm-serve's executor deduces it: max_seq_len - prompt tokens (docs/llmapi.md)."""
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    _, resp = request(server, "POST", "/v1/completions", body)
    assert resp["usage"]["completion_tokens"] == LIMITS["max_seq_len"] - len(PROMPT_IDS)
    assert resp["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("extra,needle", [
    ({"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
], ids=["tools", "tool-choice"])
def test_tool_calling_is_refused_not_ignored(server, extra, needle):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, **extra}
    status, resp = request(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and resp["object"] == "error", resp
    assert needle in resp["message"] and "not supported" in resp["message"] and "\n" not in resp["message"]


def test_metrics_are_the_executors_iteration_stats(server):
    request(server, "GET", "/metrics")  # drain what earlier tests left
    fresh = "w200 w201 w202 w203"  # no other test sends it, so none of its blocks is cached
    request(server, "POST", "/v1/completions", completion(fresh, 6, ignore_eos=True))
    stats = iteration_stats(server, 1)
    assert len(stats) == 6  # one context step, five generation steps
    last = stats[-1]
    for key in ("timestamp", "iter", "iterLatencyMS", "numActiveRequests", "numQueuedRequests", "numCompletedRequests",
                "maxNumActiveRequests", "kvCacheStats", "inflightBatchingStats"):
        assert key in last
    kv = last["kvCacheStats"]
    assert kv["maxNumBlocks"] == POOL_TOKENS // TPB and kv["tokensPerBlock"] == TPB
    assert kv["usedNumBlocks"] + kv["freeNumBlocks"] == kv["maxNumBlocks"]
    for key in ("allocTotalBlocks", "allocNewBlocks", "reusedBlocks"):
        assert key in kv
    assert last["maxNumActiveRequests"] == LIMITS["max_batch_size"]
    assert [s["iter"] for s in stats] == sorted(s["iter"] for s in stats)
    assert sum(s["numCompletedRequests"] for s in stats) == 1
    assert stats[0]["inflightBatchingStats"]["numContextRequests"] == 1
    assert stats[0]["inflightBatchingStats"]["numCtxTokens"] == 4
    # A 20-token prompt sent twice: the second finds its first (full) block in the cache.
    long = " ".join(f"w{i}" for i in range(10, 30))
    for _ in range(2):
        request(server, "POST", "/v1/completions", completion(long, 2))
    after = iteration_stats(server, 2)[-1]["kvCacheStats"]
    assert after["reusedBlocks"] >= kv["reusedBlocks"] + 1 and after["allocTotalBlocks"] > kv["allocTotalBlocks"]
    assert request(server, "GET", "/metrics")[1] == []  # drained, as the executor's stats queue is


def test_prometheus_counts_requests_and_tokens(server):
    before = prom(server)
    usages = []
    for n in (3, 5):
        _, body = request(server, "POST", "/v1/completions", completion(PROMPT, n, ignore_eos=True))
        usages.append(body["usage"])
    after = prom(server)
    labels = frozenset({"model_name": MODEL, "engine_type": "cpu", "finished_reason": "length"}.items())
    key = ("trtllm_request_success_total", labels)
    assert after[key] - before.get(key, 0) == 2
    assert total(after, "trtllm_prompt_tokens_total") - total(before, "trtllm_prompt_tokens_total") == 8
    assert total(after, "trtllm_generation_tokens_total") - total(before, "trtllm_generation_tokens_total") == 8
    for name in ("trtllm_e2e_request_latency_seconds_count", "trtllm_time_to_first_token_seconds_count",
                 "trtllm_time_per_output_token_seconds_count", "trtllm_request_queue_time_seconds_count"):
        assert total(after, name) - total(before, name) == 2, name
    for name in ("trtllm_num_requests_running", "trtllm_num_requests_waiting", "trtllm_kv_cache_hit_rate",
                 "trtllm_kv_cache_utilization"):
        assert any(n == name for n, _ in after), name
    assert total(after, "trtllm_num_requests_running") == 0


def test_client_disconnect_cancels_and_frees_the_kv_blocks(server):
    before = prom(server)
    request(server, "GET", "/metrics")
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(completion(PROMPT, 500, ignore_eos=True, stream=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    time.sleep(1.0)
    ran = request(server, "GET", "/metrics")[1]
    # Cancelled, not run to its 500 tokens (and a cancelled request is not a completed one).
    assert 0 < len(ran) < 400 and sum(r["numCompletedRequests"] for r in ran) == 0
    # One short request runs a few steps; the last one's stats show the pool once it finished.
    _, body = request(server, "POST", "/v1/completions", completion(PROMPT, 2, ignore_eos=True))
    assert body["usage"]["completion_tokens"] == 2
    last = iteration_stats(server, 1)[-1]
    assert last["kvCacheStats"]["usedNumBlocks"] == 0
    assert last["numActiveRequests"] == 0 and last["numQueuedRequests"] == 0
    after = prom(server)
    # The cancelled request never completed: only the short one counts.
    assert total(after, "trtllm_request_success_total") - total(before, "trtllm_request_success_total") == 1
    assert total(after, "trtllm_generation_tokens_total") - total(before, "trtllm_generation_tokens_total") == 2
    assert total(after, "trtllm_kv_cache_utilization") == 0


def test_the_readme_curl_examples_answer(server):
    """README's completion and chat bodies, sent as printed (the model renamed to this server's), get choices
    back; streamed ones end with [DONE]."""
    from triton_helpers import readme_curls

    examples = readme_curls(8080)
    assert {path for path, _ in examples} >= {"v1/completions", "v1/chat/completions"}
    for path, body in examples:
        req = urllib.request.Request(f"{server.url}/{path}", data=json.dumps({**body, "model": MODEL}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
        if body.get("stream"):
            assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
        else:
            assert json.loads(raw)["choices"], raw[:300]


def test_the_readme_python_client_example_runs_with_the_venvs_openai(server):
    """Issue 33: README's `openai` client example, run as printed by this interpreter (the venv's, where the
    project's dependencies put the client), against this server (its URL and model name put in)."""
    import re
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "from openai import OpenAI" in b]
    assert "http://localhost:8080/v1" in code and '"tiny-llama-llmapi"' in code
    code = code.replace("http://localhost:8080", server.url).replace('"tiny-llama-llmapi"', f'"{MODEL}"')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    completion, chat = done.stdout.split("\n")[:2]
    assert completion.strip() and chat.strip(), done.stdout
