"""The serving engine behind the real tritonserver: KV-cache block counts in the
perf-metrics outputs, the backend's KV-cache metric family, a burst of streams, mass
cancellation read back from /metrics, and the executor's queue bound."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from conftest import starts_server
from triton_helpers import deploy, stream, text_request, token_request

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TPB = 16
LIMITS = {"max_batch_size": 8, "max_input_len": 64, "max_seq_len": 160, "max_num_tokens": 256}
POOL_TOKENS = 1024


def deploy_with(tmp_path_factory, hf_llama_words, **serving):
    return deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=LIMITS, build={"tokens_per_block": TPB},
                  serving={"max_tokens_in_paged_kv_cache": POOL_TOKENS, **serving})


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_words):
    spec, ws, server = deploy_with(tmp_path_factory, hf_llama_words, max_queue_size=1200, batch_scheduler_policy="max_utilization")
    with server:
        yield spec, ws, server


def kv_gauges(server, settle=lambda g: True, timeout=10.0) -> dict:
    """nv_trt_llm_kv_cache_block_metrics of tensorrt_llm, once `settle` holds (gauges refresh every 100 ms)."""
    from toolchain.bench.servermetrics import scrape

    deadline = time.monotonic() + timeout
    while True:
        got = scrape(server.metrics_url) or {}
        gauges = {dict(labels)["kv_cache_block_type"]: v for (name, labels), v in got.items()
                  if name == "nv_trt_llm_kv_cache_block_metrics" and dict(labels).get("model") == "tensorrt_llm"}
        if (gauges and settle(gauges)) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def engine_tokens(served, prompts, n):
    from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SamplingParams

    spec, ws, _ = served
    engine = CpuEngine.load(ws.engine_dir(spec), kv_cache=KvCacheConfig(tokens_per_block=TPB, max_tokens=POOL_TOKENS))
    return [engine.generate(p, SamplingParams(max_new_tokens=n)) for p in prompts]


def test_reused_prefix_blocks_are_reported_per_request(served):
    _, _, server = served
    system = [(i * 13) % 200 + 3 for i in range(2 * TPB)]
    counts = []
    for user in ([7, 8, 9], [40, 41]):
        got = stream(server.grpc_url, "tensorrt_llm", token_request(system + user, 4, return_perf_metrics=([True], "BOOL")))
        assert not got.errors
        last = got.responses[-1]
        counts.append({k: int(last.as_numpy(k).reshape(-1)[0])
                       for k in ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")})
    assert counts[0]["kv_cache_reused_blocks"] == 0 and counts[0]["kv_cache_alloc_total_blocks"] == 3
    assert counts[1]["kv_cache_reused_blocks"] == 2 and counts[1]["kv_cache_alloc_total_blocks"] == 1
    gauges = kv_gauges(server, lambda g: g["reused"] >= 2)
    assert gauges["max"] == POOL_TOKENS // TPB and gauges["tokens_per"] == TPB and gauges["reused"] >= 2
    assert gauges["used"] + gauges["free"] == gauges["max"]


def _send_all(server, requests: dict[str, list], max_tokens: int, cancel_after_first: bool = False):
    """Send every request on one gRPC stream; returns request id -> (token list, error, finals)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    results = {rid: ([], None, 0) for rid in requests}
    first = threading.Event()
    try:
        for rid, prompt in requests.items():
            client.async_stream_infer("tensorrt_llm", token_request(prompt, max_tokens, end_id=([-1], "INT32")),
                                      request_id=rid, enable_empty_final_response=True)
        if cancel_after_first:
            result, error = got.get(timeout=120)
            assert error is None
            first.set()
            client.stop_stream(cancel_requests=True)
            return None
        done = 0
        while done < len(requests):
            result, error = got.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            tokens, err, finals = results[response.id]
            ids = result.as_numpy("output_ids")
            if ids is not None:
                tokens.extend(int(t) for t in ids.reshape(-1))
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                done += 1
            results[response.id] = (tokens, err, finals)
        return results
    finally:
        if not first.is_set():
            client.stop_stream()
        client.close()


def test_a_burst_of_500_streams_completes_in_order(served):
    _, _, server = served
    requests = {f"b{i}": [(i * 7 + j) % 240 + 3 for j in range(4 + i % 9)] for i in range(500)}
    results = _send_all(server, requests, 6)
    distinct = {tuple(p): None for p in requests.values()}
    want = dict(zip(distinct, engine_tokens(served, list(distinct), 6)))
    for rid, prompt in requests.items():
        tokens, _, finals = results[rid]
        assert finals == 1 and tokens == want[tuple(prompt)], rid  # streamed pieces in order add up to the whole


def test_a_thousand_cancelled_streams_leave_no_block_in_use(served):
    _, _, server = served
    requests = {f"c{i}": [(i * 11 + j) % 240 + 3 for j in range(20)] for i in range(1000)}
    _send_all(server, requests, 120, cancel_after_first=True)
    gauges = kv_gauges(server, lambda g: g["used"] == 0, timeout=60)
    assert gauges["used"] == 0 and gauges["free"] == gauges["max"]
    after = stream(server.grpc_url, "tensorrt_llm", token_request([5, 6, 7], 3))
    assert not after.errors and len(after.tokens()) == 3  # and the server still serves


