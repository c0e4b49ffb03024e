"""Part (a) of benchmarks/reliability.py: hostile requests.

Malformed requests over gRPC (tritonclient and raw, truncated protobufs) and HTTP (generate,
generate_stream, infer) to every model, interleaved with valid requests whose outputs are checked against
the CPU engine's greedy output; the server must answer every one, stay up and keep every stub alive.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from reliability_parts.common import LOG_DEATH, MODELS, Grpc, Http, arr_input, http_get, log, models_ready, stub_pids
from toolchain.triton.grpc_client import text_request, token_request

i32 = np.int32


def _long_text(words: int) -> str:
    return " ".join(f"def f{i}(x):" for i in range(words // 2))


# -- the kinds of request: each a fn(ctx, rng) -> "answered" / "unanswered" -----------------------------------

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



# -- the catalog ---------------------------------------------------------------------------------------------

def text_http_kinds(m: str, stream: bool, big: int) -> list:
    """Malformed HTTP generate (or generate_stream) bodies for a text model (ensemble, BLS)."""
    sfx = "_stream" if stream else ""
    return [
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


def text_grpc_kinds(m: str, big: int) -> list:
    """Malformed gRPC streamed requests for a text model (ensemble, BLS)."""
    return [
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


def trt_kinds(V: int, max_input_len: int) -> list:
    """Malformed requests to tensorrt_llm itself, over gRPC and HTTP (generate, infer)."""
    trt = "tensorrt_llm"
    tok = lambda r, n=4: [r.randrange(3, V) for _ in range(n)]  # noqa: E731
    return [
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


def pre_post_kinds(V: int, big: int) -> list:
    """Malformed requests to preprocessing and postprocessing, addressed directly."""
    cat = []
    for m, body in (("preprocessing", {"inputs": [{"name": "QUERY", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}),
                    ("postprocessing", {"inputs": [{"name": "TOKENS_BATCH", "shape": [1, 1, 2], "datatype": "INT32",
                                                    "data": [5, -9]}]})):
        cat.append((f"{m}-http-infer-missing", "http", jinfer(m, body)))
    return cat + [
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
    ]


def unknown_and_raw_kinds() -> list:
    """Unknown models and versions, and hand-made gRPC bytes (truncated, flipped, junk)."""
    return [
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


def rare_kinds(huge_bytes: int) -> list:
    """Oversized bodies: a few per run."""
    return [
    ("oversized-http-generate", "http", jgen("ensemble", lambda r: {"text_input": "w " * (huge_bytes // 2),
                                                                   "max_tokens": 4})),
    ("oversized-http-junk", "http", jgen("tensorrt_llm_bls", lambda r: b'{"text_input":"' + b"\x41" * huge_bytes)),
    ("oversized-grpc", "grpc", gstream("ensemble", lambda r: text_request("def " * (huge_bytes // 4), 4))),
    ]


def hostile_catalog(tokenizer_vocab: int, max_input_len: int, huge_bytes: int):
    """(name, protocol, fn(ctx, rng) -> status) for every malformed request kind, and the rare oversized ones.
    part_a draws the seeded plan from this list by position, so its order is part of what a seed sends."""
    big = max_input_len * 4
    cat = []
    for m in ("ensemble", "tensorrt_llm_bls"):
        for stream in (False, True):
            cat += text_http_kinds(m, stream, big)
        cat += text_grpc_kinds(m, big)
    cat += trt_kinds(tokenizer_vocab, max_input_len)
    cat += pre_post_kinds(tokenizer_vocab, big)
    cat += unknown_and_raw_kinds()
    return cat, rare_kinds(huge_bytes)


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


def valid_infer_bytes() -> bytes:
    """The bytes of a valid ModelInfer request to tensorrt_llm (raw gRPC truncations start from it)."""
    import tritonclient.grpc.service_pb2 as pb

    req = pb.ModelInferRequest(model_name="tensorrt_llm", id="raw")
    for t in token_request([5, 6, 7], 4, stream=False):
        req.inputs.append(t._get_tensor())
        req.raw_input_contents.append(t._get_content())
    return req.SerializeToString()


def ensemble_baseline(ctx: Ctx, cases: list[dict], osl: int) -> tuple[dict, int]:
    """The ensemble's text for each case before any hostile request, and how many match the engine's tokens."""
    baseline: dict = {}
    ensemble_matches_engine = 0
    for case in cases:
        status, data = ctx.http.request("POST", "/v2/models/ensemble/generate", json.dumps(
            {"text_input": case["text"], "max_tokens": osl, "end_id": -1}).encode())
        baseline[case["text"]] = json.loads(data)["text_output"] if status == 200 else None
        ensemble_matches_engine += baseline[case["text"]] == case["want_text"]
    return baseline, ensemble_matches_engine


def request_plan(cat: list, rare: list, n: int, seed: int) -> list[tuple]:
    """`n` hostile kinds drawn with `seed`, a valid request after every tenth, the rare ones inserted at random."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        plan.append(("hostile", rng.choice(cat)))
        if i % 10 == 9:
            plan.append(("valid", rng.choice(("trt-grpc", "ensemble-http"))))
    for _j, item in enumerate(rare * max(1, n // 2500)):
        plan.insert(rng.randrange(len(plan)), ("hostile", item))
    return plan


class HostileRun:
    """The plan sent from a thread pool, with what came back tallied under a lock: per kind (sent, unanswered,
    closed by the server, slowest answer), valid requests checked against the engine's output."""

    def __init__(self, ctx: Ctx, plan: list[tuple], cases: list[dict], baseline: dict, osl: int, seed: int):
        self.ctx, self.plan, self.cases, self.baseline, self.osl, self.seed = ctx, plan, cases, baseline, osl, seed
        self.counts = {"hostile": 0, "valid": 0, "valid_wrong": 0, "unanswered": 0, "not_ready_samples": 0}
        self.kinds: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.wrong_examples: list = []

    def one(self, k: int) -> None:
        """Send plan item `k` (its own seeded rng) and tally the outcome."""
        kind, item = self.plan[k]
        r = random.Random(self.seed * 1_000_003 + k)
        if kind == "valid":
            self.valid(r, item)
        else:
            self.hostile(r, item)

    def valid(self, r: random.Random, via: str) -> None:
        """One valid request over `via`, its output checked against the engine's."""
        counts = self.counts
        case = r.choice(self.cases)
        out = check_valid(self.ctx, case, self.osl, via, self.baseline)
        with self.lock:
            counts["valid"] += 1
            if out == "wrong":
                counts["valid_wrong"] += 1
                if len(self.wrong_examples) < 5:
                    self.wrong_examples.append({"via": via, "prompt": case["text"]})
            elif out == "unanswered":
                counts["unanswered"] += 1

    def hostile(self, r: random.Random, item: tuple) -> None:
        """One malformed request; a connection the server closed is an answer, counted apart."""
        name, proto, fn = item
        t0 = time.monotonic()
        try:
            out = fn(self.ctx, r)
        except (TimeoutError, http.client.HTTPException, OSError) as err:
            out = "unanswered" if isinstance(err, TimeoutError) or "timed out" in str(err) else "answered"
            if out == "answered":
                out = "closed"  # the server closed the connection: an answer, counted apart
        dt = time.monotonic() - t0
        with self.lock:
            self.counts["hostile"] += 1
            row = self.kinds.setdefault(name, {"sent": 0, "unanswered": 0, "closed": 0, "max_s": 0.0})
            row["sent"] += 1
            row["max_s"] = max(row["max_s"], round(dt, 3))
            if out == "unanswered":
                self.counts["unanswered"] += 1
                row["unanswered"] += 1
            elif out == "closed":
                row["closed"] += 1

    def send_all(self, server) -> bool:
        """The plan in batches of 500 on 6 threads, readiness sampled after each; True if the server crashed."""
        plan = self.plan
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=6) as pool:
            for start in range(0, len(plan), 500):
                list(pool.map(self.one, range(start, min(start + 500, len(plan)))))
                if server.process.poll() is not None:
                    return True
                ready = models_ready(server)
                if not all(ready.values()):
                    self.counts["not_ready_samples"] += 1
                    log(f"  (a) models not ready after {start + 500}: {ready}")
                log(f"  (a) {min(start + 500, len(plan))}/{len(plan)} requests, {time.monotonic() - t0:.0f} s")
        return False


def part_a(server, spec, ws, n: int, seed: int = 0) -> dict:
    """`n` hostile requests (and a valid one after every tenth) against the running `server`."""
    osl = 8
    cases, tokenizer = valid_cases(spec, ws, 24, osl)
    ctx = Ctx(server)
    ctx.valid_infer_bytes = valid_infer_bytes()
    baseline, ensemble_matches_engine = ensemble_baseline(ctx, cases, osl)
    cat, rare = hostile_catalog(len(tokenizer), spec.limits.max_input_len, 4 << 20)
    plan = request_plan(cat, rare, n, seed)
    pids_before = stub_pids(server.process.pid)
    run = HostileRun(ctx, plan, cases, baseline, osl, seed)
    t0 = time.monotonic()
    crashed = run.send_all(server)
    pids_after = stub_pids(server.process.pid) if not crashed else {}
    deaths = sum(1 for m in MODELS if pids_before.get(m) != pids_after.get(m))
    log_hits = [line for line in server.log_text().splitlines() if LOG_DEATH.search(line)]
    final_ok = (not crashed) and http_get(f"{server.http_url}/v2/health/ready") == 200
    after = [check_valid(ctx, c, osl, "trt-grpc", baseline) for c in cases[:4]] if final_ok else []
    counts, kinds = run.counts, run.kinds
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
        "wrong_examples": run.wrong_examples,
    }
