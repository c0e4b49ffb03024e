"""Reliability of a real deployment of the embedded default (build/tiny-llama.yaml, CPU engine, tritonserver).

Five parts, each against what the server itself says (readiness, /metrics, its log, /proc):

- (a) hostile requests: malformed requests over gRPC (tritonclient and raw, truncated protobufs) and
  HTTP (generate, generate_stream, infer) to every model, interleaved with valid requests whose outputs
  are checked against the CPU engine's greedy output;
- (b) cancellation storm: streams cancelled at random points, by closing the client stream and by the
  `stop` input with the request id; KV blocks, active requests, stub threads and RSS before/after;
- (c) soak: open-loop load at ~80 % of the measured saturation rate (toolchain.bench, mode rate);
- (d) crash safety: kill -9 of `toolchain convert`, `build-engine` and `model-repo` at random points;
  the final directory is never a partial one and the rerun is byte-identical to an uninterrupted run;
- (e) a dying model instance: the tensorrt_llm stub killed with requests in flight, and during load.
  The figures (`dying_instance.hung_requests`, `time_to_detect_s`) are those of the path users run,
  `toolchain serve` (a subprocess): it watches for dead stubs and on one stops tritonserver, which ends
  every in-flight request (the connection closes), prints one line naming the instance and exits non-zero;
  no tritonserver, stub or /dev/shm region of it may be left. The same kill under a bare TritonServer
  object, with nothing watching it, is kept for information only (`hung_requests_bare_tritonserver`,
  the section's `bare_tritonserver`): tritonserver 2.51 never ends the requests in flight on a dead
  Python-backend stub, nor restarts it, nor stops answering ready, so there every request hangs; that is
  the server's behaviour the serve loop exists to contain, not a figure of the deployment.

    python benchmarks/reliability.py [--json PATH] [--quick] [--soak-s S] [--parts abcde]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

SPEC = REPO / "build" / "tiny-llama.yaml"
MODELS = ("ensemble", "tensorrt_llm", "tensorrt_llm_bls", "preprocessing", "postprocessing")
REQUEST_TIMEOUT_S = 30.0
STAGES = ("convert", "build-engine", "model-repo")
TARGETS = {"server_crashes": 0, "model_instance_deaths": 0, "valid_outputs_wrong": 0, "unanswered_requests": 0,
           "kv_or_slots_leaked": 0, "threads_leaked": 0, "cancel_rss_growth_pct": 5, "kills_rerun_mismatches": 0,
           "partial_outputs_used": 0, "hung_requests": 0}
LOG_DEATH = re.compile(r"Stub process .* (is not healthy|unhealthy)|stub .*died|Segmentation fault|"
                       r"terminate called|Failed to (initialize|restart) stub|signal \d+ received", re.I)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the deployment --------------------------------------------------------------------------------------------

def load_default_spec(overrides=()):
    from toolchain.spec import load_spec

    return load_spec(SPEC, ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0", *overrides])


def deploy(root: Path, overrides=()):
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer
    from toolchain.workspace import Workspace

    spec = load_default_spec(overrides)
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws, converted=True)
    run_model_repo(spec, ws)
    return spec, ws, TritonServer.from_spec(spec, ws.model_repo_dir(spec), log_path=root / "server.log")


def http_get(url: str, timeout: float = 2.0) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except Exception:
        return None


def models_ready(server) -> dict[str, bool]:
    return {m: http_get(f"{server.http_url}/v2/models/{m}/ready") == 200 for m in MODELS}


# -- /proc -----------------------------------------------------------------------------------------------------

def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def rss_kb(pid: int) -> int:
    return int(_status(pid).get("VmRSS", "0 kB").split()[0])


def threads(pid: int) -> int:
    return int(_status(pid).get("Threads", "0"))


def stub_pids(server_pid: int) -> dict[str, int]:
    """model -> pid of its triton_python_backend_stub (children of the server whose cmdline names it)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_status(int(entry.name)).get("PPid", "-1")) != server_pid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if not argv or not argv[0].endswith(b"triton_python_backend_stub"):
            continue
        for m in MODELS:
            if any(a.endswith(f"/{m}/1/model.py".encode()) for a in argv):
                out[m] = int(entry.name)
    return out


def kv_and_active(metrics_url: str) -> dict:
    from toolchain.bench.servermetrics import scrape

    got = scrape(metrics_url) or {}
    out = {}
    for (name, labels), v in got.items():
        lab = dict(labels)
        if lab.get("model") != "tensorrt_llm":
            continue
        if name == "nv_trt_llm_kv_cache_block_metrics":
            out["kv_" + lab["kv_cache_block_type"]] = v
        elif name == "nv_trt_llm_request_metrics":
            out["req_" + lab["request_type"]] = v
    return out


