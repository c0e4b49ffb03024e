"""Triton HTTP generate extension: `generate_stream` (SSE) and `generate`.

The request is the model's inputs as a flat JSON object; each SSE event is one
response's outputs as JSON. The stream ends when the server closes it after
the final response (a flag-only final sends no event), so t_final is the
close. Non-streaming requests to a decoupled model also go through
`generate_stream` (one event); `generate` is for non-decoupled models.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from toolchain.bench.protocols.transport import Reply, Stream, short
from toolchain.bench.protocols.contract import (DRAFT_OUTPUTS, TOKEN_IDS, Contract, check_lora, detect, prepared,
                                                ready_or_raise, record_drafts, request_tensors)
from toolchain.bench.protocols.sse import HttpClient, error_text, get_json, normalize_http_url
from toolchain.errors import ToolchainError


class TritonHttp(HttpClient):
    chat = False

    def __init__(self, url: str, model: str, *, streaming: bool = True, ignore_eos: bool = True,
                 exclude_input: bool | None = True, keep_text: bool = False, num_draft_tokens: int = 0,
                 adapters: dict[str, int] | None = None, **_):
        super().__init__()
        self.url = normalize_http_url(url)
        self.adapters = adapters or {}
        """LoRA adapter name -> task id, for the adapters the workload's classes name."""
        self.model, self.streaming, self.ignore_eos, self.exclude_input = model, streaming, ignore_eos, exclude_input
        self.keep_text = keep_text
        self.num_draft_tokens = num_draft_tokens
        self.contract: Contract | None = None

    @property
    def token_ids(self) -> bool:
        return self.contract is not None and self.contract.kind == TOKEN_IDS

    def describe(self) -> dict:
        c = prepared(self.contract)
        return {"protocol": "triton-http", "url": self.url, "model": self.model, "contract": c.kind,
                "decoupled": c.decoupled, "server_token_counts": c.server_counts, "endpoint": self._endpoint}

    def prepare(self, timeout_s: float = 5.0) -> Contract:
        status, _ = get_json(f"{self.url}/v2/health/live", timeout_s)
        if status != 200:
            raise ToolchainError(f"{self.url} does not answer as a Triton server (GET /v2/health/live: {status})",
                                 "pass --url with Triton's HTTP port")
        status, _ = get_json(f"{self.url}/v2/models/{self.model}/ready", timeout_s)
        if status != 200:
            _, index = get_json(f"{self.url}/v2/repository/index", timeout_s, method="POST", body={})
            ready_or_raise(self.model, self.url, index if isinstance(index, list) else [])
        status, meta = get_json(f"{self.url}/v2/models/{self.model}", timeout_s)
        status2, config = get_json(f"{self.url}/v2/models/{self.model}/config", timeout_s)
        if status != 200 or status2 != 200:
            raise ToolchainError(f"Triton server at {self.url} failed a metadata call for '{self.model}': "
                                 f"{error_text(status if status != 200 else status2, meta if status != 200 else config)}")
        self.contract = detect(self.model, self.url, meta, config, streaming=self.streaming)
        check_lora(self.contract, self.url, self.adapters)
        self._endpoint = "generate_stream" if self.streaming or self.contract.decoupled else "generate"
        return self.contract

    @property
    def inputs_sent(self) -> list[str]:
        return list(self._body(None, "x", [1], 2, 0, next(iter(self.adapters), None)))

    def _body(self, rec, text, ids, max_tokens: int, priority: int, adapter: str | None = None) -> dict:
        tensors = request_tensors(prepared(self.contract), text=text, ids=ids, max_tokens=max_tokens,
                                  streaming=self.streaming, ignore_eos=self.ignore_eos,
                                  exclude_input=self.exclude_input, num_draft_tokens=self.num_draft_tokens,
                                  lora_task_id=None if adapter is None else self.adapters[adapter])
        body = {}
        for name, dtype, arr in tensors:
            if dtype == "BYTES":
                body[name] = arr.ravel()[0].decode("utf-8")
            elif name == "input_ids":
                body[name] = arr.ravel().tolist()
            else:
                body[name] = arr.ravel()[0].item()
        if rec is not None:
            body["id"] = rec.request_id
        if priority:
            body["parameters"] = {"priority": priority}
        return body

    def build(self, rec, prompt, turn, priority: int) -> bytes:
        return json.dumps(self._body(rec, prompt.text, prompt.ids, turn.max_tokens, priority,
                                     prompt.adapter)).encode()

    async def run(self, rec, prompt, turn, priority: int = 0, request=None) -> Reply:
        data = request if request is not None else self.build(rec, prompt, turn, priority)
        st = Stream(rec, turn.cancel_after, self.keep_text)
        c = prepared(self.contract)
        token_ids = c.kind == TOKEN_IDS
        if c.server_counts:
            rec.token_source = "server"
        path = f"/v2/models/{self.model}/{self._endpoint}"
        rec.t_send = time.perf_counter_ns()
        try:
            async with await self.http.post(path, data) as resp:
                rec.t_status, rec.status = time.perf_counter_ns(), f"HTTP {resp.status}"
                if resp.status != 200:
                    rec.error = error_text(resp.status, await resp.payload())
                    rec.t_final = time.perf_counter_ns()
                    return st.reply()
                if self._endpoint == "generate":
                    body = await resp.read()
                    self._handle(st, time.perf_counter_ns(), json.loads(body), token_ids)
                else:
                    async for t, data in self.events(resp):
                        obj = json.loads(data)
                        if "error" in obj:
                            rec.error = " ".join(str(obj["error"]).split())[:200]
                            break
                        if self._handle(st, t, obj, token_ids):
                            resp.close()  # dropping the connection is how an HTTP client cancels
                            return st.reply()
                if rec.t_final is None:
                    rec.t_final = time.perf_counter_ns()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            rec.error = f"HTTP {short(err)}"
        if c.server_counts and rec.error is None:
            rec.server_osl = st.tokens if token_ids else st.cumulative
        return st.reply()

    def _handle(self, st: Stream, t: int, obj: dict, token_ids: bool) -> bool:
        if token_ids:
            ids = np.asarray(obj.get("output_ids", []), np.int64).ravel()
            ids = ids[ids >= 0]
            return st.counted(t, int(ids.size), ids=ids.tolist())
        record_drafts(st.rec, {n: np.asarray(obj[n]).ravel()[0] for n in DRAFT_OUTPUTS if n in obj})
        text = obj.get("text_output")
        if isinstance(text, list):
            text = "".join(map(str, text))
        if "num_output_tokens" in obj:
            total = int(np.asarray(obj["num_output_tokens"]).ravel()[0])
            n, st.cumulative = max(0, total - st.cumulative), max(total, st.cumulative)
            return st.counted(t, n, text=text)
        return st.text(t, text or "")