def test_a_full_queue_is_a_triton_error_naming_the_limit(tmp_path_factory, hf_llama_words):
    # Long generations (500 tokens, the model's 512 positions) so the first eight are still
    # running while the rest arrive, however fast the host is.
    long = {**LIMITS, "max_seq_len": 512}
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=long, build={"tokens_per_block": TPB},
                              serving={"max_tokens_in_paged_kv_cache": 8 * 512, "max_queue_size": 2})
    import tritonclient.grpc as grpcclient

    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        errors, finals, started = [], 0, set()

        def take(timeout=120):
            nonlocal finals
            result, error = got.get(timeout=timeout)
            if error is not None:
                errors.append(str(error))
                return
            response = result.get_response()
            started.add(response.id)
            if response.parameters["triton_final_response"].bool_param:
                finals += 1

        def send(i):
            client.async_stream_infer("tensorrt_llm", token_request([3 + i, 4, 5], 500, end_id=([-1], "INT32")),
                                      request_id=f"q{i}", enable_empty_final_response=True)

        try:
            # Each of the first eight (max_batch_size) is streaming before the next is sent. The
            # next six go one by one too, so Triton's own queue (also max_queue_size, "Exceeds maximum
            # queue size") drains into the model each time: 2 wait in the executor, the rest are refused.
            for i in range(8):
                send(i)
                while f"q{i}" not in started and not errors:
                    take()
            for i in range(8, 14):
                send(i)
                time.sleep(0.05)
            while finals + len(errors) < 14:
                take()
        finally:
            client.stop_stream()
            client.close()
        assert errors and finals >= 8, (errors, finals)
        executor = [e for e in errors if "Maximum queue size of 2 has been reached, please try again later" in e]
        assert executor and all(e in executor or "Exceeds maximum queue size" in e for e in errors)


BAD_INPUTS = [
    ("tensorrt_llm", lambda: token_request(list(range(3, 3 + LIMITS["max_input_len"] + 1)), 4), "max_input_len"),
    ("tensorrt_llm", lambda: token_request([5, 6, 7], 0), "request_output_len"),
    ("tensorrt_llm", lambda: token_request([5, 6, 7], -3), "request_output_len"),
    ("tensorrt_llm", lambda: token_request([5, 6, 7], LIMITS["max_seq_len"]), "max_seq_len"),
    ("tensorrt_llm", lambda: token_request([5, 300, 7], 4), "vocabulary"),
    ("tensorrt_llm", lambda: token_request([5, 6], 4, temperature=([-1.0], "FP32")), "temperature"),
    ("tensorrt_llm", lambda: token_request([5, 6], 4, runtime_top_p=([1.5], "FP32")), "top_p"),
    ("tensorrt_llm", lambda: token_request([5, 6], 4, runtime_top_k=([-2], "INT32")), "top_k"),
    ("ensemble", lambda: text_request("", 4), "prompt"),
    ("ensemble", lambda: text_request(b"w5 \xff\xfe w6", 4), "UTF-8"),
    ("ensemble", lambda: text_request("w5 w6", 0), "max_tokens"),
    # A megabyte of text is refused before it is tokenized (it could never fit max_input_len).
    ("ensemble", lambda: text_request("w5 " * 400_000, 4), "cannot fit the engine's max_input_len"),
]


@pytest.mark.parametrize("model, inputs, names", BAD_INPUTS, ids=[f"{m}-{n}" for m, _, n in BAD_INPUTS])
def test_bad_input_is_a_triton_error_naming_it(served, model, inputs, names):
    _, _, server = served
    got = stream(server.grpc_url, model, inputs())
    assert got.errors and not got.responses
    assert names.lower() in str(got.errors[0]).lower(), str(got.errors[0])
    assert server.ready


def test_draft_tokens_to_an_engine_without_speculation_are_a_triton_error(served):
    _, _, server = served
    got = stream(server.grpc_url, "tensorrt_llm", token_request([5, 6, 7], 4, draft_input_ids=([8, 9], "INT32")))
    assert got.errors and "built without speculative decoding" in str(got.errors[0])


def test_draft_input_ids_are_verified_with_the_backends_acceptance_outputs(tmp_path_factory, hf_llama_words):
    """The tensorrt_llm request contract of draft-target decoding (what upstream's BLS sends the
    target): draft_input_ids verified in the context step, acceptance figures with
    return_perf_metrics, output unchanged. The engine is marked as built with max_draft_len 4,
    as trtllm-build records it in config.json."""
    import json

    spec, ws, server = deploy_with(tmp_path_factory, hf_llama_words)
    config_path = ws.engine_dir(spec) / "config.json"
    config = json.loads(config_path.read_text())
    config["build_config"]["max_draft_len"] = 4
    config_path.write_text(json.dumps(config))
    prompt = [(i * 17) % 200 + 3 for i in range(9)]
    with server:
        plain = stream(server.grpc_url, "tensorrt_llm", token_request(prompt, 8, end_id=([-1], "INT32")))
        want = plain.tokens()
        wrong = [(t + 1) % 240 + 3 for t in want]
        for draft, accepted in ((want[:4], 4), (want[:1] + wrong[1:3], 1), (wrong[:3], 0)):
            got = stream(server.grpc_url, "tensorrt_llm",
                         token_request(prompt, 8, end_id=([-1], "INT32"), draft_input_ids=(draft, "INT32"),
                                       return_perf_metrics=([True], "BOOL")))
            assert not got.errors and got.tokens() == want
            last = got.responses[-1]
            assert int(last.as_numpy("total_draft_tokens").reshape(-1)[0]) == len(draft)
            assert int(last.as_numpy("total_accepted_draft_tokens").reshape(-1)[0]) == accepted
            assert abs(float(last.as_numpy("acceptance_rate").reshape(-1)[0]) - accepted / len(draft)) < 1e-6
            assert len(got.responses[0].as_numpy("output_ids").reshape(-1)) == accepted + 1  # one step's tokens