def wait_idle(metrics_url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        g = kv_and_active(metrics_url)
        if (g.get("kv_used") == 0 and g.get("req_active") == 0) or time.monotonic() > deadline:
            return g
        time.sleep(0.25)


# -- requests --------------------------------------------------------------------------------------------------

class Http:
    """One keep-alive HTTP/1.1 connection per thread, reopened after any failure."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.local = threading.local()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.timeout = timeout
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
                self.local.conn = None
            return resp.status, data
        except BaseException:
            conn.close()
            self.local.conn = None
            raise


class Grpc:
    """A tritonclient gRPC client per thread, and raw channels for hand-made bytes."""

    def __init__(self, url: str):
        self.url = url
        self.local = threading.local()

    def client(self):
        import tritonclient.grpc as grpcclient

        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = grpcclient.InferenceServerClient(self.url)
        return c

    def stream(self, model: str, inputs: list, timeout: float = REQUEST_TIMEOUT_S, request_id: str = "r",
               parameters: dict | None = None) -> tuple[str, list]:
        """One request on a fresh stream: ('ok', token/text pieces) / ('error', msg) / ('timeout', ...)."""
        c = self.client()
        got: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        pieces = []
        try:
            c.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True,
                                 parameters=parameters)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    result, error = got.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    return "timeout", pieces
                if error is not None:
                    return "error", [str(error)]
                response = result.get_response()
                if response.outputs:
                    pieces.append(result)
                if response.parameters["triton_final_response"].bool_param:
                    return "ok", pieces
        except Exception as err:
            return "error", [str(err)]
        finally:
            try:
                c.stop_stream()
            except Exception:
                self.local.client = None

    def unary(self, model: str, inputs: list, timeout: float = REQUEST_TIMEOUT_S) -> tuple[str, object]:
        from tritonclient.utils import InferenceServerException

        try:
            return "ok", self.client().infer(model, inputs, client_timeout=timeout)
        except InferenceServerException as err:
            if "Deadline" in str(err) or "DEADLINE" in str(err.status() or ""):
                return "timeout", str(err)
            return "error", str(err)

    def raw(self, method: str, payload: bytes, stream: bool = False, timeout: float = REQUEST_TIMEOUT_S) -> str:
        import grpc

        ch = getattr(self.local, "channel", None)
        if ch is None:
            ch = self.local.channel = grpc.insecure_channel(self.url)
        path = f"/inference.GRPCInferenceService/{method}"
        try:
            if stream:
                call = ch.stream_stream(path)(iter([payload]), timeout=timeout)
                for _ in call:
                    pass
            else:
                ch.unary_unary(path)(payload, timeout=timeout)
            return "ok"
        except grpc.RpcError as err:
            return "timeout" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "error"


def arr_input(name: str, value, dtype: str, shape=None):
    import tritonclient.grpc as grpcclient

    from triton_helpers import tensor

    if shape is None:
        return tensor(name, value, dtype)
    t = grpcclient.InferInput(name, list(shape), dtype)
    if value is not None:
        t.set_data_from_numpy(value)
    return t


# -- (a) hostile requests ---------------------------------------------------------------------------------------

def _long_text(words: int) -> str:
    return " ".join(f"def f{i}(x):" for i in range(words // 2))


def hostile_catalog(tokenizer_vocab: int, max_input_len: int, huge_bytes: int):
    """(name, protocol, fn(ctx, rng) -> status) for every malformed request kind."""
    from triton_helpers import text_request, token_request

    def jpost(path, body):
        def run(ctx, rng):
            payload = body(rng) if callable(body) else body
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            ctx.http.request("POST", path, data)
            return "answered"
        return run

    def jgen(model, body, stream=False):
        return jpost(f"/v2/models/{model}/{'generate_stream' if stream else 'generate'}", body)

    def jinfer(model, body):
        return jpost(f"/v2/models/{model}/infer", body)

    def gstream(model, inputs_fn):
        def run(ctx, rng):
            status, _ = ctx.grpc.stream(model, inputs_fn(rng), request_id=f"h{rng.randrange(10**9)}")
            return "unanswered" if status == "timeout" else "answered"
        return run

    def gunary(model, inputs_fn):
        def run(ctx, rng):
            status, _ = ctx.grpc.unary(model, inputs_fn(rng))
            return "unanswered" if status == "timeout" else "answered"
        return run

    def raw(method, stream=False, mode="truncate"):
        def run(ctx, rng):
            blob = ctx.valid_infer_bytes
            if mode == "truncate":
                payload = blob[:rng.randrange(1, len(blob))]
            elif mode == "flip":
                b = bytearray(blob)
                for _ in range(rng.randrange(1, 8)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                payload = bytes(b)
            else:
                payload = rng.randbytes(rng.randrange(1, 512))
            return "unanswered" if ctx.grpc.raw(method, payload, stream=stream) == "timeout" else "answered"
        return run

    big = max_input_len * 4
    V = tokenizer_vocab
    _f32, i32 = np.float32, np.int32
    cat = []
    text_models = ("ensemble", "tensorrt_llm_bls")
    for m in text_models:
        for stream in (False, True):
            sfx = "_stream" if stream else ""
            cat += [
                (f"{m}-http{sfx}-missing-all", "http", jgen(m, {}, stream)),
                (f"{m}-http{sfx}-missing-max_tokens", "http", jgen(m, {"text_input": "def f"}, stream)),
                (f"{m}-http{sfx}-missing-text", "http", jgen(m, {"max_tokens": 4}, stream)),
                (f"{m}-http{sfx}-text-is-number", "http", jgen(m, {"text_input": 5, "max_tokens": 4}, stream)),
                (f"{m}-http{sfx}-max_tokens-string", "http", jgen(m, {"text_input": "x", "max_tokens": "abc"}, stream)),
                (f"{m}-http{sfx}-max_tokens-float", "http", jgen(m, {"text_input": "x", "max_tokens": 1.5}, stream)),
                (f"{m}-http{sfx}-shape", "http", jgen(m, {"text_input": [["a", "b"], ["c"]], "max_tokens": [1, 2, 3]},
                                                      stream)),
                (f"{m}-http{sfx}-max_tokens-0", "http", jgen(m, {"text_input": "def f", "max_tokens": 0}, stream)),
                (f"{m}-http{sfx}-max_tokens-neg", "http", jgen(m, {"text_input": "def f", "max_tokens": -7}, stream)),
                (f"{m}-http{sfx}-max_tokens-huge", "http", jgen(m, {"text_input": "def f", "max_tokens": 2**31 - 1},
                                                                stream)),
                (f"{m}-http{sfx}-max_tokens-overflow", "http", jgen(m, {"text_input": "def f", "max_tokens": 10**15},
                                                                    stream)),
                (f"{m}-http{sfx}-long-prompt", "http", jgen(m, {"text_input": _long_text(big), "max_tokens": 4},
                                                            stream)),
                (f"{m}-http{sfx}-stop-number", "http", jgen(m, {"text_input": "x", "max_tokens": 4, "stop_words": 5},
                                                            stream)),
                (f"{m}-http{sfx}-stop-nested", "http", jgen(m, {"text_input": "x", "max_tokens": 4,
                                                                "stop_words": [["a", ["b"]]]}, stream)),
                (f"{m}-http{sfx}-bad-empty", "http", jgen(m, {"text_input": "x", "max_tokens": 4,
                                                              "bad_words": ["", "\udcff"]}, stream)),
                (f"{m}-http{sfx}-temperature", "http", jgen(m, lambda r: {"text_input": "x", "max_tokens": 4,
                                                                          "temperature": r.choice([-1.0, 1e30, -0.0])},
                                                            stream)),
                (f"{m}-http{sfx}-nan", "http", jgen(m, b'{"text_input":"x","max_tokens":4,"top_p":NaN,'
                                                       b'"temperature":Infinity}', stream)),
                (f"{m}-http{sfx}-top_p", "http", jgen(m, lambda r: {"text_input": "x", "max_tokens": 4,
                                                                    "top_p": r.choice([2.0, -0.5])}, stream)),
                (f"{m}-http{sfx}-top_k", "http", jgen(m, lambda r: {"text_input": "x", "max_tokens": 4,
                                                                    "top_k": r.choice([-5, 2**31 - 1])}, stream)),
                (f"{m}-http{sfx}-penalties", "http", jgen(m, {"text_input": "x", "max_tokens": 4, "repetition_penalty": 0,
                                                              "presence_penalty": -1e9, "length_penalty": -3,
                                                              "min_tokens": -1}, stream)),
                (f"{m}-http{sfx}-seed-neg", "http", jgen(m, {"text_input": "x", "max_tokens": 4, "seed": -1}, stream)),
                (f"{m}-http{sfx}-beam", "http", jgen(m, {"text_input": "x", "max_tokens": 4, "beam_width": 8,
                                                         "num_return_sequences": 100}, stream)),
                (f"{m}-http{sfx}-bad-json", "http", jgen(m, lambda r: b'{"text_input": "x", "max_tok'[:r.randrange(1, 26)],
                                                         stream)),
                (f"{m}-http{sfx}-invalid-utf8", "http", jgen(m, b'{"text_input":"w5 \xff\xfe\xc3 w6","max_tokens":4}',
                                                             stream)),
                (f"{m}-http{sfx}-junk", "http", jgen(m, lambda r: r.randbytes(r.randrange(1, 300)), stream)),
                (f"{m}-http{sfx}-array-body", "http", jgen(m, b'[1,2,3]', stream)),
            ]
        cat += [
            (f"{m}-grpc-missing-max_tokens", "grpc", gstream(m, lambda r: text_request("x", 4)[:1])),
            (f"{m}-grpc-text-as-int", "grpc", gstream(m, lambda r: [arr_input("text_input", [5], "INT32"),
                                                                      arr_input("max_tokens", [4], "INT32")])),
            (f"{m}-grpc-max_tokens-fp32", "grpc", gstream(m, lambda r: [arr_input("text_input", "x", "BYTES"),
                                                                          arr_input("max_tokens", [4.0], "FP32")])),
            (f"{m}-grpc-shape", "grpc", gstream(m, lambda r: [arr_input("text_input", np.array([[b"a", b"b"]], object),
                                                                          "BYTES", [1, 2]),
                                                                arr_input("max_tokens", np.array([[1, 2, 3]], i32),
                                                                          "INT32", [1, 3])])),
            (f"{m}-grpc-batch-9", "grpc", gstream(m, lambda r: [arr_input("text_input", np.array([[b"x"]] * 9, object),
                                                                            "BYTES", [9, 1]),
                                                                  arr_input("max_tokens", np.full((9, 1), 4, i32),
                                                                            "INT32", [9, 1])])),
            (f"{m}-grpc-invalid-utf8", "grpc", gstream(m, lambda r: text_request(b"w5 \xff\xfe\xc3\x28 w6", 4))),
            (f"{m}-grpc-empty", "grpc", gstream(m, lambda r: text_request("", 4))),
            (f"{m}-grpc-long-prompt", "grpc", gstream(m, lambda r: text_request(_long_text(big), 4))),
            (f"{m}-grpc-max_tokens", "grpc", gstream(m, lambda r: text_request("def f", r.choice([0, -1, 2**31 - 1])))),
            (f"{m}-grpc-stop-bytes", "grpc", gstream(m, lambda r: text_request(
                "def f", 4, stop_words=([b"\xff\xfe", "", "x" * 5000], "BYTES"), bad_words=([b"\x80"], "BYTES")))),
            (f"{m}-grpc-sampling", "grpc", gstream(m, lambda r: text_request(
                "def f", 4, temperature=([r.choice([-1.0, float("nan"), float("inf")])], "FP32"),
                top_p=([r.choice([2.0, -1.0, float("nan")])], "FP32"), top_k=([r.choice([-3, 2**31 - 1])], "INT32")))),
            (f"{m}-grpc-seed-huge", "grpc", gstream(m, lambda r: text_request("def f", 4, seed=([2**64 - 1], "UINT64")))),
            (f"{m}-grpc-declared-shape-lies", "grpc", gstream(m, lambda r: [
                arr_input("text_input", np.array([[b"x"]], object), "BYTES", [1, 1]),
                arr_input("max_tokens", None, "INT32", [1, 1])])),  # no data for a declared tensor
        ]
    trt = "tensorrt_llm"
    tok = lambda r, n=4: [r.randrange(3, V) for _ in range(n)]  # noqa: E731
    cat += [
        ("trt-grpc-missing-input_lengths", "grpc", gstream(trt, lambda r: [arr_input("input_ids", tok(r), "INT32"),
                                                                              arr_input("request_output_len", [4], "INT32")])),
        ("trt-grpc-missing-all", "grpc", gstream(trt, lambda r: [arr_input("streaming", [True], "BOOL")])),
        ("trt-grpc-ids-fp32", "grpc", gstream(trt, lambda r: [arr_input("input_ids", [1.5, 2.5], "FP32"),
                                                                 arr_input("input_lengths", [2], "INT32"),
                                                                 arr_input("request_output_len", [4], "INT32")])),
        ("trt-grpc-oov", "grpc", gstream(trt, lambda r: token_request([5, r.choice([-1, V, 2**31 - 1]), 7], 4))),
        ("trt-grpc-length-lies", "grpc", gstream(trt, lambda r: [
            arr_input("input_ids", tok(r), "INT32"), arr_input("input_lengths", [r.choice([0, -1, 9, 10**6])], "INT32"),
            arr_input("request_output_len", [4], "INT32")])),
        ("trt-grpc-empty-ids", "grpc", gstream(trt, lambda r: [
            arr_input("input_ids", np.zeros((1, 0), i32), "INT32", [1, 0]), arr_input("input_lengths", [0], "INT32"),
            arr_input("request_output_len", [4], "INT32")])),
        ("trt-grpc-too-long", "grpc", gstream(trt, lambda r: token_request(tok(r, max_input_len + 1 + r.randrange(500)),
                                                                              4))),
        ("trt-grpc-output-len", "grpc", gstream(trt, lambda r: token_request(tok(r), r.choice([0, -3, 2**31 - 1, 10**6])))),
        ("trt-grpc-sampling", "grpc", gstream(trt, lambda r: token_request(
            tok(r), 4, temperature=([r.choice([-1.0, float("nan")])], "FP32"),
            runtime_top_p=([r.choice([1.5, -0.1])], "FP32"), runtime_top_k=([r.choice([-2, 2**31 - 1])], "INT32")))),
        ("trt-grpc-penalties", "grpc", gstream(trt, lambda r: token_request(
            tok(r), 4, repetition_penalty=([0.0], "FP32"), min_tokens=([-5], "INT32"), len_penalty=([float("inf")], "FP32"),
            beam_width=([r.choice([0, 2, 64])], "INT32"), num_return_sequences=([r.choice([0, -1, 50])], "INT32")))),
        ("trt-grpc-end_id", "grpc", gstream(trt, lambda r: token_request(tok(r), 4, end_id=([r.choice([-9, V + 5])], "INT32"),
                                                                            pad_id=([-7], "INT32")))),
        ("trt-grpc-stop-words-shape", "grpc", gstream(trt, lambda r: token_request(tok(r), 4) + [
            arr_input("stop_words_list", np.array(r.choice([[[[5, 6], [9, -1]]], [[[5, 6, 7], [1, 9, 2]]], [[[5], [-4]]]]),
                                                  i32), "INT32", None)])),
        ("trt-grpc-stop-words-rank", "grpc", gstream(trt, lambda r: token_request(tok(r), 4) + [
            arr_input("stop_words_list", np.array([[[5, 6, 7]]], i32), "INT32", [1, 1, 3]),
            arr_input("bad_words_list", np.array([[[5, 6], [100, 200]]], i32), "INT32", [1, 2, 2])])),
        ("trt-grpc-draft", "grpc", gstream(trt, lambda r: token_request(tok(r), 4, draft_input_ids=(tok(r, 9), "INT32")))),
        ("trt-grpc-embedding-bias", "grpc", gstream(trt, lambda r: token_request(
            tok(r), 4, embedding_bias=([1.0] * r.choice([1, V + 3]), "FP32")))),
        ("trt-grpc-stop-unknown-id", "grpc", gstream(trt, lambda r: token_request(tok(r), 4, stop=([True], "BOOL")))),
        ("trt-grpc-non-streaming", "grpc", gstream(trt, lambda r: token_request(tok(r), 4, stream=False))),
        ("trt-grpc-batch-9", "grpc", gstream(trt, lambda r: [
            arr_input("input_ids", np.full((9, 3), 5, i32), "INT32", [9, 3]),
            arr_input("input_lengths", np.full((9, 1), 3, i32), "INT32", [9, 1]),
            arr_input("request_output_len", np.full((9, 1), 4, i32), "INT32", [9, 1])])),
        ("trt-http-generate-missing", "http", jgen(trt, {"input_ids": [5, 6]})),
        ("trt-http-generate-bad", "http", jgen(trt, lambda r: {"input_ids": [5, -1], "input_lengths": 2,
                                                             "request_output_len": r.choice([0, -1, 4])})),
        ("trt-http-generate_stream", "http", jgen(trt, lambda r: {"input_ids": tok(r, 300), "input_lengths": 300,
                                                                "request_output_len": 4}, stream=True)),
        ("trt-http-infer-shape", "http", jinfer(trt, {"inputs": [
            {"name": "input_ids", "shape": [1, 3], "datatype": "INT32", "data": [5, 6]},
            {"name": "input_lengths", "shape": [1, 1], "datatype": "INT32", "data": [3]},
            {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32", "data": [4]}]})),
        ("trt-http-infer-dtype", "http", jinfer(trt, {"inputs": [
            {"name": "input_ids", "shape": [1, 2], "datatype": "FP64", "data": [5.5, 6]},
            {"name": "input_lengths", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]},
            {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32", "data": ["four"]}]})),
        ("trt-http-infer-huge-shape", "http", jinfer(trt, {"inputs": [
            {"name": "input_ids", "shape": [1, 10**12], "datatype": "INT32", "data": [5]},
            {"name": "input_lengths", "shape": [-1, 1], "datatype": "INT32", "data": [3]},
            {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32", "data": [4]}]})),
        ("trt-http-infer-binary-lies", "http", lambda ctx, r: (ctx.http.request(
            "POST", f"/v2/models/{trt}/infer",
            json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT32",
                                    "parameters": {"binary_data_size": 10**9}}]}).encode() + b"\x00" * 7,
            headers={"Inference-Header-Content-Length": "80"}), "answered")[1]),
    ]
    # preprocessing and postprocessing, addressed directly
    for m, body in (("preprocessing", {"inputs": [{"name": "QUERY", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}),
                    ("postprocessing", {"inputs": [{"name": "TOKENS_BATCH", "shape": [1, 1, 2], "datatype": "INT32",
                                                    "data": [5, -9]}]})):
        cat.append((f"{m}-http-infer-missing", "http", jinfer(m, body)))
    cat += [
        ("pre-grpc-missing-len", "grpc", gunary("preprocessing", lambda r: [arr_input("QUERY", "x", "BYTES")])),
        ("pre-grpc-bad", "grpc", gunary("preprocessing", lambda r: [
            arr_input("QUERY", r.choice([b"\xff\xfe", "", _long_text(big)]), "BYTES"),
            arr_input("REQUEST_OUTPUT_LEN", [r.choice([-1, 0, 2**31 - 1])], "INT32"),
            arr_input("BAD_WORDS_DICT", [b"\xc3\x28", ""], "BYTES"), arr_input("STOP_WORDS_DICT", ["x" * 3000], "BYTES"),
            arr_input("END_ID", [-5], "INT32"), arr_input("EMBEDDING_BIAS_WORDS", ["a", "b"], "BYTES"),
            arr_input("EMBEDDING_BIAS_WEIGHTS", [1.0], "FP32")])),
        ("post-grpc-bad-ids", "grpc", gunary("postprocessing", lambda r: [
            arr_input("TOKENS_BATCH", np.array([[[5, r.choice([-1, V, 2**31 - 1]), 7]]], i32), "INT32", [1, 1, 3]),
            arr_input("SEQUENCE_LENGTH", np.array([[r.choice([3, 99, -2])]], i32), "INT32", [1, 1])])),
        ("post-grpc-bad-rank", "grpc", gunary("postprocessing", lambda r: [
            arr_input("TOKENS_BATCH", np.array([[5, 6]], i32), "INT32", [1, 2]),
            arr_input("SEQUENCE_LENGTH", np.array([[2]], i32), "INT32", [1, 1])])),
        ("post-http-infer-bad", "http", jinfer("postprocessing", {"inputs": [
            {"name": "TOKENS_BATCH", "shape": [1, 1, 3], "datatype": "INT32", "data": [5, 6, 99999999]},
            {"name": "SEQUENCE_LENGTH", "shape": [1, 1], "datatype": "INT32", "data": [77]}]})),
        ("unknown-model-http", "http", jinfer("no_such_model", {"inputs": []})),
        ("unknown-model-http-gen", "http", jgen("../ensemble", {"text_input": "x", "max_tokens": 4})),
        ("unknown-version-http", "http", lambda ctx, r: (ctx.http.request(
            "POST", "/v2/models/ensemble/versions/99/generate", b'{"text_input":"x","max_tokens":4}'), "answered")[1]),
        ("unknown-model-grpc", "grpc", gstream("no_such_model", lambda r: text_request("x", 4))),
        ("raw-grpc-truncated-infer", "grpc-raw", raw("ModelInfer")),
        ("raw-grpc-truncated-stream", "grpc-raw", raw("ModelStreamInfer", stream=True)),
        ("raw-grpc-flipped-stream", "grpc-raw", raw("ModelStreamInfer", stream=True, mode="flip")),
        ("raw-grpc-junk", "grpc-raw", raw("ModelInfer", mode="junk")),
        ("raw-grpc-junk-metadata", "grpc-raw", raw("ModelMetadata", mode="junk")),
    ]
    rare = [  # oversized bodies: a few per run
        ("oversized-http-generate", "http", jgen("ensemble", lambda r: {"text_input": "w " * (huge_bytes // 2),
                                                                       "max_tokens": 4})),
        ("oversized-http-junk", "http", jgen("tensorrt_llm_bls", lambda r: b'{"text_input":"' + b"\x41" * huge_bytes)),
        ("oversized-grpc", "grpc", gstream("ensemble", lambda r: text_request("def " * (huge_bytes // 4), 4))),
    ]
    return cat, rare


class Ctx:
    def __init__(self, server):
        self.http = Http(server.http_url)
        self.grpc = Grpc(server.grpc_url)
        self.valid_infer_bytes = b""


def valid_cases(spec, ws, n_cases: int, osl: int):
    """Prompts and the CPU engine's greedy output for them: token ids for tensorrt_llm, texts for the ensemble."""
    from transformers import AutoTokenizer

    from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_dir)
    engine = CpuEngine.load(ws.engine_dir(spec), kv_cache=KvCacheConfig(max_tokens=4096))
    rng = random.Random(7)
    words = ["def", "return", "self", "import", "class", "for", "in", "range", "if", "None", "x", "(", ")", ":"]
    cases = []
    for _i in range(n_cases):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 20)))
        ids = tokenizer.encode(text, add_special_tokens=True)  # as preprocessing does
        want = engine.generate(ids, SamplingParams(max_new_tokens=osl))
        cases.append({"text": text, "ids": ids, "want": want,
                      "want_text": tokenizer.decode(want, skip_special_tokens=True)})
    return cases, tokenizer


