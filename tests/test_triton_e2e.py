"""The rendered repository served by the real tritonserver with the CPU engine:
a small random Llama and a WordLevel tokenizer (token i is the word `w<i>`),
streamed through tensorrt_llm, the ensemble and the BLS; every path must give
the engine's own greedy tokens."""

from __future__ import annotations

import threading

import pytest

from conftest import starts_server
from triton_helpers import deploy, stream, tensor, text_request, token_request

pytest.importorskip("toolchain.engine.cpu")
pytest.importorskip("toolchain.checkpoint.stage")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EOS = 2
PROMPT = [10, 20, 30, 40, 50]
LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 512, "max_num_tokens": 256}


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def _deploy(tmp_path_factory, hf_llama_words, streaming: bool):
    return deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=LIMITS, serving={"streaming": streaming})


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_words):
    spec, ws, server = _deploy(tmp_path_factory, hf_llama_words, streaming=True)
    with server:
        yield spec, ws, server


@pytest.fixture(scope="module")
def engine(served):
    from toolchain.engine.cpu import CpuEngine

    spec, ws, _ = served
    return CpuEngine.load(ws.engine_dir(spec))


def _greedy(engine, prompt, n, end_id=EOS):
    from toolchain.engine.cpu import SamplingParams

    return engine.generate(prompt, SamplingParams(max_new_tokens=n, end_id=end_id))


def test_tensorrt_llm_streams_only_new_tokens(served, engine):
    _, _, server = served
    want = _greedy(engine, PROMPT, 12, end_id=-1)
    got = stream(server.grpc_url, "tensorrt_llm", token_request(PROMPT, 12, stream=True, end_id=([-1], "INT32")))
    assert not got.errors and got.finals == 1
    assert got.tokens() == want and len(want) == 12
    for ids, length in zip(got.outputs("output_ids"), got.outputs("sequence_length")):
        assert ids.shape[:2] == (1, 1) and length.shape == (1, 1) and int(length[0, 0]) == ids.shape[2]


def test_tensorrt_llm_non_streaming_returns_prompt_and_completion(served, engine):
    _, _, server = served
    want = _greedy(engine, PROMPT, 6, end_id=-1)
    got = stream(server.grpc_url, "tensorrt_llm", token_request(
        PROMPT, 6, stream=False, end_id=([-1], "INT32"), exclude_input_in_output=([False], "BOOL"),
        return_num_input_tokens=([True], "BOOL")))
    assert not got.errors and len(got.responses) == 1
    assert got.tokens() == PROMPT + want
    assert int(got.outputs("sequence_length")[0].reshape(-1)[0]) == len(PROMPT) + len(want)
    assert int(got.outputs("num_input_tokens")[0].reshape(-1)[0]) == len(PROMPT)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_models_match_the_engine(served, engine, model):
    _, _, server = served
    want = _greedy(engine, PROMPT, 10)  # end_id defaults to the tokenizer's EOS in preprocessing
    streamed = stream(server.grpc_url, model, text_request(_words(PROMPT), 10, stream=True))
    assert not streamed.errors and streamed.finals == 1
    assert streamed.texts() == [f"w{t}" for t in want]  # one delta per token
    whole = stream(server.grpc_url, model, text_request(_words(PROMPT), 10, stream=False))
    assert not whole.errors and whole.texts() == [_words(want)]


