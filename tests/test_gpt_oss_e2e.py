"""A tiny gpt-oss deployed on target llmapi-cpu (issue 36, item 7): `convert` prepares the CPU stand-in's engine at
tp 2 with moe_ep 2, and the OpenAI server started from the deployment's LLM() arguments and Triton's llmapi model
(the tritonserver of the nvidia-pytriton wheel) answer transformers' greedy tokens."""

from __future__ import annotations

import json
import urllib.request

import pytest

from llmapi_helpers import SERVING, deploy_llmapi_cpu
from test_engine_cpu_util import hf_greedy
from test_gpt_oss import _reference, make_gpt_oss

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [5, 9, 33, 200, 7, 8, 100, 3, 44, 12]  # 10 words: past layer 0's 4-token window
NEW = 8
# tp 2 with expert parallelism 2, a KV pool of 2048 tokens (tests/llmapi_helpers.py serves it)
DEPLOYMENT = {"parallelism": {"tp": 2, "moe_ep": 2},
              "serving": {**SERVING, "max_tokens_in_paged_kv_cache": 2048},
              "limits": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256}}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(spec, workspace, HF checkpoint): the tiny model with the swiglu constants TensorRT-LLM's gpt-oss hard-codes
    (alpha 1.702, limit 7.0; others are refused on the LLM-API path) and a word-level tokenizer."""
    from triton_helpers import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("gpt-oss-e2e")
    hf = make_gpt_oss(root / "hf", seed=23, swiglu_limit=7.0)
    make_tiny_tokenizer(hf)
    # Triton's llmapi model and the LLM() arguments (trtllm-serve.yaml)
    spec, ws = deploy_llmapi_cpu(root, hf, name="tiny-gpt-oss", **DEPLOYMENT)
    return spec, ws, hf


def _words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


@pytest.fixture(scope="module")
def expected(deployed):
    from transformers import AutoTokenizer

    _, _, hf = deployed
    prompt = AutoTokenizer.from_pretrained(hf)(_words(PROMPT))["input_ids"]
    assert prompt[-len(PROMPT):] == PROMPT
    greedy = hf_greedy(_reference(hf), prompt, NEW)
    assert min(greedy) >= 3, "a special token in the greedy output; pick another seed"
    return greedy


def test_the_openai_server_answers_transformers_greedy_tokens(deployed, expected):
    from toolchain.pipeline import openai_server

    spec, ws, _ = deployed
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        body = json.dumps({"model": api.served_model_name, "prompt": _words(PROMPT), "max_tokens": NEW,
                           "top_k": 1}).encode()
        req = urllib.request.Request(f"{api.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
    assert answer["choices"][0]["text"].strip() == _words(expected)


def test_tritons_llmapi_model_answers_transformers_greedy_tokens(deployed, expected):
    from llmapi_helpers import greedy_text

    from toolchain.pipeline import server_for

    spec, ws, _ = deployed
    with server_for(spec, ws, log_path=ws.root / "server.log") as server:
        assert greedy_text(server.grpc_url, _words(PROMPT), NEW).strip() == _words(expected)