def check_valid(ctx: Ctx, case: dict, osl: int, via: str, baseline: dict) -> str:
    """'ok' / 'wrong' / 'unanswered' for one valid request."""
    from triton_helpers import token_request

    if via == "trt-grpc":
        status, pieces = ctx.grpc.stream("tensorrt_llm", token_request(case["ids"], osl, end_id=([-1], "INT32")),
                                         request_id=f"v{random.randrange(10**9)}")
        if status == "timeout":
            return "unanswered"
        if status != "ok":
            return "wrong"
        got = [int(t) for p in pieces for t in p.as_numpy("output_ids").reshape(-1)]
        return "ok" if got == case["want"] else "wrong"
    # the ensemble over HTTP generate, greedy with end_id -1: the text of the engine's tokens
    try:
        status, data = ctx.http.request("POST", "/v2/models/ensemble/generate", json.dumps(
            {"text_input": case["text"], "max_tokens": osl, "end_id": -1}).encode())
    except (TimeoutError, OSError):
        return "unanswered"
    if status != 200:
        return "wrong"
    return "ok" if json.loads(data)["text_output"] == case["want_text"] else "wrong"


def part_a(server, spec, ws, n: int, seed: int = 0) -> dict:
    import tritonclient.grpc.service_pb2 as pb

    from triton_helpers import token_request

    osl = 8
    cases, tokenizer = valid_cases(spec, ws, 24, osl)
    ctx = Ctx(server)
    # the bytes of a valid ModelInfer request (raw gRPC truncations start from it)
    req = pb.ModelInferRequest(model_name="tensorrt_llm", id="raw")
    for t in token_request([5, 6, 7], 4, stream=False):
        req.inputs.append(t._get_tensor())
        req.raw_input_contents.append(t._get_content())
    ctx.valid_infer_bytes = req.SerializeToString()
    # the ensemble's text for each case, before any hostile request, checked against the engine's tokens
    baseline: dict = {}
    ensemble_matches_engine = 0
    for case in cases:
        status, data = ctx.http.request("POST", "/v2/models/ensemble/generate", json.dumps(
            {"text_input": case["text"], "max_tokens": osl, "end_id": -1}).encode())
        baseline[case["text"]] = json.loads(data)["text_output"] if status == 200 else None
        ensemble_matches_engine += baseline[case["text"]] == case["want_text"]
    cat, rare = hostile_catalog(len(tokenizer), spec.limits.max_input_len, 4 << 20)
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        plan.append(("hostile", rng.choice(cat)))
        if i % 10 == 9:
            plan.append(("valid", rng.choice(("trt-grpc", "ensemble-http"))))
    for _j, item in enumerate(rare * max(1, n // 2500)):
        plan.insert(rng.randrange(len(plan)), ("hostile", item))
    pids_before = stub_pids(server.process.pid)
    counts = {"hostile": 0, "valid": 0, "valid_wrong": 0, "unanswered": 0, "not_ready_samples": 0}
    kinds: dict[str, dict] = {}
    lock = threading.Lock()
    wrong_examples: list = []

    def one(k: int):
        kind, item = plan[k]
        r = random.Random(seed * 1_000_003 + k)
        if kind == "valid":
            case = r.choice(cases)
            out = check_valid(ctx, case, osl, item, baseline)
            with lock:
                counts["valid"] += 1
                if out == "wrong":
                    counts["valid_wrong"] += 1
                    if len(wrong_examples) < 5:
                        wrong_examples.append({"via": item, "prompt": case["text"]})
                elif out == "unanswered":
                    counts["unanswered"] += 1
            return
        name, proto, fn = item
        t0 = time.monotonic()
        try:
            out = fn(ctx, r)
        except (TimeoutError, http.client.HTTPException, OSError) as err:
            out = "unanswered" if isinstance(err, TimeoutError) or "timed out" in str(err) else "answered"
            if out == "answered":
                out = "closed"  # the server closed the connection: an answer, counted apart
        dt = time.monotonic() - t0
        with lock:
            counts["hostile"] += 1
            row = kinds.setdefault(name, {"sent": 0, "unanswered": 0, "closed": 0, "max_s": 0.0})
            row["sent"] += 1
            row["max_s"] = max(row["max_s"], round(dt, 3))
            if out == "unanswered":
                counts["unanswered"] += 1
                row["unanswered"] += 1
            elif out == "closed":
                row["closed"] += 1

    t0 = time.monotonic()
    crashed = False
    with ThreadPoolExecutor(max_workers=6) as pool:
        for start in range(0, len(plan), 500):
            list(pool.map(one, range(start, min(start + 500, len(plan)))))
            if server.process.poll() is not None:
                crashed = True
                break
            ready = models_ready(server)
            if not all(ready.values()):
                counts["not_ready_samples"] += 1
                log(f"  (a) models not ready after {start + 500}: {ready}")
            log(f"  (a) {min(start + 500, len(plan))}/{len(plan)} requests, {time.monotonic() - t0:.0f} s")
    pids_after = stub_pids(server.process.pid) if not crashed else {}
    deaths = sum(1 for m in MODELS if pids_before.get(m) != pids_after.get(m))
    log_hits = [line for line in server.log_text().splitlines() if LOG_DEATH.search(line)]
    final_ok = (not crashed) and http_get(f"{server.http_url}/v2/health/ready") == 200
    after = [check_valid(ctx, c, osl, "trt-grpc", baseline) for c in cases[:4]] if final_ok else []
    return {
        "hostile_requests": counts["hostile"],
        "hostile_kinds": len(kinds),
        "valid_requests": counts["valid"],
        "server_crashes": int(crashed or not final_ok),
        "model_instance_deaths": max(deaths, counts["not_ready_samples"], len(log_hits) and 1),
        "valid_outputs_wrong": counts["valid_wrong"] + sum(1 for a in after if a != "ok"),
        "unanswered_requests": counts["unanswered"],
        "ensemble_baseline_matches_engine": f"{ensemble_matches_engine}/{len(cases)}",
        "seconds": round(time.monotonic() - t0, 1),
        "connection_closed_by_server": {k: v["closed"] for k, v in kinds.items() if v["closed"]},
        "slowest_kinds_s": dict(sorted(((k, v["max_s"]) for k, v in kinds.items()), key=lambda kv: -kv[1])[:5]),
        "unanswered_by_kind": {k: v["unanswered"] for k, v in kinds.items() if v["unanswered"]},
        "stub_death_log_lines": log_hits[:5],
        "wrong_examples": wrong_examples,
    }


# -- (b) cancellation storm -------------------------------------------------------------------------------------

def proc_snapshot(server) -> dict:
    pids = stub_pids(server.process.pid)
    trt = pids.get("tensorrt_llm")
    return {"trt_threads": threads(trt) if trt else None,
            "rss_kb": rss_kb(server.process.pid) + sum(rss_kb(p) for p in pids.values()),
            "trt_rss_kb": rss_kb(trt) if trt else None, "server_threads": threads(server.process.pid),
            "rss_kb_by_process": {"tritonserver": rss_kb(server.process.pid),
                                  **{m: rss_kb(p) for m, p in sorted(pids.items())}}}


def cancel_one(url: str, i: int, rng: random.Random, timeout: float = REQUEST_TIMEOUT_S) -> str:
    """One stream cancelled after a random number of responses, by closing the stream or with `stop`."""
    import tritonclient.grpc as grpcclient

    from triton_helpers import token_request

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    rid = f"s{i}"
    prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 120))]
    after = rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 21, 40])
    how = "close" if i % 2 == 0 else "stop"
    try:
        client.async_stream_infer("tensorrt_llm", token_request(prompt, 100, end_id=([-1], "INT32")), request_id=rid,
                                  enable_empty_final_response=True)
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < after:
            try:
                result, error = got.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return "hung"
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return "ended-early"
            seen += 1
        if how == "close":
            client.stop_stream(cancel_requests=True)
            return "close"
        client.async_stream_infer("tensorrt_llm", token_request([5], 1, stop=([True], "BOOL")), request_id=rid,
                                  enable_empty_final_response=True)
        finals = 0
        while finals < 2:  # the request's own end and the stop request's final response
            try:
                result, error = got.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return "hung"
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
        return "stop"
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream()
        client.close()


