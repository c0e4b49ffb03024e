"""`create_app`: trtllm-serve's HTTP API (TensorRT-LLM 1.2 `tensorrt_llm/serve/openai_server.py`)
over the CPU engine.

Routes: GET /health, /health_generate, /version, /v1/models, /metrics (iteration
stats JSON), /prometheus/metrics; POST /v1/completions, /v1/chat/completions,
streaming as server-sent events. Every refusal is an ErrorResponse body with
status 400 (404 for a model name this server does not serve, 429 when the
engine's queue is full), and the server keeps serving. A client that goes away
cancels its request in the batcher, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import toolchain
from toolchain.errors import ToolchainError
from toolchain.engine.cpu import CpuEngine, QueueFull, SamplingParams, SchedulerConfig
from toolchain.engine.cpu.sampling import UnseededStream
from toolchain.openai.chat_output import ChatAnswer, effective_tool_choice
from toolchain.openai.metrics import ServerMetrics
from toolchain.openai.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, Envelope, error_body,
                                       model_list, validation_message)
from toolchain.openai.service import EngineService, Generation
from toolchain.openai.text import Detokenizer, StopStrings, TextCodec
from toolchain.openai.tools import parsers_problem, request_problem

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.2


def _error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status), status_code=int(status))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenAIFrontend:
    """The request handlers and the state they share; `create_app` wires them."""

    def __init__(self, engine: CpuEngine, codec: TextCodec, model: str, scheduler: SchedulerConfig | None,
                 engine_type: str, tool_parser: str | None = None, reasoning_parser: str | None = None):
        self.engine, self.codec, self.model = engine, codec, model
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser  # trtllm-serve's names
        self.metrics = ServerMetrics(model, engine_type)
        self.service = EngineService(engine, scheduler, on_iteration=self.metrics.iteration)
        self.created = int(time.time())
        self.seeds = UnseededStream()  # trtllm-serve runs the PyTorch backend: unseeded requests differ

    # -- request -> engine ----------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.model:
            # trtllm-serve 1.2 ignores the name; OpenAI answers an unknown model with 404, and a
            # client that names the wrong model should learn it rather than get another model's text.
            raise ApiError(f"model {name!r} is not served here; this server serves {self.model!r} (GET /v1/models)",
                           HTTPStatus.NOT_FOUND, "NotFoundError")

    def _prompt_ids(self, req) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            messages = [m.for_template() for m in req.messages]
            text = self.codec.chat_prompt(messages, req.add_generation_prompt, req.chat_template,
                                          req.chat_template_kwargs, tools=req.tools)
            return self.codec.encode(text, add_special_tokens=req.add_special_tokens)
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise ApiError("prompt is empty: send at least one token of text")
            ids = self.codec.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            if not ids:
                raise ApiError("prompt encodes to no tokens: send some text the tokenizer knows")
            return ids
        if not req.prompt:
            raise ApiError("prompt is empty: send a string or a non-empty list of token ids")
        return list(req.prompt)

    def _sampling(self, req, prompt: list[int]) -> SamplingParams:
        lim = self.engine.limits
        if len(prompt) > lim.max_input_len:
            raise ApiError(f"the prompt has {len(prompt)} tokens, more than the engine's max_input_len "
                           f"{lim.max_input_len}; shorten it")
        room = lim.max_seq_len - len(prompt)
        max_tokens = req.max_tokens
        if max_tokens is None:
            # trtllm-serve passes an absent max_tokens on as None and the executor deduces it as whatever
            # max_seq_len leaves after the prompt (NVIDIA/TensorRT-LLM tensorrt_llm/executor/base_worker.py,
            # _deduce_max_tokens: default_max_tokens = max_seq_len - prompt_len).
            max_tokens = room
        elif max_tokens < 1:
            raise ApiError(f"max_tokens must be at least 1, got {max_tokens}")
        elif max_tokens > room:
            raise ApiError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                           f"max_seq_len {lim.max_seq_len}; ask for at most {room} tokens")
        if room < 1:
            raise ApiError(f"the prompt ({len(prompt)} tokens) leaves no room under max_seq_len {lim.max_seq_len}")
        if req.temperature is not None and req.temperature < 0:
            raise ApiError(f"temperature must be >= 0, got {req.temperature}")
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise ApiError(f"top_p must be in (0, 1], got {req.top_p}")
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p,
            seed=self.seeds.seed(req.seed),
            end_id=-1 if req.ignore_eos else self.codec.end_id,
            stop_words=[] if req.ignore_eos else [[i] for i in self.codec.stop_ids],
            min_tokens=req.min_tokens)

    def _start(self, req) -> Generation:
        self._check_model(req.model)
        reason = req.unsupported()
        if not reason and isinstance(req, ChatCompletionRequest):
            reason = request_problem(req.tools, effective_tool_choice(req), self.tool_parser)
        if reason:
            raise ApiError(reason)
        prompt = self._prompt_ids(req)
        params = self._sampling(req, prompt)
        problem = self.engine.request_problem(prompt, params)
        if problem:
            raise ApiError(problem)
        try:
            return self.service.submit(prompt, params, req.priority)
        except QueueFull as err:
            raise ApiError(str(err), HTTPStatus.TOO_MANY_REQUESTS, "RateLimitError") from None
        except (ValueError, RuntimeError) as err:
            raise ApiError(str(err), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError") from None

    async def _pieces(self, gen: Generation, req):
        """(text to send, finish_reason, stop_reason) as tokens arrive; the last one has a finish_reason,
        None when the request was cancelled under it."""
        detok = Detokenizer(self.codec, req.skip_special_tokens)
        stops = StopStrings(req.stop_strings())
        async for tokens, finished in gen.events():
            piece = stops.feed(detok.push(tokens)) if tokens else ""
            if finished and stops.hit is None:
                piece += stops.feed(detok.finish())
            if stops.hit is not None:
                self.service.release(gen)  # the engine need not go on
                self.metrics.request_done(gen, "stop")
                yield piece, "stop", stops.hit
                return
            if finished:
                if gen.cancelled:
                    yield piece, None, None
                    return
                reason = gen.finish_reason(self.codec.stop_ids)
                self.metrics.request_done(gen, reason)
                yield piece + stops.flush(), reason, None
                return
            if piece:
                yield piece, None, None

    async def _watch(self, raw: Request, gen: Generation) -> None:
        """Cancel `gen` when its client goes away (upstream polls is_disconnected the same way)."""
        while not gen.done:
            if await raw.is_disconnected():
                log.info("client gone; cancelling request %s", gen.request_id)
                self.service.release(gen)
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    # -- responses --------------------------------------------------------------------------

    async def respond(self, req, raw: Request) -> Response:
        env = Envelope(isinstance(req, ChatCompletionRequest), self.model)
        gen = self._start(req)
        answer = ChatAnswer.wanted(req, self.tool_parser, self.reasoning_parser) if env.chat else None
        watcher = asyncio.create_task(self._watch(raw, gen))
        if req.stream:
            return StreamingResponse(self._stream(gen, req, env, watcher, answer), media_type="text/event-stream")
        try:
            text, reason, stop_reason = [], None, None
            async for piece, reason, stop_reason in self._pieces(gen, req):  # noqa: B007 - the last ones are kept
                text.append(piece)
        except RuntimeError as err:
            return _error(f"generation failed: {err}", HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        finally:
            watcher.cancel()
            self.service.release(gen)
        message = answer.message("".join(text)) if answer is not None else None
        if answer is not None:
            reason = answer.finish_reason(reason)
        return JSONResponse(env.final("".join(text), reason, stop_reason, len(gen.prompt_ids), len(gen.output),
                                      message=message))

    async def _stream(self, gen: Generation, req, env: Envelope, watcher: asyncio.Task,
                      answer: ChatAnswer | None = None):
        try:
            if env.chat:  # OpenAI's first chat chunk names the role
                yield _sse(env.chunk("", role=True))
            try:
                async for piece, reason, stop_reason in self._pieces(gen, req):
                    if reason is None and gen.cancelled:
                        return  # the client is gone
                    if answer is not None:  # reasoning and tool calls parsed out of the pieces
                        delta = answer.delta(piece, reason is not None)
                        if delta or reason is not None:
                            yield _sse(env.chunk(None, answer.finish_reason(reason), stop_reason, delta=delta))
                    elif piece or reason is not None:
                        yield _sse(env.chunk(piece, reason, stop_reason))
            except RuntimeError as err:
                body = error_body(f"generation failed: {err}", "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)
                yield _sse(body)
            else:
                if req.include_usage():
                    yield _sse(env.usage_chunk(len(gen.prompt_ids), len(gen.output)))
            yield "data: [DONE]\n\n"
        finally:  # also when the response task is cancelled because the client left
            watcher.cancel()
            self.service.release(gen)

    # -- small endpoints ------------------------------------------------------------------------

    async def health(self) -> Response:
        if self.service.batcher.alive:
            return Response(status_code=200)
        return Response("the CPU engine is not running; see the server log", status_code=503)

    async def health_generate(self, raw: Request) -> Response:
        """One greedy token from a tiny prompt, through the same path as a completion."""
        try:
            req = CompletionRequest(model=self.model, prompt=self.codec.encode("hi") or [0], max_tokens=1,
                                    temperature=0.0)
            gen = self._start(req)
            try:
                async for _ in self._pieces(gen, req):
                    pass
            finally:
                self.service.release(gen)
            return Response("Generation health check OK", status_code=200)
        except Exception as err:
            msg = err.message if isinstance(err, ApiError) else f"{type(err).__name__}: {err}"
            return Response(f"Generation health check failed: {msg}", status_code=500)

    async def iteration_stats(self) -> JSONResponse:
        return JSONResponse(self.service.batcher.drain())

    async def prometheus(self) -> Response:
        if not self.service.inflight and self.service.batcher.stats.active == 0:
            self.metrics.idle(self.engine.kv)
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def create_app(engine: CpuEngine, tokenizer: TextCodec | Path | str, served_model_name: str, *,
               scheduler: SchedulerConfig | None = None, chat_template: str | None = None,
               engine_type: str = "cpu", trust_remote_code: bool = False, tool_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """A FastAPI app serving `engine` under `served_model_name`. `tokenizer` is the Hugging Face
    tokenizer directory (or a loaded TextCodec); `chat_template` (Jinja text) replaces the
    tokenizer's own; `trust_remote_code` lets a tokenizer directory's own code run; `tool_parser` and
    `reasoning_parser` are trtllm-serve's --tool_parser / --reasoning_parser (parsers_problem refuses a
    name or family they cannot serve). The batcher starts with the app's lifespan and stops with it."""
    problem = parsers_problem(tool_parser, reasoning_parser, engine.dims.architecture)
    if problem:
        raise ToolchainError(problem)
    codec = tokenizer if isinstance(tokenizer, TextCodec) else TextCodec(tokenizer, chat_template, trust_remote_code)
    if chat_template is not None:
        codec.chat_template = chat_template
    front = OpenAIFrontend(engine, codec, served_model_name, scheduler, engine_type, tool_parser, reasoning_parser)

    @asynccontextmanager
    async def lifespan(_app):
        front.service.start()
        try:
            yield
        finally:
            front.service.stop()

    app = FastAPI(title="trtllm-toolchain OpenAI server", lifespan=lifespan)
    app.state.frontend = front

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return _error(validation_message(list(exc.errors())))

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=int(exc.status))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await front.respond(request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await front.respond(request, raw)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(front.model, front.created))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": toolchain.__version__})

    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/health_generate", front.health_generate, methods=["GET"])
    app.add_api_route("/metrics", front.iteration_stats, methods=["GET"])
    app.add_api_route("/prometheus/metrics", front.prometheus, methods=["GET"])
    return app
