"""Triton gRPC streaming (`ModelStreamInfer`) on asyncio, for both Triton contracts.

Persistent streams over one shared HTTP/2 channel, one request in flight per
stream: a request takes an idle stream (or opens one), and gives it back once
its final response arrived. Opening a stream per request cost about a
millisecond of TTFT on a 2-core box (the call set-up, its metadata and a
request-iterator task before the request reaches the wire), and that is the
client's, not the server's. One request per stream keeps what the per-request
streams gave: a failed request's error belongs to exactly that request
(Triton's stream error messages need not carry a request id), and cancelling
a request (timeout or cancel_fraction) cancels only its own stream, which
Triton passes on to the model as a cancellation. A stream whose request
failed, was cancelled or timed out is closed, never reused; the next request
opens a fresh one.

Requests are protobufs built here with raw tensor contents and serialized in
`build()`, before `t_send` is stamped, so the send path is a stamp and a
write. They can carry `triton_enable_empty_final_response` (which
tritonclient refuses as a reserved parameter): the flag-only final response
then arrives and E2E-final is exact; it is also what tells a stream is free
again. Responses come off the stream as bytes and are parsed after the
arrival stamp.
"""

from __future__ import annotations

import asyncio
import struct
import time

import numpy as np

from toolchain.bench.protocols.transport import Reply, Stream, short
from toolchain.bench.protocols.contract import (DRAFT_OUTPUTS, LLMAPI, TOKEN_IDS, Contract, check_lora, detect,
                                                prepared, ready_or_raise, record_drafts, request_tensors,
                                                requested_outputs)
from toolchain.errors import ToolchainError

_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def _raw(dtype: str, arr: np.ndarray) -> bytes:
    if dtype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in arr.ravel())
    return np.ascontiguousarray(arr).tobytes()


def _strings(raw: bytes) -> str:
    out, i = [], 0
    while i + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4:i + 4 + n].decode("utf-8", "replace"))
        i += 4 + n
    return "".join(out)