def part_b(server, n: int) -> dict:
    from triton_helpers import stream, token_request

    for i in range(20):  # warm: every code path once, before the "before" snapshot
        stream(server.grpc_url, "tensorrt_llm", token_request([5 + i, 6, 7], 8, end_id=([-1], "INT32")))
        cancel_one(server.grpc_url, i, random.Random(i))
    idle0 = wait_idle(server.metrics_url)
    before = proc_snapshot(server)
    rng = random.Random(1)
    seeds = [rng.randrange(10**9) for _ in range(n)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(lambda i: cancel_one(server.grpc_url, i, random.Random(seeds[i])), range(n)))
    storm_s = time.monotonic() - t0
    idle = wait_idle(server.metrics_url, timeout=60)
    time.sleep(1.0)
    after = proc_snapshot(server)
    probe = stream(server.grpc_url, "tensorrt_llm", token_request([5, 6, 7], 3, end_id=([-1], "INT32")))
    leaked = int(idle.get("kv_used", -1) != 0) + int(idle.get("req_active", -1) != 0)
    return {
        "cancelled_streams": n,
        "outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
        "storm_seconds": round(storm_s, 1),
        "kv_or_slots_leaked": leaked,
        "kv_used_after": idle.get("kv_used"), "active_requests_after": idle.get("req_active"),
        "kv_used_before": idle0.get("kv_used"),
        "threads_leaked": (after["trt_threads"] or 0) - (before["trt_threads"] or 0),
        "rss_growth_pct": round(100.0 * (after["rss_kb"] - before["rss_kb"]) / before["rss_kb"], 2),
        "rss_kb_before_after": [before["rss_kb"], after["rss_kb"]],
        "rss_kb_by_process_before_after": [before["rss_kb_by_process"], after["rss_kb_by_process"]],
        "trt_threads_before_after": [before["trt_threads"], after["trt_threads"]],
        "serves_after": not probe.errors and len(probe.tokens()) == 3,
    }


