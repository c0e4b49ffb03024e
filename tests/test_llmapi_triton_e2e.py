"""Target llmapi-cpu served for real: Triton's llmapi request contract on tritonserver with the
CPU stand-in for tensorrt_llm.LLM, the OpenAI server started from the same LLM() arguments, and
`toolchain deploy` of the shipped example spec."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from conftest import REPO, write_spec, starts_server
from llmapi_helpers import collect, llmapi_inputs, openai_completion, texts
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_words):
    from toolchain.pipeline import convert_for, model_repo_for, server_for

    root = tmp_path_factory.mktemp("llmapi-e2e")
    spec = load_spec(write_spec(root / "spec.yaml", hf_llama_words, target="llmapi-cpu", parallelism={"tp": 2},
                                limits={"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 512,
                                        "max_num_tokens": 256},
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0,
                                         "max_tokens_in_paged_kv_cache": 2048},
                                llmapi={"openai_port": 0}))
    ws = Workspace(root)
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    before = prepared_stamps(spec, ws)
    with server_for(spec, ws, log_path=root / "server.log") as server:
        server.prepared_before = before
        yield spec, ws, server


def prepared_stamps(spec, ws) -> dict[str, int]:
    """mtimes of what convert prepared for LLM(): the lock every loader takes, and the CPU engine's manifest."""
    work = ws.cpu_llm_dir(spec)
    return {"lock": (work / ".lock").stat().st_mtime_ns,
            "engine": (work / "engines" / "llm" / "engine" / "manifest.json").stat().st_mtime_ns}


def test_the_servers_load_the_engine_convert_prepared_without_converting_again(served):
    spec, ws, server = served
    after = prepared_stamps(spec, ws)
    # The Triton model took the prepared directory's lock (so it loaded from there) and rebuilt nothing.
    assert after["lock"] > server.prepared_before["lock"]
    assert after["engine"] == server.prepared_before["engine"]


def test_streaming_responses_carry_the_whole_text_so_far(served):
    _, _, server = served
    responses, errors = collect(server.grpc_url, llmapi_inputs(
        "w5 w6 w7", streaming=True, sampling_param_max_tokens=6, sampling_param_exclude_input_from_output=True,
        return_finish_reason=True))
    assert not errors
    got = texts(responses)
    assert len(got) == 6 and all(got[i + 1].startswith(got[i]) for i in range(5))
    assert responses[-1].as_numpy("finish_reason")[0] == b"length"

    single, errors = collect(server.grpc_url, llmapi_inputs(
        "w5 w6 w7", sampling_param_max_tokens=6, sampling_param_exclude_input_from_output=True))
    assert not errors and texts(single) == [got[-1]]  # not streaming: one response, the same text


def test_upstreams_default_puts_the_prompt_in_text_output(served):
    """helpers.py defaults sampling_param_exclude_input_from_output to False (the LLM API's own
    default is True): the prompt's tokens come back in front of the generated ones."""
    _, _, server = served
    responses, errors = collect(server.grpc_url, llmapi_inputs("w5 w6 w7", sampling_param_max_tokens=2,
                                                               sampling_param_top_k=1))
    assert not errors and texts(responses)[0].startswith("w5 w6 w7 ")


