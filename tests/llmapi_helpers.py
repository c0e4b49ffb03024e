"""Serving a checkpoint on target llmapi-cpu for end-to-end tests: Triton's llmapi request contract
(`llmapi_inputs`, `collect`, `texts`), one deployment through convert, model-repo and the Triton server
(`serve_llmapi_cpu`), and the OpenAI server's greedy completion from the same LLM() arguments
(`openai_completion`). Test modules of any family or format use these instead of repeating the setup."""

from __future__ import annotations

import contextlib
import json
import queue
import urllib.request
from pathlib import Path

import numpy as np

from conftest import write_spec
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

# Ports picked by the OS, and a KV pool small enough for a tiny model on a shared CI host.
SERVING = {"http_port": 0, "grpc_port": 0, "metrics_port": 0, "max_tokens_in_paged_kv_cache": 1024}
LIMITS = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256}


def llmapi_inputs(prompt: str, **values) -> list:
    """One request of the llmapi contract (max_batch_size 0: the declared dims are the whole shape)."""
    import tritonclient.grpc as grpcclient

    kinds = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    out = [text]
    for name, value in values.items():
        if isinstance(value, list):  # sampling_param_stop: strings
            t = grpcclient.InferInput(name, [len(value)], "BYTES")
            t.set_data_from_numpy(np.array([v.encode() for v in value], dtype=object))
        else:
            dtype, np_type = kinds[type(value)]
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np_type))
        out.append(t)
    return out


def collect(url: str, inputs: list, request_id: str = "r1", timeout: float = 60.0):
    """Stream one request to the tensorrt_llm model; (responses, error strings) up to the final response."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    responses, errors = [], []
    try:
        client.async_stream_infer("tensorrt_llm", inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=timeout)
            if error is not None:
                errors.append(str(error))
                break
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, errors


def texts(responses) -> list[str]:
    return [r.as_numpy("text_output")[0].decode() for r in responses if r.as_numpy("text_output") is not None]


def greedy_text(url: str, prompt: str, max_tokens: int) -> str:
    """Triton's greedy completion of `prompt` (the last streamed text, the prompt excluded)."""
    responses, errors = collect(url, llmapi_inputs(prompt, sampling_param_max_tokens=max_tokens,
                                                   sampling_param_top_k=1,
                                                   sampling_param_exclude_input_from_output=True))
    assert not errors, errors
    return texts(responses)[-1]


def deploy_llmapi_cpu(root: Path, checkpoint: Path, *, name: str = "test-model", **sections):
    """Convert `checkpoint` for target llmapi-cpu and render its repository; (spec, ws). Keyword arguments are spec
    sections over LIMITS, SERVING and an OS-picked OpenAI port."""
    from toolchain.pipeline import convert_for, model_repo_for

    sections = {"limits": LIMITS, "serving": SERVING, "llmapi": {"openai_port": 0}, **sections}
    spec = load_spec(write_spec(root / "spec.yaml", checkpoint, name=name, target="llmapi-cpu", **sections))
    ws = Workspace(root)
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    return spec, ws


@contextlib.contextmanager
def serve_llmapi_cpu(root: Path, checkpoint: Path, *, name: str = "test-model", **sections):
    """`deploy_llmapi_cpu`, then serve it with Triton; yields (spec, ws, server)."""
    from toolchain.pipeline import server_for

    spec, ws = deploy_llmapi_cpu(root, checkpoint, name=name, **sections)
    with server_for(spec, ws, log_path=root / "server.log") as server:
        yield spec, ws, server


def openai_completion(api, prompt: str, max_tokens: int) -> str:
    """The OpenAI server's greedy /v1/completions text for `prompt`."""
    body = json.dumps({"model": api.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                       "top_k": 1}).encode()
    req = urllib.request.Request(f"{api.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]
