"""Draft-target speculation judged by draft logits: the CPU `tensorrt_llm` model returns
`generation_logits` as the C++ backend shapes them (only from an engine built with
gather_generation_logits, as speculative.use_draft_logits builds the draft), and the BLS with
`use_draft_logits` sends the draft's logits to the target as `draft_logits`, reporting the
acceptance figures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import starts_server
from triton_helpers import deploy, stream, text_request, token_request

LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 96, "max_num_tokens": 128}
PROMPT = "w10 w20 w30 w40 w50"


# ---- the engine: rows kept only when asked, one per emitted token -------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama):
    from test_engine_cpu_util import load_engine

    return load_engine(tmp_path_factory, hf_llama, max_draft_len=4)


def _run(engine, prompt, params, **submit):
    import threading

    from toolchain.engine.cpu import InflightBatcher

    tokens, done = [], threading.Event()

    def callback(new, finished, error=None):
        assert error is None, error
        tokens.extend(new)
        if finished:
            done.set()

    with InflightBatcher(engine) as batcher:
        batcher.submit("r", prompt, params, callback, **submit)
        assert done.wait(30)
    return tokens


def test_engine_keeps_the_logits_each_emitted_token_was_chosen_from(engine):
    import torch

    from toolchain.engine.cpu import SamplingParams

    prompt = [0, 12, 13, 14, 15]
    rows: list = []
    out = _run(engine, prompt, SamplingParams(max_new_tokens=6), generation_logits=rows)
    got = torch.cat(rows)
    want = engine.forward_logits(prompt + out)[len(prompt) - 1:-1]
    assert got.shape == (6, engine.vocab_size) and torch.allclose(got, want, atol=1e-4)
    assert got.argmax(-1).tolist() == out  # greedy: each row's argmax is its token

    # Drafts verified in one step: the accepted tokens' rows and the target's next one, in order.
    draft = out[:3]
    rows = []
    again = _run(engine, prompt, SamplingParams(max_new_tokens=4), draft_tokens=draft, generation_logits=rows)
    assert again == out[:4] and torch.allclose(torch.cat(rows), want[:4], atol=1e-4)


def test_engine_keeps_no_logits_unless_asked(engine):
    from toolchain.engine.cpu import SamplingParams

    seq = engine.start([0, 12, 13], SamplingParams(max_new_tokens=2))
    assert seq.generation_logits is None  # the step's rows are dropped with the step


# ---- through tritonserver ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_words):
    """Draft-target with the target itself as draft (their logits agree); speculative.use_draft_logits
    builds only the draft engine with gather_generation_logits, as upstream's DTM guide builds it."""
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=LIMITS,
                              build={"tokens_per_block": 16}, serving={"streaming": True},
                              speculative={"mode": "draft_target", "max_draft_len": 4,
                                           "draft_model": str(hf_llama_words), "use_draft_logits": True})
    engine = ws.engine_dir(spec)
    draft = json.loads((engine / "draft" / "engine" / "config.json").read_text())["build_config"]
    target = json.loads((engine / "config.json").read_text())["build_config"]
    assert draft["gather_generation_logits"] is True and not target.get("gather_generation_logits")
    with server:
        yield spec, ws, server


