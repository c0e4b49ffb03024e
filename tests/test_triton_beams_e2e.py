"""Beam search and num_return_sequences through the real tritonserver: a deployment built with
build.max_beam_width 2 answers `tensorrt_llm` requests with beam_width 2 (both beams in one response,
[1, beams, len] padded with -1) and with num_return_sequences 2 (one response per sequence, tagged with
sequence_index), equal to the CPU engine's own sequences, and refuses a wider beam in one line."""

from __future__ import annotations

import pytest

from conftest import starts_server
from triton_helpers import deploy, stream, text_request, token_request

pytest.importorskip("toolchain.engine.cpu")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [10, 20, 30, 40, 50]
LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 128, "max_num_tokens": 128}


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_words):
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=LIMITS,
                              build={"max_beam_width": 2}, serving={"streaming": True})
    with server:
        yield spec, ws, server


def test_beams_and_sequences_over_tritonserver(served):
    from toolchain.engine.cpu import CpuEngine, SamplingParams
    from toolchain.engine.cpu.beam_search import generate_sequences
    from toolchain.engine.cpu.beams import children

    spec, ws, server = served
    engine = CpuEngine.load(ws.engine_dir(spec))
    assert engine.limits.max_beam_width == 2  # the CPU build records the spec's

    end = ([-1], "INT32")
    beams = stream(server.grpc_url, "tensorrt_llm", token_request(
        PROMPT, 8, stream=False, end_id=end, beam_width=([2], "INT32"), exclude_input_in_output=([False], "BOOL")))
    want = generate_sequences(engine, PROMPT, SamplingParams(8, beam_width=2, num_return_sequences=2))
    assert not beams.errors and len(beams.responses) == 1 and beams.finals == 1
    ids, lengths = beams.outputs("output_ids")[0], beams.outputs("sequence_length")[0]
    assert ids.shape == (1, 2, len(PROMPT) + 8) and lengths.tolist() == [[len(PROMPT) + 8] * 2]
    assert [row.tolist() for row in ids[0]] == [PROMPT + w.tokens for w in want]
    assert not beams.outputs("sequence_index")  # only with num_return_sequences > 1
    # An end token that ends one beam before the other: the shorter is padded with -1.
    tries = ((e, generate_sequences(engine, PROMPT, SamplingParams(8, end_id=e, beam_width=2, num_return_sequences=2)))
             for e in dict.fromkeys(want[0].tokens + want[1].tokens))
    ragged = next((e, got) for e, got in tries if len({len(r.tokens) for r in got}) == 2)
    beams = stream(server.grpc_url, "tensorrt_llm", token_request(
        PROMPT, 8, stream=False, end_id=([ragged[0]], "INT32"), beam_width=([2], "INT32"),
        exclude_input_in_output=([True], "BOOL")))
    width = max(len(r.tokens) for r in ragged[1])
    assert [row.tolist() for row in beams.outputs("output_ids")[0][0]] == [
        r.tokens + [-1] * (width - len(r.tokens)) for r in ragged[1]]
    assert beams.outputs("sequence_length")[0].tolist() == [[len(r.tokens) for r in ragged[1]]]

    # Through the ensemble: one text per beam (postprocessing decodes each), the tokenizer's EOS ending them.
    text = stream(server.grpc_url, "ensemble", text_request(" ".join(f"w{i}" for i in PROMPT), 8, stream=False,
                                                             beam_width=([2], "INT32")))
    eos_beams = generate_sequences(engine, PROMPT, SamplingParams(8, end_id=2, beam_width=2, num_return_sequences=2))
    assert not text.errors and text.outputs("text_output")[0].shape == (1, 2)
    assert [t.decode() for t in text.outputs("text_output")[0][0]] == [
        " ".join(f"w{i}" for i in b.tokens) for b in eos_beams]

    sampled = {"runtime_top_k": ([20], "INT32"), "temperature": ([1.5], "FP32"), "seed": ([5], "UINT64")}
    params = SamplingParams(8, top_k=20, temperature=1.5, seed=5, num_return_sequences=2)
    expected = [engine.generate(PROMPT, child) for child in children(params)]
    assert expected[0] != expected[1]
    for streaming in (False, True):
        got = stream(server.grpc_url, "tensorrt_llm", token_request(
            PROMPT, 8, stream=streaming, end_id=end, exclude_input_in_output=([True], "BOOL"),
            num_return_sequences=([2], "INT32"), **sampled), request_id=f"n{streaming}")
        assert not got.errors and got.finals == 1
        by_index: dict[int, list[int]] = {0: [], 1: []}
        for response in got.responses:
            by_index[int(response.as_numpy("sequence_index")[0, 0])] += response.as_numpy("output_ids").reshape(-1)\
                .tolist()
        assert by_index == {0: expected[0], 1: expected[1]}
        assert len(got.responses) == (16 if streaming else 2)  # one response per token, or per sequence

    wide = stream(server.grpc_url, "tensorrt_llm", token_request(PROMPT, 4, stream=False, beam_width=([3], "INT32")))
    assert wide.errors and "beam_width 3 exceeds the model's max_beam_width 2" in str(wide.errors[0])
    assert server.ready
