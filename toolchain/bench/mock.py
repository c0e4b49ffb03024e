"""Mock servers with known timing, for the harness's tests and its accuracy benchmark.

- `write_triton_mock(repo, ...)`: a decoupled Python-backend model for a real
  tritonserver, speaking the text contract (ensemble/BLS tensors) or the
  token-id contract (tensorrt_llm tensors).
- `python -m toolchain.bench.mock openai --port P ...`: an aiohttp
  OpenAI-compatible server (/v1/models, /v1/completions,
  /v1/chat/completions, /health), streaming or not; `adapters` {name: ttft_ms} serves LoRA adapters by name in
  `model` (listed by /v1/models with the base as parent), each with a TTFT of its own.

Timing truth, from the moment the mock sees the request: an optional empty
first response (Triton) or role-only chunk (OpenAI chat) at `empty_ms` /
`role_chunk_ms`; the first token-bearing response at `ttft_ms`
(+ `prefill_us_per_word` per prompt word); then one response every
`tokens_per_response * step_ms`, each carrying `tokens_per_response` tokens.
So the true TTFT is ttft_ms and the true time per output token is step_ms.
Tokens are words from WORDS, one token each with `make_word_tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from toolchain.bench.workload import corpus_text

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def make_word_tokenizer(out: Path, corpus: str | None = None) -> Path:
    """A WordLevel tokenizer over a corpus plus WORDS (each mock word is one token), saved for AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=8000, special_tokens=["[UNK]", "[PAD]", "</s>"])
    tok.train_from_iterator([corpus if corpus is not None else corpus_text(), " ".join(WORDS) + " !"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")
    fast.save_pretrained(out)
    return Path(out)


# ---- Triton ----------------------------------------------------------------------------------------------------
_TEXT_IO = """
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "min_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "min_length" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
_TOKEN_IO = """
input [
  { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "input_lengths" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "streaming" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [
  { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_INT32 dims: [ -1 ] }
]
"""

_MODEL_PY = '''
import heapq, json, os, sys, threading, time
for _p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    if _p and _p not in sys.path:
        sys.path.append(_p)
import numpy as np
import triton_python_backend_utils as pb_utils

WORDS = %(words)r
SPIN_S = %(spin_s)r
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().ravel()[0]


class TritonPythonModel:
    """Every send is an event on one heap served by one thread: precise, and cheap at high rates."""

    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.p = {k: float(v["string_value"]) for k, v in params.items()}
        self.tokens = "input_ids" in {i["name"] for i in json.loads(args["model_config"])["input"]}
        self.heap, self.seq, self.cv = [], 0, threading.Condition()
        self.stopping = False
        threading.Thread(target=self._loop, daemon=True).start()

    def _push(self, when, fn):
        with self.cv:
            self.seq += 1
            heapq.heappush(self.heap, (when, self.seq, fn))
            self.cv.notify()

    def _loop(self):
        while True:
            with self.cv:
                while not self.heap and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    return
                when, _, fn = self.heap[0]
                delay = when - time.perf_counter()
                if delay > SPIN_S:
                    self.cv.wait(delay - SPIN_S)
                    continue
                if delay <= 0:
                    heapq.heappop(self.heap)
            if delay > 0:
                # The last stretch is spun, lock released: a condition wait wakes up to a few hundred
                # microseconds late, which would show up as error in the very timing this mock is the truth of.
                # sleep(0) hands the GIL to execute() meanwhile.
                while time.perf_counter() < when:
                    time.sleep(0)
                continue
            try:
                fn()
            except Exception as err:
                print("mock_llm:", err, file=sys.stderr)

    def _response(self, k, n):
        if self.tokens:
            ids = np.arange(k, k + n, dtype=np.int32).reshape(1, 1, -1) %% len(WORDS) + 3
            return pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("output_ids", ids), pb_utils.Tensor("sequence_length", np.array([[n]], np.int32))])
        text = "".join(" " + WORDS[(k + j) %% len(WORDS)] for j in range(n))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([[text.encode()]], dtype=np.object_))])

    def execute(self, requests):
        for request in requests:
            t0 = time.perf_counter()
            sender = request.get_response_sender()
            if self.tokens:
                n = int(_scalar(request, "request_output_len"))
                words = int(_scalar(request, "input_lengths"))
            else:
                n = int(_scalar(request, "max_tokens"))
                prompt = _scalar(request, "text_input", b"")
                words = len(prompt.split()) if isinstance(prompt, bytes) else 0
            p = self.p
            per = max(1, int(p["tokens_per_response"]))
            first = t0 + (p["ttft_ms"] + p["prefill_us_per_word"] * words / 1000.0) / 1000.0
            if p["empty_ms"] >= 0:
                self._push(t0 + p["empty_ms"] / 1000.0, lambda s=sender: s.send(pb_utils.InferenceResponse([])))
            k, j = 0, 0
            while k < n:
                m = min(per, n - k)
                last = k + m >= n and not p["flag_only_final"]
                when = first + j * per * p["step_ms"] / 1000.0

                def send(s=sender, k=k, m=m, last=last):
                    if not s.is_cancelled():
                        s.send(self._response(k, m), flags=FINAL if last else 0)
                    elif last:
                        s.send(flags=FINAL)
                self._push(when, send)
                k, j = k + m, j + 1
            if p["flag_only_final"]:
                self._push(first + (j - 1) * per * p["step_ms"] / 1000.0 + 0.0003,
                           lambda s=sender: s.send(flags=FINAL))
        return None

    def finalize(self):
        with self.cv:
            self.stopping = True
            self.cv.notify()
'''


def write_triton_mock(repo: Path, name: str = "mock_llm", *, contract: str = "text", ttft_ms: float = 40.0,
                      step_ms: float = 10.0, empty_ms: float = -1.0, tokens_per_response: int = 1,
                      flag_only_final: bool = False, prefill_us_per_word: float = 0.0, max_batch_size: int = 8,
                      precise: bool = True) -> Path:
    """Write <repo>/<name>/{config.pbtxt, 1/model.py}; returns the model directory. `precise`
    spins the last 1.5 ms before each send (exact timing, some CPU); off for rate tests."""
    d = Path(repo) / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    params = {"ttft_ms": ttft_ms, "step_ms": step_ms, "empty_ms": empty_ms, "tokens_per_response": tokens_per_response,
              "flag_only_final": int(flag_only_final), "prefill_us_per_word": prefill_us_per_word}
    io = _TOKEN_IO if contract == "token-ids" else _TEXT_IO
    (d / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
        "model_transaction_policy { decoupled: true }\n" + io +
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n" +
        "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()))
    spin_s = 0.0015 if precise else 0.0
    (d / "1" / "model.py").write_text(textwrap.dedent(_MODEL_PY % {"words": WORDS, "spin_s": spin_s}))
    return d


# ---- OpenAI ----------------------------------------------------------------------------------------------------
async def _at(t: float, precise: bool) -> None:
    """Sleep until perf_counter() == t; `precise` spins the last 1.5 ms (asyncio wakes up to 1 ms late)."""
    import asyncio
    import time

    delay = t - time.perf_counter()
    if delay > 0.0015 or (delay > 0 and not precise):
        await asyncio.sleep(delay - (0.0015 if precise else 0))
    while precise and time.perf_counter() < t:
        pass


def openai_app(*, model: str = "mock", ttft_ms: float = 40.0, step_ms: float = 10.0, tokens_per_response: int = 1,
               role_chunk: bool = True, usage_prompt_tokens: bool = True, precise: bool = True,
               role_chunk_ms: float = 0.0, adapters: dict[str, float] | None = None):
    import time

    from aiohttp import web

    ttfts = {model: ttft_ms, **(adapters or {})}

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}] + [
            {"id": name, "object": "model", "parent": model} for name in adapters or {}]})

    async def health(_):
        return web.Response(text="ok")

    async def complete(request: web.Request, chat: bool):
        t0 = time.perf_counter()
        body = await request.json()
        if body.get("model") not in ttfts:
            return web.json_response({"error": {"message": f"model '{body.get('model')}' does not exist"}}, status=404)
        n = int(body.get("max_tokens") or 16)
        prompt = " ".join(m.get("content", "") for m in body["messages"]) if chat else str(body.get("prompt", ""))
        usage = {"prompt_tokens": len(prompt.split()) if usage_prompt_tokens else 0, "completion_tokens": n,
                 "total_tokens": n}
        per, k, j = max(1, tokens_per_response), 0, 0
        first = t0 + ttfts[body["model"]] / 1000.0

        def chunk(text, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": text}
                return {"object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": delta}]}
            return {"object": "text_completion", "model": model, "choices": [{"index": 0, "text": text}]}

        if not body.get("stream"):
            await _at(first + (n - 1) * step_ms / 1000.0, precise)
            text = "".join(" " + WORDS[i % len(WORDS)] for i in range(n))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            return web.json_response({"model": model, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        if chat and role_chunk:
            if role_chunk_ms > 0:
                await _at(t0 + role_chunk_ms / 1000.0, precise)
            await send(chunk("", role=True))
        while k < n:
            m = min(per, n - k)
            await _at(first + j * per * step_ms / 1000.0, precise)
            await send(chunk("".join(" " + WORDS[(k + i) % len(WORDS)] for i in range(m))))
            k, j = k + m, j + 1
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"object": "chunk", "model": model, "choices": [], "usage": usage})
        await send(b"[DONE]")
        await resp.write_eof()
        return resp

    async def completions(request):
        return await complete(request, False)

    async def chat_completions(request):
        return await complete(request, True)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def main(argv=None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser(prog="python -m toolchain.bench.mock", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    o = sub.add_parser("openai", help="serve the OpenAI mock until killed")
    o.add_argument("--host", default="127.0.0.1")
    o.add_argument("--port", type=int, required=True)
    o.add_argument("--model", default="mock")
    o.add_argument("--ttft-ms", type=float, default=40.0)
    o.add_argument("--step-ms", type=float, default=10.0)
    o.add_argument("--tokens-per-response", type=int, default=1)
    o.add_argument("--no-role-chunk", action="store_true")
    o.add_argument("--role-chunk-ms", type=float, default=0.0, help="send the role-only chat chunk this late")
    o.add_argument("--coarse", action="store_true", help="plain asyncio sleeps (no spinning): for rate tests")
    a = ap.parse_args(argv)
    app = openai_app(model=a.model, ttft_ms=a.ttft_ms, step_ms=a.step_ms, tokens_per_response=a.tokens_per_response,
                     role_chunk=not a.no_role_chunk, precise=not a.coarse, role_chunk_ms=a.role_chunk_ms)
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