@pytest.mark.e2e
@pytest.mark.slow
def test_use_draft_logits_speculates_with_the_drafts_logits(served):
    _, _, server = served
    plain = stream(server.grpc_url, "tensorrt_llm_bls", text_request(PROMPT, 20, stream=False))
    spec = stream(server.grpc_url, "tensorrt_llm_bls",
                  text_request(PROMPT, 20, stream=False, num_draft_tokens=([4], "INT32"),
                               use_draft_logits=([True], "BOOL"), return_perf_metrics=([True], "BOOL")))
    assert not plain.errors and not spec.errors, (plain.errors, spec.errors)
    assert len(spec.texts()) == 1 and len(spec.texts()[0].split()) == 20
    last = spec.responses[-1]
    drafted = int(last.as_numpy("total_draft_tokens").reshape(-1)[0])
    accepted = int(last.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    rate = float(last.as_numpy("acceptance_rate").reshape(-1)[0])
    assert drafted > 0 and 0 <= accepted <= drafted and abs(rate - accepted / drafted) < 1e-6
    # The draft's probabilities are the target's up to rounding, so p < t * q (t a fresh uniform draw
    # per token, no threshold is sent) almost never holds; where every draft token passed, the text is
    # greedy decoding's. Which tokens pass is not deterministic in general (upstream's rule samples).
    assert accepted >= 0.9 * drafted
    if accepted == drafted:
        assert spec.texts() == plain.texts()


@pytest.mark.e2e
@pytest.mark.slow
def test_generation_logits_are_the_engines_own_for_the_chosen_tokens(served):
    from toolchain.engine.cpu import CpuEngine

    spec, ws, server = served
    reference = CpuEngine.load(ws.engine_dir(spec))  # the draft's weights are the target's
    prompt = [0, 12, 13, 14, 15]
    whole = stream(server.grpc_url, "tensorrt_llm_draft",
                   token_request(prompt, 6, stream=False, end_id=([-1], "INT32"),
                                 return_generation_logits=([True], "BOOL")))
    assert not whole.errors, whole.errors
    out = whole.tokens()
    logits = whole.responses[-1].as_numpy("generation_logits")
    assert logits.dtype == np.float32 and logits.shape == (1, 1, 6, reference.vocab_size)
    want = reference.forward_logits(prompt + out)[len(prompt) - 1:-1].numpy()
    assert np.allclose(logits[0, 0], want, atol=1e-4) and logits[0, 0].argmax(-1).tolist() == out

    # Streamed: each response the rows of its new tokens, as [1, tokens, beam, vocab].
    streamed = stream(server.grpc_url, "tensorrt_llm_draft",
                      token_request(prompt, 6, stream=True, end_id=([-1], "INT32"),
                                    return_generation_logits=([True], "BOOL")))
    assert not streamed.errors and streamed.tokens() == out
    parts = streamed.outputs("generation_logits")
    assert all(p.shape[0] == 1 and p.shape[2] == 1 for p in parts)
    assert np.allclose(np.concatenate([p[0, :, 0] for p in parts]), want, atol=1e-4)

    # An early end leaves the buffer's tail unwritten: [1, 1, request_output_len, vocab] still.
    end = out[2]
    early = stream(server.grpc_url, "tensorrt_llm_draft",
                   token_request(prompt, 6, stream=False, end_id=([end], "INT32"),
                                 return_generation_logits=([True], "BOOL")))
    assert not early.errors and early.tokens() == out[:2]
    rows = early.responses[-1].as_numpy("generation_logits")
    assert rows.shape == (1, 1, 6, reference.vocab_size)
    assert np.allclose(rows[0, 0, :2], want[:2], atol=1e-4) and not rows[0, 0, 3:].any()


@pytest.mark.e2e
@pytest.mark.slow
def test_each_refusal_is_one_clear_error(served):
    _, _, server = served
    grpc = server.grpc_url
    # The target engine was built without gather_generation_logits: the executor's refusal.
    target = stream(grpc, "tensorrt_llm", token_request([0, 12, 13], 4, stream=False,
                                                         return_generation_logits=([True], "BOOL")))
    assert len(target.errors) == 1 and "gather_generation_logits must be enabled" in str(target.errors[0])

    for extra, words in (({"return_context_logits": ([True], "BOOL")}, "context logits are not supported"),
                         ({"return_generation_logits": ([True], "BOOL")}, "generation logits are not supported"),
                         ({}, "streaming is not supported with speculative decoding")):
        got = stream(grpc, "tensorrt_llm_bls", text_request(PROMPT, 8, stream=not extra, use_draft_logits=([True], "BOOL"),
                                                            num_draft_tokens=([4], "INT32"), **extra))
        assert len(got.errors) == 1 and words in str(got.errors[0]), (extra, got.errors)

    two = [_batch("text_input", [PROMPT.encode()] * 2, object, "BYTES"), _batch("max_tokens", [8, 8], np.int32, "INT32"),
           _batch("stream", [False, False], bool, "BOOL"), _batch("num_draft_tokens", [4, 4], np.int32, "INT32"),
           _batch("use_draft_logits", [True, True], bool, "BOOL")]
    got = stream(grpc, "tensorrt_llm_bls", two)
    assert len(got.errors) == 1 and "batch size > 1" in str(got.errors[0]), got.errors


def _batch(name, values, dtype, triton_dtype):
    """An input of two rows, [2, 1]."""
    import tritonclient.grpc as grpcclient

    arr = np.array(values, dtype=dtype).reshape(len(values), 1)
    t = grpcclient.InferInput(name, list(arr.shape), triton_dtype)
    t.set_data_from_numpy(arr)
    return t