# -- (c) soak ---------------------------------------------------------------------------------------------------

def _bench(spec, server, out: Path, **workload) -> tuple[dict, list[dict]]:
    import csv

    from toolchain.bench.run import run_bench

    wl = spec.validation.workload.model_copy(update={"warmup_requests": 2, "input_tokens": 64, "output_tokens": 32,
                                                     **workload})
    s = spec.model_copy(update={"validation": spec.validation.model_copy(update={"workload": wl})})
    report = run_bench(s, url=server.grpc_url, out_dir=out, metrics_url=server.metrics_url, plots=False,
                       request_timeout_s=60)
    with open(out / "requests.csv") as fh:
        rows = list(csv.DictReader(fh))
    return report, rows


def part_c(server, spec, soak_s: float, tmp: Path) -> dict:
    from toolchain.bench import metrics as M  # noqa: F401

    sat, _ = _bench(spec, server, tmp / "sat", mode="concurrency", concurrency=8, num_requests=48)
    level = sat["levels"][0] if "levels" in sat else sat["results"][0]
    rate_sat = level["requests_per_s"]
    rate = round(0.8 * rate_sat, 2)
    wait_idle(server.metrics_url)
    before = proc_snapshot(server)
    n = max(8, int(rate * soak_s))
    report, rows = _bench(spec, server, tmp / "soak", mode="rate", rate=rate, arrival="constant", num_requests=n)
    time.sleep(1.0)
    wait_idle(server.metrics_url)
    after = proc_snapshot(server)
    lvl = report["levels"][0] if "levels" in report else report["results"][0]
    measured = [r for r in rows if r.get("warmup") in ("False", "false", "0", "")]
    ttft_key = next(k for k in rows[0] if k.startswith("ttft"))
    send_key = next((k for k in rows[0] if k in ("t_send_s", "t_send_ms", "send_s", "t_send")), None)
    if send_key:
        measured.sort(key=lambda r: float(r[send_key] or 0))
    vals = [float(r[ttft_key]) for r in measured if r[ttft_key] not in ("", "None", "nan")]
    third = max(1, len(vals) // 3)

    def p99(xs):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]

    first, last = p99(vals[:third]), p99(vals[-third:])
    return {
        "saturation_req_s": round(rate_sat, 2), "rate_req_s": rate, "soak_s": soak_s, "requests": n,
        "rss_growth_pct": round(100.0 * (after["rss_kb"] - before["rss_kb"]) / before["rss_kb"], 2),
        "rss_kb_by_process_before_after": [before["rss_kb_by_process"], after["rss_kb_by_process"]],
        "ttft_p99_first_third_ms": round(first, 2), "ttft_p99_last_third_ms": round(last, 2),
        "ttft_p99_drift_pct": round(100.0 * (last - first) / first, 1),
        "errors": lvl["errors"], "achieved_send_rate": lvl.get("achieved_send_rate"),
        "ttft_column": ttft_key, "order_column": send_key,
    }


