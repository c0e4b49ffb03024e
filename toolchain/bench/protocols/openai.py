"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`, SSE or not.

Streaming requests ask for `stream_options.include_usage`, so the server's
`completion_tokens` is the OSL when it sends one (token_count_source
"server-total"; each chunk's share is still the tokenizer's count, and the
client total is kept next to the server's). A role-only first chat chunk is a
response without tokens: it sets TTFR, not TTFT. The usage-only chunk and
`[DONE]` are no responses; `[DONE]` (or the close) is t_final. Exact output
length is asked for with `ignore_eos` and `min_tokens` (vLLM / trtllm-serve
extensions), sent only with ignore_eos. A request for a LoRA adapter names it in `model`, as this project's
OpenAI server (and Dynamo's, and vLLM's) select adapters; GET /v1/models must list it.
"""

from __future__ import annotations

import asyncio
import json
import time

from toolchain.bench.protocols.transport import Reply, Stream, short
from toolchain.bench.protocols.sse import HttpClient, error_text, get_json, normalize_http_url
from toolchain.errors import ToolchainError


class OpenAI(HttpClient):
    token_ids = False

    def __init__(self, url: str, model: str, *, chat: bool = False, streaming: bool = True, ignore_eos: bool = True,
                 keep_text: bool = False, adapters: dict[str, int] | None = None, **_):
        super().__init__()
        self.adapters = adapters or {}
        """LoRA adapters the workload's classes name (their task ids are the server's business here)."""
        self.url = normalize_http_url(url).removesuffix("/v1")
        self.model, self.chat, self.streaming, self.ignore_eos = model, chat, streaming, ignore_eos
        self.keep_text = keep_text
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        self.contract: str | None = None

    def describe(self) -> dict:
        return {"protocol": "openai-chat" if self.chat else "openai-completions", "url": self.url + self.path,
                "model": self.model, "contract": "openai", "server_token_counts": "usage (total)"}

    def prepare(self, timeout_s: float = 5.0):
        status, body = get_json(f"{self.url}/v1/models", timeout_s)
        if status == 404 or not isinstance(body, dict):
            raise ToolchainError(f"no OpenAI-compatible API at {self.url} (GET /v1/models: {status})",
                                 "point --url at the OpenAI frontend, or use protocol triton-grpc / triton-http")
        if status != 200:
            raise ToolchainError(f"{self.url} refused GET /v1/models: {error_text(status, body)}")
        served = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
        if self.model not in served:
            raise ToolchainError(f"model '{self.model}' not served at {self.url} (it serves: "
                                 f"{', '.join(map(str, served)) or 'nothing'})",
                                 "set validation.workload.endpoint to one of the served model names")
        missing = [name for name in self.adapters if name not in served]
        if missing:
            raise ToolchainError(f"LoRA adapter(s) {', '.join(missing)} not served at {self.url} as models (it "
                                 f"serves: {', '.join(map(str, served))})",
                                 "serve the spec with its lora section, or remove the classes' adapters")
        self.contract = "openai"
        return self.contract

    @property
    def inputs_sent(self) -> list[str]:
        return sorted(self._body(None, "x", [{"role": "user", "content": "x"}], 2, 0))

    def _body(self, rec, text, messages, max_tokens: int, priority: int, adapter: str | None = None) -> dict:
        body = {"model": adapter or self.model, "max_tokens": max_tokens, "stream": self.streaming}
        if self.chat:
            body["messages"] = messages
        else:
            body["prompt"] = text
        if self.streaming:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        if priority:
            body["priority"] = priority
        return body

    def build(self, rec, prompt, turn, priority: int) -> bytes:
        return json.dumps(self._body(rec, prompt.text, prompt.messages, turn.max_tokens, priority,
                                     prompt.adapter)).encode()

    async def run(self, rec, prompt, turn, priority: int = 0, request=None) -> Reply:
        data = request if request is not None else self.build(rec, prompt, turn, priority)
        st = Stream(rec, turn.cancel_after, self.keep_text)
        rec.t_send = time.perf_counter_ns()
        try:
            async with await self.http.post(self.path, data) as resp:
                rec.t_status, rec.status = time.perf_counter_ns(), f"HTTP {resp.status}"
                if resp.status != 200:
                    rec.error = error_text(resp.status, await resp.payload())
                    rec.t_final = time.perf_counter_ns()
                    return st.reply()
                if not self.streaming:
                    obj = json.loads(await resp.read())
                    t = time.perf_counter_ns()
                    st.text(t, self._content(obj.get("choices") or [{}], final=True))
                    self._usage(rec, obj)
                    rec.t_final = t
                    return st.reply()
                async for t, data in self.events(resp):
                    if data == "[DONE]":
                        rec.t_final = t
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = error_text(200, obj)
                        break
                    self._usage(rec, obj)
                    choices = obj.get("choices")
                    if not choices:
                        continue  # the usage-only chunk is no response
                    if st.text(t, self._content(choices, final=False)):
                        resp.close()  # dropping the connection is how an HTTP client cancels
                        return st.reply()
                if rec.t_final is None and rec.error is None:
                    rec.t_final = time.perf_counter_ns()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            rec.error = f"HTTP {short(err)}"
        return st.reply()

    def _content(self, choices: list, final: bool) -> str:
        c = choices[0] if isinstance(choices[0], dict) else {}
        if not self.chat:
            return c.get("text") or ""
        part = c.get("message" if final else "delta") or {}
        # Reasoning tokens are generated tokens too: they count for TTFT and OSL.
        return (part.get("reasoning_content") or "") + (part.get("content") or "")

    @staticmethod
    def _usage(rec, obj: dict) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > 0:
            rec.server_osl = usage["completion_tokens"]
            rec.token_source = "server-total"
