"""A tiny Llama 4 on target llmapi-cpu served through the OpenAI server and Triton's llmapi model: convert prepares
the CPU stand-in for LLM() (tp 2, expert parallelism 2), and both servers started from the same LLM() arguments
answer greedy completions equal to transformers' (issue 36 item 7)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from conftest import make_hf_model, write_spec
from test_engine_cpu_util import hf_greedy
from test_parity_families import LLAMA4
from triton_helpers import make_tiny_tokenizer

from toolchain.spec import load_spec
from toolchain.workspace import Workspace

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 8
# 11 words: three 4-token chunks of the rope layers, positions where the NoPE layer's query scale has grown
PROMPTS = ["w60 w61 w62 w63 w64 w65 w66 w67 w68 w69 w70", "w200 w7 w7 w9 w31 w100"]


def test_openai_server_greedy_equals_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmapi_helpers import greedy_text

    from toolchain.pipeline import convert_for, model_repo_for, openai_server, server_for

    hf = make_hf_model("Llama4ForCausalLM", tmp_path / "hf", **LLAMA4)
    make_tiny_tokenizer(hf)
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf, target="llmapi-cpu", parallelism={"tp": 2, "moe_ep": 2},
                                limits={"max_batch_size": 2, "max_input_len": 32, "max_seq_len": 64,
                                        "max_num_tokens": 128},
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0,
                                         "max_tokens_in_paged_kv_cache": 512},
                                llmapi={"openai_port": 0}))
    ws = Workspace(tmp_path / "ws")
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    wants = {}
    for prompt in PROMPTS:
        want = hf_greedy(reference, tokenizer(prompt)["input_ids"], NEW)
        if tokenizer.eos_token_id in want:  # the servers stop at the end token
            want = want[:want.index(tokenizer.eos_token_id)]
        wants[prompt] = want
    with server_for(spec, ws, log_path=tmp_path / "server.log") as server:
        for prompt, want in wants.items():
            assert greedy_text(server.grpc_url, prompt, NEW).split() == tokenizer.decode(want).split(), prompt
    with openai_server(spec, ws, tmp_path / "openai.log") as api:
        for prompt, want in wants.items():
            body = json.dumps({"model": api.served_model_name, "prompt": prompt, "max_tokens": NEW,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"{api.url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                answer = json.loads(resp.read())
            assert answer["choices"][0]["text"].split() == tokenizer.decode(want).split(), prompt
            assert answer["usage"]["completion_tokens"] == len(want)