# -- (d) crash safety -------------------------------------------------------------------------------------------

def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256, manifests without their time fields; hidden entries (temp dirs) left out."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        data = p.read_bytes()
        if p.name == "manifest.json":
            m = json.loads(data)
            m.pop("created", None)
            m.pop("seconds", None)
            data = json.dumps(m, sort_keys=True).encode()
        out[rel.as_posix()] = hashlib.sha256(data).hexdigest()
    return out


def part_d(kills_per_stage: int, tmp: Path, seed: int = 0) -> dict:
    from toolchain.manifest import Manifest

    root = tmp / "crash"
    root.mkdir(parents=True)
    spec_path = root / "spec.yaml"
    text = SPEC.read_text().replace("../models/tiny-llama", str(REPO / "models" / "tiny-llama"))
    spec_path.write_text(text)
    spec = load_default_spec()
    outs = {"convert": root / "engines" / spec.name / "checkpoint", "build-engine": root / "engines" / spec.name / "engine",
            "model-repo": root / "model_repo" / spec.name}
    exe = str(Path(sys.executable).parent / "toolchain")

    def cmd(stage, force):
        return [exe, "--root", str(root), stage, str(spec_path)] + (["--force"] if force else [])

    def run(stage, force=False):
        t = time.monotonic()
        p = subprocess.run(cmd(stage, force), capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{stage} failed: {p.stderr[-800:]}")
        return time.monotonic() - t

    durations = {}
    for stage in STAGES:  # the uninterrupted run, in the same root (paths in the outputs must agree)
        durations[stage] = run(stage, force=True)
    ref = {stage: tree_digest(outs[stage]) for stage in STAGES}
    rng = random.Random(seed)
    results = {"kills": 0, "rerun_mismatches": 0, "partial_outputs_used": 0, "tmp_read_as_output": 0,
               "final_absent_after_kill": 0, "final_previous_after_kill": 0, "leftover_tmp_dirs": 0,
               "uninterrupted_s": {k: round(v, 2) for k, v in durations.items()}, "per_stage": {}, "problems": []}
    for stage in STAGES:
        final = outs[stage]
        per = {"kills": 0, "absent": 0, "complete": 0, "partial": 0, "mismatch": 0}
        for k in range(kills_per_stage):
            force = k % 3 != 2
            if k % 3 == 2 and final.exists():  # a run from nothing (the upstream stages complete)
                shutil.rmtree(final)
            # a planted temp directory that looks complete but is wrong: it must never be taken as the output
            bogus = final.parent / f".{final.name}.tmp-planted{k}"
            if k % 4 == 1 and final.exists():
                shutil.copytree(final, bogus, symlinks=True)
                for f in sorted(bogus.rglob("*")):
                    if f.is_file() and f.name != "manifest.json":
                        f.write_bytes(b"garbage")
                        break
            proc = subprocess.Popen(cmd(stage, force), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            time.sleep(rng.uniform(0.0, durations[stage] * 1.05))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            per["kills"] += 1
            results["kills"] += 1
            if not final.exists():
                per["absent"] += 1
            elif Manifest.read(final) is None or tree_digest(final) != ref[stage]:
                per["partial"] += 1
                results["problems"].append(f"{stage} kill {k}: {final} present but not the complete output")
            else:
                per["complete"] += 1
            run(stage, force=False)  # the rerun must finish what was interrupted, reusing only complete outputs
            got = tree_digest(final)
            if got != ref[stage]:
                per["mismatch"] += 1
                diff = sorted(set(got.items()) ^ set(ref[stage].items()))[:3]
                results["problems"].append(f"{stage} kill {k}: rerun differs: {diff}")
            if bogus.exists():
                if os.path.samefile(bogus, final):
                    results["tmp_read_as_output"] += 1
                shutil.rmtree(bogus)
            # downstream stages must also still rebuild to the reference
        leftovers = [p.name for p in final.parent.iterdir() if p.name.startswith(f".{final.name}.")]
        per["leftover_tmp_dirs"] = len(leftovers)
        results["leftover_tmp_dirs"] += len(leftovers)
        results["per_stage"][stage] = per
        results["rerun_mismatches"] += per["mismatch"]
        results["partial_outputs_used"] += per["partial"]
        results["final_absent_after_kill"] += per["absent"]
        results["final_previous_after_kill"] += per["complete"]
        log(f"  (d) {stage}: {per}")
    results["partial_outputs_used"] += results["tmp_read_as_output"]
    return results


# -- (e) a dying model instance -----------------------------------------------------------------------------------

def _close(client) -> None:
    try:
        client.stop_stream(cancel_requests=True)
        client.close()
    except Exception:
        pass


class Inflight:
    """`n` streaming tensorrt_llm requests of 400 tokens on one gRPC stream, each seen streaming before
    `started()` returns; `poll()` records which ended (final response or error) and when, from `t0`."""

    def __init__(self, grpc_url: str, n: int):
        import tritonclient.grpc as grpcclient

        from triton_helpers import token_request

        self.n = n
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))
        self.ended: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.started: set = set()
        self.t0 = time.monotonic()
        for i in range(n):
            self.client.async_stream_infer("tensorrt_llm", token_request([5 + i, 6, 7], 400, end_id=([-1], "INT32")),
                                           request_id=f"k{i}", enable_empty_final_response=True)

    def wait_started(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while len(self.started) < self.n and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                result, error = self.got.get(timeout=1)
                if result is not None:
                    self.started.add(result.get_response().id)
        return len(self.started)

    def poll(self, wait: float = 0.05) -> None:
        with contextlib.suppress(queue.Empty):
            result, error = self.got.get(timeout=wait)
            if error is not None:
                # an error without a request id ends the stream for every request on it
                rid = getattr(error, "request_id", None) or ""
                msg = str(error)
                targets = [rid] if rid else [f"k{i}" for i in range(self.n)]
                for r in targets:
                    self.ended.setdefault(r, time.monotonic() - self.t0)
                    self.errors.setdefault(r, msg[:200])
            elif result.get_response().parameters["triton_final_response"].bool_param:
                self.ended.setdefault(result.get_response().id, time.monotonic() - self.t0)

    @property
    def all_ended(self) -> bool:
        return len(self.ended) >= self.n

    def close(self, timeout: float = 10.0) -> bool:
        """True if closing hung. tritonclient's stop_stream waits for the server to end the stream, which
        it never does while a request on it is unanswered: closed from a daemon thread, with cancellation."""
        closer = threading.Thread(target=_close, args=(self.client,), daemon=True)
        closer.start()
        closer.join(timeout)
        return closer.is_alive()

    def report(self) -> dict:
        return {"inflight_requests": self.n, "streaming_before_kill": len(self.started),
                "requests_ended": len(self.ended), "hung_requests": self.n - len(self.ended),
                "requests_ended_s": {k: round(v, 3) for k, v in sorted(self.ended.items())},
                "all_ended_s": round(max(self.ended.values()), 3) if self.all_ended else None,
                "errors": sorted(set(self.errors.values()))[:3]}


def part_e(server, n_inflight: int = 6) -> dict:
    """The stub killed under a bare TritonServer object (no `toolchain serve` watching it)."""
    from triton_helpers import token_request

    inflight = Inflight(server.grpc_url, n_inflight)
    inflight.wait_started()
    pid = stub_pids(server.process.pid)["tensorrt_llm"]
    inflight.t0 = t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    detect = {"server_not_ready": None, "model_not_ready": None, "toolchain_ready_false": None}
    bound = 30.0
    while time.monotonic() - t_kill < bound and (not inflight.all_ended or None in detect.values()):
        inflight.poll()
        now = time.monotonic() - t_kill
        if detect["server_not_ready"] is None and http_get(f"{server.http_url}/v2/health/ready", 0.5) != 200:
            detect["server_not_ready"] = round(now, 3)
        if detect["model_not_ready"] is None and \
                http_get(f"{server.http_url}/v2/models/tensorrt_llm/ready", 0.5) != 200:
            detect["model_not_ready"] = round(now, 3)
        if detect["toolchain_ready_false"] is None and not server.ready:  # TritonServer.ready: also dead stubs
            detect["toolchain_ready_false"] = round(now, 3)
    stream_close_hung = inflight.close()
    new_pid = stub_pids(server.process.pid).get("tensorrt_llm") if server.process.poll() is None else None
    # does a new request after the death get an answer (an error or tokens) in bounded time?
    after = Grpc(server.grpc_url).stream("tensorrt_llm", token_request([5, 6, 7], 3, end_id=([-1], "INT32")),
                                         timeout=30)[0] if server.process.poll() is None else "server gone"
    times = [t for t in detect.values() if t is not None]
    log_hits = [line[:200] for line in server.log_text().splitlines() if LOG_DEATH.search(line)]
    return {
        **inflight.report(),
        "bound_s": bound,
        "time_to_detect_s": min(times) if times else None,
        "detected_by": detect,
        "client_stream_close_hung": stream_close_hung,
        "server_ready_after": http_get(f"{server.http_url}/v2/health/ready") == 200,
        "model_ready_after": http_get(f"{server.http_url}/v2/models/tensorrt_llm/ready") == 200,
        "dead_stubs": server.dead_stubs(),
        "stub_restarted": new_pid is not None and new_pid != pid,
        "request_after_death": after,
        "server_alive": server.process.poll() is None,
        "log_lines": log_hits[:4],
    }


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _status(int(entry.name)).get("PPid") == str(pid):
            out.append(int(entry.name))
    return out


def _argv0(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


def _running(pid: int, argv0_suffix: bytes) -> bool:
    """`pid` is still that process (its argv[0] ends with the suffix) and not a zombie."""
    return _status(pid).get("State", "Z").split()[0] not in ("Z", "X") and _argv0(pid).endswith(argv0_suffix)


def _shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _pump(stream, sink: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        sink.put(line.rstrip("\n"))
    sink.put(None)


def part_e_serve(ws_root: Path, n_inflight: int = 6, bound_s: float = 60.0, start_timeout_s: float = 240.0) -> dict:
    """The path users run: `toolchain serve build/tiny-llama.yaml` (a subprocess, on the workspace `deploy()`
    built) with `n_inflight` streams in flight over gRPC when the tensorrt_llm stub is SIGKILLed. serve must
    see the dead stub, stop tritonserver (which ends every request on it: the connection closes), print one
    line naming the instance and exit non-zero, leaving no tritonserver, stub or /dev/shm region behind."""
    from toolchain.triton.server import python_stubs

    exe = str(Path(sys.executable).parent / "toolchain")
    argv = [exe, "--root", str(ws_root), "serve", str(SPEC), "--set", "serving.http_port=0",
            "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]
    shm_before = _shm_names()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    out_q: queue.Queue = queue.Queue()
    err_q: queue.Queue = queue.Queue()
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out_q), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, err_q), daemon=True)]
    for th in pumps:
        th.start()
    stdout: list[str] = []
    urls: dict[str, str] = {}
    stubs: dict[str, int] = {}
    result: dict = {"command": " ".join(argv[1:])}
    t_start = time.monotonic()
    deadline = t_start + start_timeout_s
    while time.monotonic() < deadline and "Ctrl-C to stop" not in stdout:
        try:
            line = out_q.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if line is None:
            break
        stdout.append(line)
        m = re.match(r"\s+(HTTP|gRPC|metrics)\s+(\S+)$", line)
        if m:
            urls[m.group(1)] = m.group(2)
    triton = None
    until = time.monotonic() + 5
    while triton is None and time.monotonic() < until and proc.poll() is None:
        triton = next((c for c in _children(proc.pid) if _argv0(c).endswith(b"/tritonserver")), None)
        time.sleep(0.05 if triton is None else 0)
    inflight = None
    try:
        if "Ctrl-C to stop" not in stdout or triton is None or "gRPC" not in urls:
            raise RuntimeError(f"serve did not come up in {start_timeout_s:.0f} s (rc {proc.poll()}): "
                               f"{stdout[-3:]} {list(err_q.queue)[-3:]}")
        result["serve_up_s"] = round(time.monotonic() - t_start, 1)
        stubs = python_stubs(triton)  # instance -> pid, every model's
        inflight = Inflight(urls["gRPC"], n_inflight)
        inflight.wait_started()
        victim = stubs["tensorrt_llm_0_0"]
        inflight.t0 = t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        detect = {"server_not_ready": None, "serve_exited": None}
        while time.monotonic() - t_kill < bound_s and (not inflight.all_ended or None in detect.values()):
            inflight.poll()
            now = round(time.monotonic() - t_kill, 3)
            if detect["server_not_ready"] is None and http_get(f"{urls['HTTP']}/v2/health/ready", 0.5) != 200:
                detect["server_not_ready"] = now
            if detect["serve_exited"] is None and proc.poll() is not None:
                detect["serve_exited"] = now
        result.update(inflight.report())
        times = [t for t in detect.values() if t is not None]
        result.update({"bound_s": bound_s, "time_to_detect_s": min(times) if times else None,
                       "detected_by": detect, "client_stream_close_hung": inflight.close()})
    except Exception as err:
        result["failure"] = str(err)[:500]
        if inflight is not None:
            result.update(inflight.report())
            inflight.close()
        else:
            result["hung_requests"] = n_inflight
        stubs = python_stubs(triton) if triton else {}
    finally:
        if proc.poll() is None:  # serve did not end by itself: stop it (and what it started), but count it
            result["serve_stopped_by_benchmark"] = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in [triton, *stubs.values(), proc.pid]:
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
    for th in pumps:
        th.join(5)
    stdout += [x for x in list(out_q.queue) if x is not None]
    stderr = [x for x in list(err_q.queue) if x is not None]
    err_lines = [x for x in stderr if x.strip()]
    last = err_lines[-1] if err_lines else ""
    # what is left: the server and the stubs (given a moment to be reaped), and the server's /dev/shm regions
    watched = {"tritonserver": (triton, b"/tritonserver"),
               **{name: (pid, b"triton_python_backend_stub") for name, pid in stubs.items()}}
    deadline = time.monotonic() + 5
    while True:
        left = sorted(name for name, (pid, argv0) in watched.items() if pid and _running(pid, argv0))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    prefix = f"tc{proc.pid}_"
    shm_new = sorted(_shm_names() - shm_before)
    result.update({
        "serve_exit_code": proc.returncode,
        "stderr_last_line": last[:400],
        "stderr_lines": len(err_lines),
        "one_line_naming_instance": bool(last.startswith("error: ") and "tensorrt_llm_0_0" in last
                                         and "died" in last and not any("Traceback" in x for x in stderr)),
        "stdout_tail": stdout[-2:],
        "processes_left": left,
        "shm_regions_left": [n for n in shm_new if n.startswith(prefix)],
        "shm_prefix": prefix,
    })
    result.setdefault("serve_stopped_by_benchmark", False)
    return result


