"""NVFP4 and FP8 block scales served for real on target llmapi-cpu (issue 35): convert writes the Hugging Face-format
checkpoint the PyTorch backend loads, Triton's llmapi model and the OpenAI server both run it through the CPU
stand-in (its import into the engine layout and the CPU engine's kernel of the format), and both answer the same
greedy text. The model has whole 128-wide tiles everywhere (heads of 128, hidden 256, MLP 512), as FP8 block scales
need on the GPU too."""

from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import make_hf_llama, starts_server, write_spec
from test_llmapi_triton_e2e import collect, llmapi_inputs, texts
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiled_words(tmp_path_factory):
    from triton_helpers import make_tiny_tokenizer

    out = make_hf_llama(tmp_path_factory.mktemp("tiled"), hidden_size=256, intermediate_size=512,
                        num_attention_heads=2, num_key_value_heads=1, seed=3)
    make_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module", params=[("nvfp4", "NVFP4"), ("fp8_block", ("fp8_pb_wo", "FP8_BLOCK_SCALES"))],
                ids=["nvfp4", "fp8_block"])
@starts_server
def served(request, tmp_path_factory, tiled_words):
    from toolchain.pipeline import convert_for, model_repo_for, server_for

    method, algo = request.param
    root = tmp_path_factory.mktemp(f"llmapi-{method}")
    spec = load_spec(write_spec(root / "spec.yaml", tiled_words, name=f"tiled-{method}", target="llmapi-cpu",
                                model={"checkpoint": str(tiled_words), "dtype": "bfloat16"},
                                quantization={"method": method,
                                              "calibration": {"samples": 4, "seq_len": 32}},
                                limits={"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128,
                                        "max_num_tokens": 256},
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0,
                                         "max_tokens_in_paged_kv_cache": 1024},
                                llmapi={"openai_port": 0}))
    ws = Workspace(root)
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    with server_for(spec, ws, log_path=root / "server.log") as server:
        yield spec, ws, server, algo


def test_convert_wrote_the_format_the_pytorch_backend_loads(served):
    spec, ws, _, algo = served
    hf_quant = json.loads((ws.checkpoint_dir(spec) / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] in (algo if isinstance(algo, tuple) else (algo,))


def test_triton_and_the_openai_server_answer_the_same_greedy_text(served):
    from toolchain.pipeline import openai_server

    spec, ws, server, _ = served
    triton, errors = collect(server.grpc_url, llmapi_inputs(
        "w60 w61 w62", sampling_param_max_tokens=6, sampling_param_top_k=1,
        sampling_param_exclude_input_from_output=True))
    assert not errors and texts(triton)[-1].strip()
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        body = json.dumps({"model": api.served_model_name, "prompt": "w60 w61 w62", "max_tokens": 6,
                           "top_k": 1}).encode()
        req = urllib.request.Request(f"{api.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
    assert answer["choices"][0]["text"].strip() == texts(triton)[-1].strip()
