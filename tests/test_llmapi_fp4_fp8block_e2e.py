"""NVFP4 and FP8 block scales served for real on target llmapi-cpu (issue 35): convert writes the Hugging Face-format
checkpoint the PyTorch backend loads, Triton's llmapi model and the OpenAI server both run it through the CPU
stand-in (its import into the engine layout and the CPU engine's kernel of the format), and both answer the same
greedy text. The model has whole 128-wide tiles everywhere (heads of 128, hidden 256, MLP 512), as FP8 block scales
need on the GPU too."""

from __future__ import annotations

import json

import pytest

from conftest import make_hf_llama, starts_server
from llmapi_helpers import greedy_text, openai_completion, serve_llmapi_cpu

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
    method, algo = request.param
    with serve_llmapi_cpu(tmp_path_factory.mktemp(f"llmapi-{method}"), tiled_words, name=f"tiled-{method}",
                          model={"checkpoint": str(tiled_words), "dtype": "bfloat16"},
                          quantization={"method": method, "calibration": {"samples": 4, "seq_len": 32}}) as served:
        yield (*served, algo)


def test_convert_wrote_the_format_the_pytorch_backend_loads(served):
    spec, ws, _, algo = served
    hf_quant = json.loads((ws.checkpoint_dir(spec) / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] in (algo if isinstance(algo, tuple) else (algo,))


def test_triton_and_the_openai_server_answer_the_same_greedy_text(served):
    from toolchain.pipeline import openai_server

    spec, ws, server, _ = served
    triton = greedy_text(server.grpc_url, "w60 w61 w62", 6)
    assert triton.strip()
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        assert openai_completion(api, "w60 w61 w62", 6).strip() == triton.strip()