def part_e_load(spec, ws, tmp: Path) -> dict:
    """The tensorrt_llm stub killed while the server loads the repository: start must fail in bounded time."""
    from toolchain.triton.server import TritonServer

    server = TritonServer.from_spec(spec, ws.model_repo_dir(spec), log_path=tmp / "server-load-kill.log")
    result: dict = {}

    def starter():
        t = time.monotonic()
        try:
            server.start(timeout=90)
            result["outcome"] = "started"
        except Exception as err:
            result["outcome"] = f"start failed: {str(err)[:300]}"
        result["start_s"] = round(time.monotonic() - t, 2)

    th = threading.Thread(target=starter)
    th.start()
    killed = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and killed is None and th.is_alive():
        if server.process is not None:
            pid = stub_pids(server.process.pid).get("tensorrt_llm")
            if pid:
                time.sleep(0.3)  # inside initialize(): the engine is loading
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
        time.sleep(0.02)
    th.join(timeout=150)
    result["killed_stub"] = killed is not None
    result["start_hung"] = th.is_alive()
    if result.get("outcome") == "started":
        result["models_ready"] = models_ready(server)
    server.stop()
    return result


# -- main -------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--soak-s", type=float, default=None)
    ap.add_argument("--parts", default="abcde")
    ap.add_argument("--hostile", type=int, default=None)
    ap.add_argument("--cancel", type=int, default=None)
    ap.add_argument("--kills", type=int, default=None)
    args = ap.parse_args(argv)
    q = args.quick
    n_hostile = args.hostile or (1000 if q else 10000)
    n_cancel = args.cancel or (200 if q else 1000)
    n_kills = args.kills or (3 if q else 20)
    soak_s = args.soak_s or (30.0 if q else 120.0)
    out: dict = {"quick": q, "targets": TARGETS}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reliability-") as d:
        tmp = Path(d)
        if set(args.parts) & set("abce"):
            spec, ws, server = deploy(tmp / "ws")
            with server:
                log(f"server up in {server.started_s:.1f} s at {server.urls}")
                if "a" in args.parts:
                    log(f"(a) {n_hostile} hostile requests")
                    out["hostile"] = part_a(server, spec, ws, n_hostile)
                    log(json.dumps(out["hostile"], indent=1))
                if "b" in args.parts and server.process.poll() is None:
                    log(f"(b) {n_cancel} cancelled streams")
                    out["cancellation"] = part_b(server, n_cancel)
                    log(json.dumps(out["cancellation"], indent=1))
                if "c" in args.parts and server.process.poll() is None:
                    log(f"(c) soak {soak_s:.0f} s")
                    out["soak"] = part_c(server, spec, soak_s, tmp)
                    log(json.dumps(out["soak"], indent=1))
                if "e" in args.parts and server.process.poll() is None:
                    log("(e) kill the tensorrt_llm stub with requests in flight")
                    out["dying_instance"] = part_e(server)
                    log(json.dumps(out["dying_instance"], indent=1))
            if "e" in args.parts:
                log("(e) kill the tensorrt_llm stub during load")
                out["dying_instance_during_load"] = part_e_load(spec, ws, tmp)
                log(json.dumps(out["dying_instance_during_load"], indent=1))
                log("(e) `toolchain serve`: kill the tensorrt_llm stub with requests in flight")
                served = part_e_serve(tmp / "ws")
                log(json.dumps(served, indent=1))
                # the figures of the path users run are the section's; the bare server's are kept apart
                bare = out.get("dying_instance", {})
                out["dying_instance"] = {
                    **served,
                    "hung_requests_bare_tritonserver": bare.get("hung_requests"),
                    "time_to_detect_s_bare_tritonserver": bare.get("time_to_detect_s"),
                    "bare_tritonserver": bare,
                }
        if "d" in args.parts:
            log(f"(d) {n_kills} kills per stage")
            out["crash_safety"] = part_d(n_kills, tmp)
            log(json.dumps(out["crash_safety"], indent=1))
    out["seconds"] = round(time.monotonic() - t_all, 1)
    flat = {}
    for key, section in (("hostile_requests", "hostile"), ("server_crashes", "hostile"),
                         ("model_instance_deaths", "hostile"), ("valid_outputs_wrong", "hostile"),
                         ("unanswered_requests", "hostile"), ("kv_or_slots_leaked", "cancellation"),
                         ("threads_leaked", "cancellation"), ("rss_growth_pct", "cancellation"),
                         ("rss_growth_pct", "soak"), ("ttft_p99_drift_pct", "soak"), ("errors", "soak"),
                         ("kills", "crash_safety"), ("rerun_mismatches", "crash_safety"),
                         ("partial_outputs_used", "crash_safety"), ("hung_requests", "dying_instance"),
                         ("time_to_detect_s", "dying_instance"), ("serve_exit_code", "dying_instance"),
                         ("hung_requests_bare_tritonserver", "dying_instance")):
        if section in out:
            flat[f"{section}.{key}"] = out[section].get(key)
    out["summary"] = flat
    print(json.dumps(flat, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