def test_perf_metrics_outputs_come_with_return_perf_metrics(served):
    _, _, server = served
    responses, errors = collect(server.grpc_url, llmapi_inputs(
        "w40 w41 w42", sampling_param_max_tokens=3, sampling_param_return_perf_metrics=True,
        sampling_param_exclude_input_from_output=True))
    assert not errors
    last = responses[-1]
    times = [int(last.as_numpy(n)[0]) for n in ("arrival_time_ns", "first_scheduled_time_ns",
                                                "first_token_time_ns", "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 0
    assert int(last.as_numpy("kv_cache_alloc_total_blocks")[0]) >= 1


def test_stop_with_the_request_id_ends_an_inflight_request(served):
    """As upstream's handle_stop_request: the stop request is answered "Request cancelled by client"
    and the stopped request ends early with a normal final response. The stop's stream is open before the
    request goes out and the request asks for nearly every position, so a loaded host cannot finish it first."""
    import tritonclient.grpc as grpcclient

    _, _, server = served
    limit = 480
    long_client, stop_client = (grpcclient.InferenceServerClient(server.grpc_url) for _ in range(2))
    got: queue.Queue = queue.Queue()
    stopped: queue.Queue = queue.Queue()
    long_client.start_stream(callback=lambda result, error: got.put((result, error)))
    stop_client.start_stream(callback=lambda result, error: stopped.put((result, error)))
    try:
        long_client.async_stream_infer("tensorrt_llm", llmapi_inputs(
            "w50 w51", streaming=True, sampling_param_max_tokens=limit, sampling_param_exclude_input_from_output=True,
            return_finish_reason=True), request_id="long", enable_empty_final_response=True)
        first, error = got.get(timeout=60)
        assert error is None
        stop_client.async_stream_infer("tensorrt_llm", llmapi_inputs("", stop=True), request_id="long",
                                       enable_empty_final_response=True)
        _, stop_error = stopped.get(timeout=60)
        responses = [first]
        while not responses[-1].get_response().parameters["triton_final_response"].bool_param:
            result, error = got.get(timeout=60)
            assert error is None, error
            responses.append(result)
    finally:
        for client in (long_client, stop_client):
            client.stop_stream()
            client.close()
    assert stop_error is not None and "Request cancelled by client" in str(stop_error)
    assert len(texts(responses)) < limit and responses[-1].as_numpy("finish_reason")[0] == b"cancelled"


def test_penalties_and_the_cumulative_logprob_come_through_the_llmapi_model(served):
    """sampling_param_presence_penalty reaches the engine (a huge one repeats no token of prompt or output), and
    return_cumulative_logprob answers upstream's FP32 output with the generated tokens' summed log-prob."""
    _, _, server = served
    responses, errors = collect(server.grpc_url, llmapi_inputs(
        "w5 w6 w7", sampling_param_max_tokens=8, sampling_param_top_k=1, sampling_param_presence_penalty=1000.0,
        sampling_param_exclude_input_from_output=True, return_cumulative_logprob=True))
    assert not errors, errors
    words = ("w5 w6 w7 " + texts(responses)[-1]).split()
    assert len(words) > 3 and len(set(words)) == len(words), words
    cum = responses[-1].as_numpy("cumulative_logprob")
    assert cum.dtype == np.float32 and cum.shape == (1,) and -1000 < float(cum[0]) < 0


@pytest.mark.parametrize("inputs, fragment", [
    (lambda: llmapi_inputs("w5", streaming=True, sampling_param_max_tokens=0), "max_tokens"),
    (lambda: llmapi_inputs("w5", sampling_param_max_tokens=2, sampling_param_best_of=2), "Greedy decoding"),
    (lambda: llmapi_inputs("w5 " * 70, sampling_param_max_tokens=2), "max_input_len"),
])
def test_bad_requests_get_one_error_and_the_server_keeps_serving(served, inputs, fragment):
    _, _, server = served
    _, errors = collect(server.grpc_url, inputs())
    assert errors and fragment in errors[0]
    after, errors = collect(server.grpc_url, llmapi_inputs("w5 w6", sampling_param_max_tokens=2))
    assert not errors and texts(after)


def test_the_openai_server_runs_the_same_llm_arguments(served):
    from toolchain.pipeline import openai_server

    spec, ws, server = served
    triton, errors = collect(server.grpc_url, llmapi_inputs(
        "w60 w61 w62", sampling_param_max_tokens=5, sampling_param_top_k=1,
        sampling_param_exclude_input_from_output=True))
    assert not errors
    before = prepared_stamps(spec, ws)
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        answer = openai_completion(api, "w60 w61 w62", 5)
    assert answer.strip() == texts(triton)[-1].strip()
    after = prepared_stamps(spec, ws)  # loaded from convert's directory, not converted again
    assert after["lock"] > before["lock"] and after["engine"] == before["engine"]


def test_an_unknown_key_in_the_serve_config_stops_the_openai_server_at_start(tmp_path, hf_llama_words):
    from toolchain.errors import ToolchainError
    from toolchain.openai.server import OpenAIServer

    config = tmp_path / "bad.yaml"
    config.write_text("max_num_tokenz: 128\n")
    with pytest.raises(ToolchainError, match="max_num_tokenz"):
        OpenAIServer(None, None, "tiny", model=hf_llama_words, config=config).start(timeout=120)


def test_deploy_of_the_shipped_llmapi_spec_serves_both_and_writes_both_reports(tmp_path):
    from toolchain.cli import main as cli_main

    spec = REPO / "build" / "tiny-llama-llmapi.yaml"
    overrides = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0", "llmapi.openai_port=0",
                 "validation.workload.num_requests=8", "validation.workload.warmup_requests=1"]
    args = ["--root", str(tmp_path), "deploy", str(spec)] + [a for o in overrides for a in ("--set", o)]
    assert cli_main(args) == 0
    reports = tmp_path / "reports" / "tiny-llama-llmapi"
    triton = json.loads((reports / "report.json").read_text())
    openai = json.loads((reports / "openai" / "report.json").read_text())
    assert triton["errors"] == 0 and triton["num_requests"] == 8 and triton["ttft_ms"]["p50"] > 0
    assert openai["errors"] == 0 and openai["num_requests"] == 8 and openai["ttft_ms"]["p50"] > 0
    assert triton["protocol"] == "triton-grpc" and triton["transport"]["contract"] == "llmapi"
    # The Triton report with deploy's timings; the OpenAI server's summary only in the returned report.
    assert list(triton)[-1] == "stage_seconds" and "openai" not in triton and "stage_seconds" not in openai
    assert {"serve-openai", "bench-openai", "stop-openai"} <= set(triton["stage_seconds"])
