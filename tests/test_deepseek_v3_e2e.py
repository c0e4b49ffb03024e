"""DeepSeek-V3 / R1 served for real on target llmapi-cpu: a tiny DeepseekV3ForCausalLM (MLA, one dense layer, two
mixtures of 8 grouped-routed experts with a shared expert) converted at tp 2 with moe_ep 2, Triton's llmapi model and
the OpenAI server both running it through the CPU stand-in of LLM(), each answering transformers' greedy text; and
the same for a DeepSeek checkpoint stored as released, FP8 with 128x128 block scales (tests/test_deepseek_v3_fp8.py
makes it), against transformers on its dequantized weights with the block-scale GEMM's 1x128 activation rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import DEEPSEEK_V3_TINY, make_hf_model, starts_server
from llmapi_helpers import greedy_text, openai_completion, serve_llmapi_cpu

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARCH = "DeepseekV3ForCausalLM"
PROMPTS = ("w60 w61 w62", "w17 w101 w3 w44 w90 w91 w92 w12 w240 w6")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_words(tmp_path_factory) -> Path:
    from triton_helpers import make_tiny_tokenizer

    out = make_hf_model(ARCH, tmp_path_factory.mktemp("dsv3-words"), seed=21,
                        **{**DEEPSEEK_V3_TINY, "num_hidden_layers": 3})
    make_tiny_tokenizer(out)  # token i is the word w<i>
    return out


def transformers_text(model_dir: Path, prompt: str, n: int, model=None) -> str:
    """transformers' greedy continuation of `prompt` in float32 (the checkpoint's, or `model`), as text, up to its
    end token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    new = out[0, ids.shape[1]:].tolist()
    new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    return tok.decode(new, skip_special_tokens=True)


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, tiny_words):
    with serve_llmapi_cpu(tmp_path_factory.mktemp("llmapi-dsv3"), tiny_words, name="tiny-deepseek-v3",
                          model={"checkpoint": str(tiny_words), "dtype": "float32"},
                          parallelism={"tp": 2, "moe_ep": 2}) as served:
        yield served


def test_triton_and_the_openai_server_answer_transformers_greedy_text(served, tiny_words):
    from toolchain.pipeline import openai_server

    spec, ws, server = served
    want = [transformers_text(tiny_words, p, NEW_TOKENS) for p in PROMPTS]
    assert [len(w.split()) for w in want] == [NEW_TOKENS] * len(PROMPTS)  # no end token cuts them short
    assert (spec.parallelism.tp, spec.parallelism.moe_ep) == (2, 2)
    assert [greedy_text(server.grpc_url, p, NEW_TOKENS).strip() for p in PROMPTS] == [w.strip() for w in want]
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        assert [openai_completion(api, p, NEW_TOKENS).strip() for p in PROMPTS] == [w.strip() for w in want]


@pytest.fixture(scope="module")
@starts_server
def served_fp8(tmp_path_factory):
    from test_deepseek_v3_fp8 import make_bf16, write_fp8

    fp8 = write_fp8(make_bf16(tmp_path_factory.mktemp("dsv3-bf16")), tmp_path_factory.mktemp("dsv3-fp8"))
    with serve_llmapi_cpu(tmp_path_factory.mktemp("llmapi-dsv3-fp8"), fp8, name="tiny-deepseek-v3-fp8",
                          model={"checkpoint": str(fp8), "dtype": "bfloat16"}) as served:
        yield (*served, fp8)


def test_the_fp8_checkpoint_is_served_as_transformers_runs_its_dequantized_weights(served_fp8, tmp_path):
    from test_deepseek_v3_fp8 import dequantized_model, fp8_activations

    from toolchain.pipeline import openai_server

    spec, ws, server, fp8 = served_fp8
    # what LLM()'s CPU stand-in loads: the checkpoint imported with its FP8 block scales as stored
    algos = {json.loads(c.read_text()).get("pretrained_config", json.loads(c.read_text())).get("quantization", {})
             .get("quant_algo") for c in ws.cpu_llm_dir(spec).rglob("config.json")}
    assert "FP8_BLOCK_SCALES" in algos, algos
    model, storages = dequantized_model(fp8, tmp_path)
    with fp8_activations(storages):
        want = [transformers_text(fp8, p, NEW_TOKENS, model) for p in PROMPTS]
    assert [len(w.split()) for w in want] == [NEW_TOKENS] * len(PROMPTS)
    assert [greedy_text(server.grpc_url, p, NEW_TOKENS).strip() for p in PROMPTS] == want
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        assert [openai_completion(api, p, NEW_TOKENS).strip() for p in PROMPTS] == want
