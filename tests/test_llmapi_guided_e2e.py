"""Guided decoding switched on as upstream requires it on the LLM-API path: a target llmapi-cpu deployment whose spec
sets serving.guided_decoding_backend writes LLM()'s guided_decoding_backend into both argument files, and its OpenAI
server (started from the trtllm-serve config, as deploy starts it) answers a json_schema response_format with text
the schema accepts. On the trained tiny Llama (byte-level BPE, so JSON can be spelled)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml

from conftest import TINY_TRAINED, starts_server
from llmapi_helpers import deploy_llmapi_cpu

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama missing")]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["list", "dict"]}},
          "required": ["ok", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
@starts_server
def api(tmp_path_factory):
    from toolchain.pipeline import openai_server

    root = tmp_path_factory.mktemp("llmapi-guided")
    spec, ws = deploy_llmapi_cpu(root, TINY_TRAINED, name="tiny-guided",
                                 serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0,
                                          "max_tokens_in_paged_kv_cache": 1024, "guided_decoding_backend": "xgrammar"})
    with openai_server(spec, ws, root / "openai.log") as server:
        yield spec, ws, server


def _chat(server, **extra) -> dict:
    body = json.dumps({"model": server.served_model_name, "messages": [{"role": "user", "content": "Which one?"}],
                       "max_tokens": 60, "temperature": 0, **extra}).encode()
    req = urllib.request.Request(f"{server.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_both_llm_argument_files_turn_guided_decoding_on(api):
    from toolchain.llmapi.launch import serve_config_path

    spec, ws, _ = api
    serve = yaml.safe_load(serve_config_path(spec, ws).read_text())
    model_yaml = yaml.safe_load(next(ws.model_repo_dir(spec).rglob("model.yaml")).read_text())
    assert serve["guided_decoding_backend"] == model_yaml["guided_decoding_backend"] == "xgrammar"


def test_the_openai_server_answers_a_json_schema_response_format(api):
    _, _, server = api
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    choice = _chat(server, response_format=fmt)["choices"][0]
    value = json.loads(choice["message"]["content"])
    assert choice["finish_reason"] == "stop" and set(value) == {"ok", "kind"}
    assert isinstance(value["ok"], bool) and value["kind"] in ("list", "dict")