def test_concurrent_requests_batch_without_changing_results(served, engine):
    _, _, server = served
    prompts = [[11, 12, 13], [40, 41, 42, 43, 44, 45], [7, 8], [100, 99, 98, 97]]
    want = [_greedy(engine, p, 16, end_id=-1) for p in prompts]
    got = [None] * len(prompts)

    def run(i, model):
        inputs = text_request(_words(prompts[i]), 16, stream=True, end_id=([-1], "INT32"))
        got[i] = stream(server.grpc_url, model, inputs, request_id=f"c{i}")

    threads = [threading.Thread(target=run, args=(i, "tensorrt_llm_bls" if i % 2 else "ensemble"))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for result, tokens in zip(got, want):
        assert result is not None and not result.errors
        assert result.texts() == [f"w{t}" for t in tokens]


def test_engine_errors_come_back_as_triton_errors(served):
    _, _, server = served
    too_long = list(range(3, 3 + LIMITS["max_input_len"] + 8))
    got = stream(server.grpc_url, "tensorrt_llm", token_request(too_long, 4))
    assert got.errors and "tensorrt_llm" in str(got.errors[0]) and not got.responses
    # an engine built without --gather_context_logits refuses context logits, as the executor does
    inputs = text_request(_words(PROMPT), 4, return_context_logits=([True], "BOOL"))
    unsupported = stream(server.grpc_url, "ensemble", inputs)
    assert unsupported.errors and "gather_context_logits" in str(unsupported.errors[0])
    assert server.ready


def test_stop_request_ends_an_inflight_request(served):
    """A stop request naming an inflight request id ends it early. Both streams are open before
    the long request goes out, so the stop costs one message rather than a new channel, and the
    request asks for all the model's positions: a tiny model on a loaded CI host once finished
    155 tokens before a freshly dialled stop arrived."""
    import queue

    import tritonclient.grpc as grpcclient

    _, _, server = served
    limit = LIMITS["max_seq_len"] - len(PROMPT)
    long_client, stop_client = (grpcclient.InferenceServerClient(server.grpc_url) for _ in range(2))
    got: queue.Queue = queue.Queue()
    stopped: queue.Queue = queue.Queue()
    long_client.start_stream(callback=lambda result, error: got.put((result, error)))
    stop_client.start_stream(callback=lambda result, error: stopped.put((result, error)))
    try:
        long_client.async_stream_infer("tensorrt_llm", token_request(PROMPT, limit, end_id=([-1], "INT32")),
                                       request_id="long-1", enable_empty_final_response=True)
        first, error = got.get(timeout=60)
        assert error is None
        stop_client.async_stream_infer(
            "tensorrt_llm", [tensor("input_ids", [0], "INT32"), tensor("input_lengths", [0], "INT32"),
                             tensor("request_output_len", [0], "INT32"), tensor("stop", [True], "BOOL")],
            request_id="long-1", enable_empty_final_response=True)
        result, error = stopped.get(timeout=60)
        assert error is None and result.get_response().parameters["triton_final_response"].bool_param
        assert result.as_numpy("output_ids") is None  # the stop itself answers with no tokens
        tokens = len(first.as_numpy("output_ids").reshape(-1))
        while True:
            result, error = got.get(timeout=60)
            assert error is None
            ids = result.as_numpy("output_ids")
            tokens += 0 if ids is None else ids.size
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert tokens < limit
    finally:
        for client in (long_client, stop_client):
            client.stop_stream()
            client.close()


def test_client_cancellation_leaves_the_server_healthy(served, engine):
    import queue

    import tritonclient.grpc as grpcclient

    _, _, server = served
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("tensorrt_llm_bls", text_request(_words(PROMPT), 120, end_id=([-1], "INT32")),
                              request_id="cancel-me", enable_empty_final_response=True)
    got.get(timeout=60)
    client.stop_stream(cancel_requests=True)
    client.close()
    want = _greedy(engine, PROMPT, 5)
    after = stream(server.grpc_url, "ensemble", text_request(_words(PROMPT), 5, stream=False))
    assert not after.errors and after.texts() == [_words(want)]


def test_not_decoupled_serves_whole_responses_and_rejects_streaming(tmp_path_factory, hf_llama_words):
    spec, ws, server = _deploy(tmp_path_factory, hf_llama_words, streaming=False)
    with server:
        whole = stream(server.grpc_url, "ensemble", text_request(_words(PROMPT), 4, stream=False))
        assert not whole.errors and len(whole.texts()) == 1
        bls = stream(server.grpc_url, "tensorrt_llm_bls", text_request(_words(PROMPT), 4, stream=False))
        assert not bls.errors and bls.texts() == whole.texts()
        rejected = stream(server.grpc_url, "tensorrt_llm", token_request(PROMPT, 4, stream=True))
        assert rejected.errors and "decoupled mode" in str(rejected.errors[0])


def test_cli_serve_prints_endpoints_and_stops_on_sigterm(served, engine):
    import signal
    import subprocess
    import sys
    import time

    spec, ws, _ = served
    cli = "import sys; from toolchain.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", cli, "--root", str(ws.root), "serve", str(spec.source)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("Ctrl-C to stop"):
                break
        grpc = next(line.split()[1] for line in lines if line.strip().startswith("gRPC"))
        want = _greedy(engine, PROMPT, 3)
        got = stream(grpc, "ensemble", text_request(_words(PROMPT), 3, stream=False))
        assert got.texts() == [_words(want)]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + rest
    assert "tritonserver stopped (exit code 0)" in rest
    assert (ws.model_repo_dir(spec).parent / f"{spec.name}.tritonserver.log").is_file()


# A config the real backend refuses must fail here too: the CPU tensorrt_llm
# model reads its parameters with the C++ backend's rules
# (toolchain/upstream/facts/backend_parameters.json), and preprocessing indexes
# multimodal_model_path as tensorrtllm_backend's model.py does.
@pytest.mark.parametrize("model, key, value, message", [
    ("tensorrt_llm", "guided_decoding_backend", None, "Cannot find parameter with name: guided_decoding_backend"),
    ("tensorrt_llm", "gpt_model_type", "static_batching", "gpt_model_type"),
    ("preprocessing", "multimodal_model_path", None, "multimodal_model_path"),
])
def test_a_config_the_gpu_backend_refuses_fails_to_load(tmp_path_factory, hf_llama_words, model, key, value, message):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    from toolchain.errors import StageFailed

    spec, ws, server = _deploy(tmp_path_factory, hf_llama_words, streaming=False)
    path = ws.model_repo_dir(spec) / model / "config.pbtxt"
    cfg = text_format.Parse(path.read_text(), pb.ModelConfig())
    assert key in cfg.parameters
    if value is None:
        del cfg.parameters[key]
    else:
        cfg.parameters[key].string_value = value
    path.write_text(text_format.MessageToString(cfg))
    with pytest.raises(StageFailed) as err:
        with server:
            pass
    assert f"model '{model}' failed to load" in str(err.value) and message in str(err.value), str(err.value)


def test_the_readme_curl_examples_answer(served):
    """README's generate and generate_stream bodies, sent as they are printed, get text back."""
    import json
    import urllib.request

    from triton_helpers import readme_curls

    _, _, server = served
    examples = readme_curls(8000)
    assert {path for path, _ in examples} >= {"v2/models/ensemble/generate", "v2/models/ensemble/generate_stream"}
    for path, body in examples:
        req = urllib.request.Request(f"{server.http_url}/{path}", data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
        events = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")] or [json.loads(raw)]
        assert events and all("text_output" in e for e in events), raw[:500]
