"""End to end: the embedded tiny model through every stage and a real
tritonserver; streamed text from the ensemble and the BLS must equal the CPU
engine's own greedy output."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_TRAINED, starts_server
from toolchain.cli import main
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="embedded model missing")]

REPO = Path(__file__).resolve().parents[1]
FREE_PORTS = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0"]
PROMPTS = ["def main(argv):\n    ", "import os\n\nclass Path", "    return self."]
MAX_TOKENS = 12


def _stream_text(client, model: str, prompt: str, stream: bool) -> str:
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        arr = np.array([[value]], dtype=object if dtype == "BYTES" else None)
        if dtype != "BYTES":
            arr = arr.astype({"INT32": np.int32, "BOOL": np.bool_}[dtype])
        t = grpcclient.InferInput(name, arr.shape, dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = [tensor("text_input", prompt.encode(), "BYTES"), tensor("max_tokens", MAX_TOKENS, "INT32"),
              tensor("stream", stream, "BOOL")]
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id="1", enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                pieces.append(b"".join(x if isinstance(x, bytes) else x.encode() for x in out.reshape(-1)).decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    return "".join(pieces)


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory):
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer

    spec = load_spec(REPO / "build" / "tiny-llama.yaml", FREE_PORTS)
    ws = Workspace(tmp_path_factory.mktemp("ws"))
    run_convert(spec, ws)
    run_build(spec, ws)
    run_model_repo(spec, ws)
    with TritonServer(ws.model_repo_dir(spec), host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0) as server:
        server.start(timeout=180) if not getattr(server, "ready", False) else None
        yield spec, ws, server


@pytest.fixture(scope="module")
def expected(served):
    from transformers import AutoTokenizer

    from toolchain.engine.cpu import CpuEngine, SamplingParams

    spec, ws, _ = served
    tok = AutoTokenizer.from_pretrained(spec.model.tokenizer_dir)
    engine = CpuEngine.load(ws.engine_dir(spec))
    out = {}
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        new = engine.generate(ids, SamplingParams(max_new_tokens=MAX_TOKENS, end_id=tok.eos_token_id))
        out[prompt] = tok.decode(new, skip_special_tokens=True)
    return out


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("stream", [True, False])
def test_served_text_equals_engine_greedy(served, expected, model, stream):
    import tritonclient.grpc as grpcclient

    _, _, server = served
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for prompt in PROMPTS:
        text = _stream_text(client, model, prompt, stream)
        assert text.endswith(expected[prompt]), (model, stream, prompt, text, expected[prompt])
        assert expected[prompt].strip(), "the engine generated nothing to compare"


def test_cpu_engine_exports_the_trt_llm_metric_families(served):
    """After the requests above, /metrics carries the TensorRT-LLM backend's families (triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/)
    with the engine's numbers: the batch limit, iterations run, and one histogram sample per request."""
    import time

    import tritonclient.grpc as grpcclient

    from toolchain.bench.servermetrics import scrape

    _, ws, server = served
    _stream_text(grpcclient.InferenceServerClient(server.grpc_url), "ensemble", PROMPTS[0], True)
    limits = json.loads((ws.engine_dir(served[0]) / "config.json").read_text())["build_config"]
    deadline = time.monotonic() + 5
    while True:  # the gauges are refreshed every stats_check_period_ms (100 ms)
        got = scrape(server.metrics_url)
        values = {(name, dict(labels).get("request_type") or dict(labels).get("general_type")): v
                  for (name, labels), v in (got or {}).items() if dict(labels).get("model") == "tensorrt_llm"}
        if values.get(("nv_trt_llm_general_metrics", "iteration_counter"), 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values[("nv_trt_llm_request_metrics", "max")] == limits["max_batch_size"]
    assert values[("nv_trt_llm_general_metrics", "iteration_counter")] >= 1
    assert {"active", "scheduled", "context", "waiting"} <= {k for n, k in values if n == "nv_trt_llm_request_metrics"}
    done = values.get(("nv_llm_output_token_len_count", None))
    assert done is not None and done >= 1
    assert values[("nv_llm_output_token_len_sum", None)] >= done  # every request generated tokens


def test_deploy_command_writes_report(tmp_path, capsys):
    root = tmp_path / "ws"
    argv = ["--root", str(root), "deploy", str(REPO / "build" / "tiny-llama.yaml")]
    for item in FREE_PORTS + ["validation.workload.num_requests=6", "validation.workload.warmup_requests=1",
                              "validation.workload.output_tokens=8", "validation.workload.input_tokens=16"]:
        argv += ["--set", item]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((root / "reports" / "tiny-llama" / "report.json").read_text())
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert {"p50", "p90", "p99", "mean"} <= set(report[key])
    assert report["num_requests"] == 6
    assert report["output_tokens_per_s"] > 0 and report["requests_per_s"] > 0
    assert report["slo"]["passed"] is True
    assert set(report["stage_seconds"]) >= {"convert", "build-engine", "model-repo", "serve", "bench"}
    assert list(report)[-2:] == ["plots", "stage_seconds"]  # the bench's report, then deploy's timings
