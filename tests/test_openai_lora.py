"""The OpenAI server serving LoRA adapters on the LLM-API path: the app `python -m toolchain.openai MODEL --config
FILE --lora-adapter NAME=DIR` builds, run in this process by uvicorn on a free port. An adapter is picked by `model`
(this server's extension, as vLLM and Dynamo pick one) or by trtllm-serve's `lora_request` body field; each answer
is PEFT's merged model's greedy answer; /v1/models lists the adapters under the base; unknown names are 404."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from conftest import write_spec
from test_llmapi_lora import NEW_TOKENS, PROMPTS, adapters, lora_spec  # noqa: F401 (adapters: a fixture)

pytestmark = [pytest.mark.slow]

BASE = "tiny-base"


@pytest.fixture(scope="module")
def server(adapters, hf_llama_words, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """The server's URL, for a llmapi-cpu spec serving adapters "attn" and "every", launched as the deployment
    launches it (its trtllm-serve YAML and its OpenAI engine flags)."""
    import uvicorn

    from toolchain.llmapi.args import serve_config
    from toolchain.llmapi.launch import openai_engine_args
    from toolchain.netutil import free_port
    from toolchain.openai.__main__ import _args, build_app

    root = tmp_path_factory.mktemp("openai-lora")
    spec = lora_spec(root, hf_llama_words, adapters)
    config = root / "trtllm-serve.yaml"
    config.write_text(yaml.safe_dump(serve_config(spec)))
    (root / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    argv = [str(hf_llama_words), "--config", str(config), "--served-model-name", BASE,
            "--chat-template", str(root / "template.jinja"), *openai_engine_args(spec)]
    assert argv.count("--lora-adapter") == 2
    app = build_app(_args(argv))
    port = free_port("127.0.0.1")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(30)
    if app.state.work_dir is not None:
        app.state.work_dir.cleanup()


def call(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            payload, status = resp.read().decode(), resp.status
    except urllib.error.HTTPError as err:
        payload, status = err.read().decode(), err.code
    if body is not None and body.get("stream") and status == 200:
        chunks = [json.loads(line[6:]) for line in payload.splitlines() if line.startswith("data: {")]
        return status, chunks
    return status, json.loads(payload)


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def completion(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
            **extra}


def test_models_lists_the_base_then_each_adapter_with_its_parent(server):
    status, body = call(server, "/v1/models")
    assert status == 200
    assert [(m["id"], m.get("parent")) for m in body["data"]] == [(BASE, None), ("attn", BASE), ("every", BASE)]


def test_model_selects_the_adapter_in_completions_and_chat_streamed_or_not(server, adapters):  # noqa: F811
    for i, name in enumerate(("attn", "every", BASE)):
        key = None if name == BASE else name
        status, body = call(server, "/v1/completions", completion(name, PROMPTS[i]))
        assert status == 200, body
        assert body["choices"][0]["text"] == words(adapters[key][1][i]) and body["model"] == name
        status, chunks = call(server, "/v1/completions", completion(name, PROMPTS[i], stream=True))
        assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
            words(adapters[key][1][i])
    # Chat: the template joins the messages, so the prompt is PROMPTS[1] again (no special tokens added).
    chat = {"model": "every", "messages": [{"role": "user", "content": words(PROMPTS[1])}],
            "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, body = call(server, "/v1/chat/completions", chat)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == words(adapters["every"][1][1])
    status, chunks = call(server, "/v1/chat/completions", {**chat, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        words(adapters["every"][1][1])
    assert adapters["every"][1][1] != adapters[None][1][1]  # the adapter changes the answer: the test can fail


def test_trtllm_serves_lora_request_field_selects_an_adapter_by_path(server, adapters):  # noqa: F811
    lora = {"lora_name": "mine", "lora_int_id": 2, "lora_path": str(adapters["every"][0])}
    status, body = call(server, "/v1/completions", completion(BASE, PROMPTS[0], lora_request=lora))
    assert status == 200, body
    assert body["choices"][0]["text"] == words(adapters["every"][1][0])
    lora = {"lora_name": "attn-again", "lora_int_id": 7, "lora_path": str(adapters["attn"][0])}
    status, body = call(server, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": words(PROMPTS[2])}], "max_tokens": NEW_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "lora_request": lora})
    assert status == 200 and body["choices"][0]["message"]["content"] == words(adapters["attn"][1][2])


@pytest.mark.parametrize("body, status, fragment", [
    (completion("nope", [5, 6]), 404, "The model `nope` does not exist."),
    (completion(BASE, [5, 6], lora_request={"lora_name": "x", "lora_int_id": 3, "lora_path": "/nope"}), 400,
     "lora_path (/nope) does not exist."),
    (completion(BASE, [5, 6], lora_request={"lora_name": "x", "lora_path": "/tmp"}), 400, "lora_int_id"),
])
def test_bad_adapter_requests_get_one_line_errors(server, body, status, fragment):
    got, answer = call(server, "/v1/completions", body)
    assert got == status and fragment in answer["message"] and "\n" not in answer["message"]


def test_the_launch_line_names_each_adapter_in_spec_order(tmp_path, hf_llama_words, adapters):  # noqa: F811
    from toolchain.llmapi.launch import openai_cpu_command
    from toolchain.workspace import Workspace

    spec = lora_spec(tmp_path, hf_llama_words, adapters)
    line = openai_cpu_command(spec, Workspace(tmp_path))
    flags = [line[i + 1] for i, arg in enumerate(line) if arg == "--lora-adapter"]
    assert flags == [f"attn={adapters['attn'][0].resolve()}", f"every={adapters['every'][0].resolve()}"]


def test_a_bad_lora_adapter_flag_is_one_line(hf_llama_words, tmp_path):
    from toolchain.errors import ToolchainError
    from toolchain.openai.__main__ import _adapters, _args

    spec_path = write_spec(tmp_path / "s.yaml", hf_llama_words)
    with pytest.raises(ToolchainError, match="must be NAME=DIR"):
        _adapters(_args([str(hf_llama_words), "--served-model-name", "m", "--lora-adapter", str(spec_path)]))
