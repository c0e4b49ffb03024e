"""Log-probabilities, context logits and guided decoding through the real tritonserver's tensorrt_llm model (CPU
engine), one server: output_log_probs / cum_log_probs equal HF's log-softmax where the sampled distribution is the
full softmax (temperature 1, runtime_top_p 1, a seed), context_logits equal HF's logits, a JSON-schema guide gives
JSON that validates, and a guide XGrammar rejects comes back as one Triton error. model-repo wrote the
guided-decoding parameters and the tokenizer-info file the backend reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import starts_server
from test_engine_cpu_util import hf_logits, hf_model
from triton_helpers import deploy, stream, text_request, token_request

pytest.importorskip("toolchain.engine.cpu")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

END = 2  # the character tokenizer's "</s>"
LIMITS = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 256, "max_num_tokens": 256}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_chars):
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), hf_llama_chars, limits=LIMITS,
                              build={"gather_context_logits": True},
                              serving={"streaming": True, "guided_decoding_backend": "xgrammar"})
    with server:
        yield spec, ws, server


@pytest.fixture(scope="module")
def tokenizer(hf_llama_chars):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_llama_chars)


def test_model_repo_writes_the_guided_decoding_parameters(served):
    spec, ws, _ = served
    repo = ws.model_repo_dir(spec)
    info = repo / "xgrammar_tokenizer_info.json"
    data = json.loads(info.read_text())
    assert set(data) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"} and data["stop_token_ids"] == [END]
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "guided_decoding_backend"\n  value {\n    string_value: "xgrammar"' in config
    assert f'string_value: "{info.resolve()}"' in config


def test_log_probs_and_context_logits_equal_hf(served, tokenizer, hf_llama_chars):
    _, _, server = served
    prompt = tokenizer.encode("The answer is")
    got = stream(server.grpc_url, "tensorrt_llm", token_request(
        prompt, 8, stream=False, end_id=([-1], "INT32"), temperature=([1.0], "FP32"), runtime_top_p=([1.0], "FP32"),
        seed=([7], "UINT64"), return_log_probs=([True], "BOOL"), return_context_logits=([True], "BOOL")))
    assert not got.errors and len(got.responses) == 1
    out = got.tokens()
    assert len(out) == 8
    log_probs, cum = got.outputs("output_log_probs")[0], got.outputs("cum_log_probs")[0]
    assert log_probs.shape == (1, 1, 8) and cum.shape == (1, 1)
    hf = hf_model(hf_llama_chars)
    ref = torch.log_softmax(hf_logits(hf, prompt + out), -1)
    want = ref[torch.arange(len(prompt) - 1, len(prompt) + 7), torch.tensor(out)]
    assert np.allclose(log_probs.reshape(-1), want.numpy(), atol=1e-4)
    assert float(cum[0, 0]) == pytest.approx(float(want.sum()), abs=1e-3)
    context = got.outputs("context_logits")[0]
    assert context.shape == (1, len(prompt), 250)
    assert np.allclose(context[0], hf_logits(hf, prompt).numpy(), atol=1e-4)
    # greedy: the C++ runtime reports 0.0 (all of the greedy distribution's mass is on the pick)
    greedy = stream(server.grpc_url, "tensorrt_llm", token_request(
        prompt, 4, stream=True, end_id=([-1], "INT32"), return_log_probs=([True], "BOOL")))
    assert not greedy.errors and [a.shape[:2] for a in greedy.outputs("output_log_probs")] == [(1, 1)] * 4
    assert all(float(a.reshape(-1)[0]) == 0.0 for a in greedy.outputs("output_log_probs"))


def test_a_json_schema_guide_gives_valid_json_and_a_bad_one_is_refused(served, tokenizer):
    import jsonschema

    _, _, server = served
    prompt = tokenizer.encode("Answer: ")
    guided = dict(end_id=([END], "INT32"), runtime_top_k=([20], "INT32"), seed=([1], "UINT64"),
                  guided_decoding_guide_type=(["json_schema"], "BYTES"))
    got = stream(server.grpc_url, "tensorrt_llm", token_request(
        prompt, 120, stream=False, guided_decoding_guide=([json.dumps(SCHEMA)], "BYTES"), **guided))
    assert not got.errors
    jsonschema.validate(json.loads(tokenizer.decode(got.tokens())), SCHEMA)
    bad = stream(server.grpc_url, "tensorrt_llm", token_request(
        prompt, 20, stream=False, guided_decoding_guide=(['{"type": "objekt"}'], "BYTES"), **guided))
    assert bad.errors and not bad.responses
    message = str(bad.errors[0])
    assert 'the json_schema guide is rejected by XGrammar: Unsupported type "objekt"' in message
    assert "\n" not in message and server.ready


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_the_text_models_pass_guides_and_log_probs_through(served, tokenizer, model):
    _, _, server = served
    prompt = tokenizer.encode("Answer: ")
    schema = (["json_schema"], "BYTES"), ([json.dumps(SCHEMA)], "BYTES")
    direct = stream(server.grpc_url, "tensorrt_llm", token_request(
        prompt, 120, stream=False, end_id=([END], "INT32"), runtime_top_k=([20], "INT32"), seed=([1], "UINT64"),
        guided_decoding_guide_type=schema[0], guided_decoding_guide=schema[1]))
    got = stream(server.grpc_url, model, text_request(
        "Answer: ", 120, stream=False, top_k=([20], "INT32"), seed=([1], "UINT64"), return_log_probs=([True], "BOOL"),
        guided_decoding_guide_type=schema[0], guided_decoding_guide=schema[1]))
    assert not direct.errors and not got.errors
    assert got.texts() == [tokenizer.decode(direct.tokens())]  # the same tokens, through preprocessing and back
    log_probs = got.outputs("output_log_probs")[0]
    assert log_probs.shape[-1] == len(direct.tokens()) and np.all(log_probs <= 0)


def test_penalties_bad_words_and_embedding_bias_reach_the_engine(served, tokenizer):
    from toolchain.engine.cpu import CpuEngine, SamplingParams

    spec, ws, server = served
    engine = CpuEngine.load(ws.engine_dir(spec))
    prompt = tokenizer.encode("abcabc")
    plain = engine.generate(prompt, SamplingParams(10))
    bias = np.zeros(250, np.float32)
    bias[plain[1]] = -50.0
    params = SamplingParams(10, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                            bad_words=[[plain[0]]], embedding_bias=torch.from_numpy(bias))
    want = engine.generate(prompt, params)
    assert want != plain and plain[0] not in want and plain[1] not in want
    got = stream(server.grpc_url, "tensorrt_llm", token_request(
        prompt, 10, stream=True, end_id=([-1], "INT32"), repetition_penalty=([1.5], "FP32"),
        presence_penalty=([0.5], "FP32"), frequency_penalty=([0.25], "FP32"),
        bad_words_list=([[plain[0]], [1]], "INT32"), embedding_bias=(bias, "FP32")))
    assert not got.errors and got.tokens() == want