class TritonGrpc:
    chat = False

    def __init__(self, url: str, model: str, *, streaming: bool = True, ignore_eos: bool = True,
                 exclude_input: bool | None = True, keep_text: bool = False, num_draft_tokens: int = 0,
                 adapters: dict[str, int] | None = None, **_):
        self.url = url.strip().removeprefix("grpc://")
        self.adapters = adapters or {}
        """LoRA adapter name -> task id, for the adapters the workload's classes name."""
        if ":" not in self.url:
            raise ToolchainError(f"bad gRPC URL '{url}'", "pass --url host:port, e.g. 127.0.0.1:8001")
        self.model, self.streaming, self.ignore_eos, self.exclude_input = model, streaming, ignore_eos, exclude_input
        self.keep_text = keep_text
        self.num_draft_tokens = num_draft_tokens
        self.contract: Contract | None = None
        self._channel = None
        self._idle: list = []
        self._seq = 0

    @property
    def token_ids(self) -> bool:
        return self.contract is not None and self.contract.kind == TOKEN_IDS

    def describe(self) -> dict:
        c = prepared(self.contract)
        return {"protocol": "triton-grpc", "url": self.url, "model": self.model, "contract": c.kind,
                "decoupled": c.decoupled, "server_token_counts": c.server_counts,
                "outputs_requested": requested_outputs(c)}

    # ---- checks (sync, before the load) --------------------------------------------------------------------
    def prepare(self, timeout_s: float = 5.0) -> Contract:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            client = grpcclient.InferenceServerClient(self.url)
        except Exception as err:
            raise ToolchainError(f"bad Triton gRPC URL '{self.url}': {short(err)}", "pass --url host:port") from None
        try:
            try:
                client.is_server_live(client_timeout=timeout_s)
            except InferenceServerException as err:
                raise ToolchainError(f"Triton server not reachable at {self.url} ({short(err)})",
                                     "start it with `toolchain serve SPEC` or pass --url host:port") from None
            if not client.is_model_ready(self.model, client_timeout=timeout_s):
                index = client.get_model_repository_index(as_json=True, client_timeout=timeout_s).get("models", [])
                ready_or_raise(self.model, self.url, index)
            meta = client.get_model_metadata(self.model, as_json=True, client_timeout=timeout_s)
            config = client.get_model_config(self.model, as_json=True, client_timeout=timeout_s).get("config", {})
        except InferenceServerException as err:
            raise ToolchainError(f"Triton server at {self.url} failed a metadata call for '{self.model}': "
                                 f"{short(err)}") from None
        finally:
            client.close()
        self.contract = detect(self.model, self.url, meta, config, streaming=self.streaming)
        check_lora(self.contract, self.url, self.adapters)
        return self.contract

    @property
    def inputs_sent(self) -> list[str]:
        probe = request_tensors(prepared(self.contract), text="x", ids=[1], max_tokens=2, streaming=self.streaming,
                                ignore_eos=self.ignore_eos, exclude_input=self.exclude_input,
                                num_draft_tokens=self.num_draft_tokens,
                                lora_task_id=next(iter(self.adapters.values()), None))
        return [name for name, _, _ in probe]

    # ---- run -----------------------------------------------------------------------------------------------
    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2

        self._pb = service_pb2
        self._parse = service_pb2.ModelStreamInferResponse.FromString
        self._eof = grpc.aio.EOF
        # Large messages: long prompts as token ids; no keepalive pings to disturb timing.
        self._channel = channel = grpc.aio.insecure_channel(self.url, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        # No (de)serializers: build() hands over bytes, and responses are parsed after they are stamped.
        self._stream = channel.stream_stream(_STREAM_METHOD)
        self._idle = []  # streams with nothing in flight, the most recently used last
        self._outputs = [service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=n)
                         for n in requested_outputs(prepared(self.contract), speculative=bool(self.num_draft_tokens))]

    async def close(self) -> None:
        for call in self._idle:
            call.cancel()
        self._idle = []
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def build(self, rec, prompt, turn, priority: int) -> bytes:
        pb = self._pb
        tensors = request_tensors(prepared(self.contract), text=prompt.text, ids=prompt.ids, max_tokens=turn.max_tokens,
                                  streaming=self.streaming, ignore_eos=self.ignore_eos,
                                  exclude_input=self.exclude_input, num_draft_tokens=self.num_draft_tokens,
                                  lora_task_id=None if prompt.adapter is None else self.adapters[prompt.adapter])
        req = pb.ModelInferRequest(model_name=self.model, id=rec.request_id, outputs=self._outputs)
        for name, dtype, arr in tensors:
            req.inputs.append(pb.ModelInferRequest.InferInputTensor(name=name, datatype=dtype, shape=arr.shape))
            req.raw_input_contents.append(_raw(dtype, arr))
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        if priority:
            req.parameters["priority"].uint64_param = priority
        return req.SerializeToString()

    def _take(self):
        """(an idle stream, True), or (a new one, False). A stream the server has ended is dropped."""
        while self._idle:
            call = self._idle.pop()
            if not call.done():
                return call, True
        return self._stream(), False

    async def run(self, rec, prompt, turn, priority: int = 0, request=None) -> Reply:
        req = request if request is not None else self.build(rec, prompt, turn, priority)
        st = Stream(rec, turn.cancel_after, self.keep_text)
        c = prepared(self.contract)
        token_ids = c.kind == TOKEN_IDS
        parse, eof = self._parse, self._eof
        if c.server_counts:
            rec.token_source = "server"
        call, reused = self._take()
        free = False  # True once the final response arrived: the stream can take the next request
        try:
            rec.t_send = time.perf_counter_ns()
            try:
                await call.write(req)
            except Exception:  # AioRpcError, InvalidStateError (CancelledError is not an Exception)
                if not reused:
                    raise
                # An idle stream the server closed meanwhile (the message never went out): open a fresh one.
                call.cancel()
                call, reused = self._stream(), False
                rec.t_send = time.perf_counter_ns()
                await call.write(req)
            while True:
                raw = await call.read()
                t = time.perf_counter_ns()
                if raw is eof:
                    if rec.t_final is None and rec.error is None:
                        rec.error = "stream ended without a final response"
                    break
                msg = parse(raw)
                if msg.error_message:
                    rec.error = " ".join(msg.error_message.split())[:200]
                    rec.t_final = t
                    break
                resp = msg.infer_response
                if self._handle(st, t, resp, token_ids):
                    break  # cancelled after cancel_after tokens: the stream is cancelled below
                param = resp.parameters.get("triton_final_response")
                if param is not None and param.bool_param:
                    rec.t_final = t
                    free = True
                    break
        except asyncio.CancelledError:  # the caller's timeout: cancelling the stream cancels the request
            raise
        except Exception as err:  # grpc.aio.AioRpcError and friends: the server went away
            rec.error = f"gRPC {short(err)}"
        finally:
            if free:
                self._idle.append(call)
            else:
                call.cancel()
        if c.server_counts and rec.error is None:
            rec.server_osl = st.tokens if token_ids else st.cumulative
        return st.reply()
    def _handle(self, st: Stream, t: int, resp, token_ids: bool) -> bool:
        names = [o.name for o in resp.outputs]
        raw = dict(zip(names, resp.raw_output_contents, strict=False))
        if token_ids:
            if "output_ids" not in raw:
                if "triton_final_response" in resp.parameters and resp.parameters["triton_final_response"].bool_param:
                    return False
                return st.counted(t, 0)
            ids = np.frombuffer(raw["output_ids"], np.int32)
            ids = ids[ids >= 0]  # beams are padded with -1
            return st.counted(t, int(ids.size), ids=ids.tolist())
        text = _strings(raw["text_output"]) if "text_output" in raw else None
        if text is not None and prepared(self.contract).kind == LLMAPI:
            text = st.new_text(text)
        record_drafts(st.rec, {n: np.frombuffer(raw[n], np.int32)[0] for n in DRAFT_OUTPUTS if n in raw})
        if "num_output_tokens" in raw:
            total = int(np.frombuffer(raw["num_output_tokens"], np.int32)[0])
            n, st.cumulative = max(0, total - st.cumulative), max(total, st.cumulative)
            return st.counted(t, n, text=text)
        if text is None:
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param and not names:
                return False  # flag-only final: not a response carrying output
            return st.text(t, "")
        return st.text(t, text)
