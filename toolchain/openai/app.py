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
from dataclasses import dataclass, replace
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import toolchain
from toolchain.errors import ToolchainError
from toolchain.engine.cpu import CpuEngine, QueueFull, SchedulerConfig
from toolchain.engine.cpu.beams import children
from toolchain.engine.cpu.guided import GuidedDecoder
from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.engine.cpu.sampling import UnseededStream
from toolchain.llmapi.lora import AdapterLoader, LoRARequest
from toolchain.openai.chat_output import ChatAnswer, effective_tool_choice
from toolchain.openai.logprobs import LogprobShaper, empty, extend, prompt_logprobs, whole_logprobs
from toolchain.openai.metrics import ServerMetrics
from toolchain.openai.params import engine_params, logprob_counts
from toolchain.openai.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, Envelope, error_body,
                                       merged, model_list, usage, validation_message)
from toolchain.openai.service import EngineService, Generation, merge_streams
from toolchain.openai.structured import guide_for
from toolchain.openai.text import Detokenizer, StopStrings, TextCodec
from toolchain.openai.tools import parsers_problem, request_problem

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.2
# trtllm-serve's answer to response_format when its LLM arguments lack guided_decoding_backend (the words clients
# quote; UNVERIFIED where upstream raises it), then how to turn it on.
GUIDED_OFF = ("Guided decoding is not enabled for this server; start the server with guided_decoding_backend: "
              "xgrammar in its LLM-API options (spec: serving.guided_decoding_backend)")


def _error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status), status_code=int(status))


@dataclass
class Choice:
    """One prompt's generation within a request: its choice index and the prompt text echoed before it."""

    index: int
    gen: Generation
    echo: str = ""
    first: bool = True  # its prompt's first sequence: the one whose prompt tokens the usage counts
    prompt: int = 0  # which prompt of the request
    beam: int | None = None  # beam search: which of `beams` it answers (every beam shares one generation)
    beams: list | None = None  # the generation's returned beams (beams.BeamResult), filled when it ends


# As the executor splits a request for n sampled sequences into child requests (LlmRequest::createChildRequest,
# cpp/tensorrt_llm/batch_manager/llmRequest.cpp), each its own generation, child j seeded with the request's
# seed + j (the rule engine/cpu/beams.py `children` follows; UNVERIFIED, as noted there). Sampled best_of > n
# generates best_of children and answers the n with the highest cumulative log-prob, best first (the LLM API's
# SamplingParams doc: "sampling best_of responses and return n generations"; vLLM ranks by cumulative log-prob,
# UNVERIFIED that trtllm-serve's order is the same), from a "raw" log-prob record each child keeps. Beam search
# (use_beam_search) is one engine request of beam width best_of (or n) returning its n best beams, choice
# i * n + j being prompt i's beam j.


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenAIFrontend:
    """The request handlers and the state they share; `create_app` wires them."""

    def __init__(self, engine: CpuEngine, codec: TextCodec, model: str, scheduler: SchedulerConfig | None,
                 engine_type: str, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 guided_decoding_backend: str | None = None, lora_adapters: dict[str, Path] | None = None):
        self.engine, self.codec, self.model = engine, codec, model
        # Served adapter name -> PEFT directory; lora_int_id = place + 1 (spec_lora.LoraSection.task_id).
        self.adapters = {name: LoRARequest(name, i + 1, str(path))
                         for i, (name, path) in enumerate((lora_adapters or {}).items())}
        self.lora = AdapterLoader(engine)
        self.guided_decoding_backend = guided_decoding_backend  # LLM()'s; None: response_format is refused
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser  # trtllm-serve's names
        self.metrics = ServerMetrics(model, engine_type)
        self.service = EngineService(engine, scheduler, on_iteration=self.metrics.iteration)
        self.created = int(time.time())
        self.seeds = UnseededStream()  # trtllm-serve runs the PyTorch backend: unseeded requests differ

    # -- request -> engine ----------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.model and name not in self.adapters:
            # trtllm-serve 1.2 ignores the name; OpenAI answers an unknown model with 404, and a
            # client that names the wrong model should learn it rather than get another model's text.
            message = (f"The model `{name}` does not exist." if self.adapters else  # OpenAI's words, as vLLM's
                       f"model {name!r} is not served here; this server serves {self.model!r} (GET /v1/models)")
            raise ApiError(message, HTTPStatus.NOT_FOUND, "NotFoundError")

    def _lora_task(self, req) -> int | None:
        """The engine task id of the request's adapter: trtllm-serve's `lora_request` body field first, else the
        adapter `model` names (this server's extension, as vLLM and Dynamo select adapters); None: the base."""
        lora = req.lora_request or self.adapters.get(req.model)
        try:
            return self.lora.task_id(lora)
        except ValueError as err:
            raise ApiError(str(err)) from None

    def _prompts(self, req) -> list[tuple[list[int], str | None]]:
        """(token ids, text) of each prompt; text is None for a prompt sent as token ids."""
        if isinstance(req, ChatCompletionRequest):
            messages = [m.for_template() for m in req.messages]
            text = self.codec.chat_prompt(messages, req.add_generation_prompt, req.chat_template,
                                          req.chat_template_kwargs, tools=req.tools)
            return [(self.codec.encode(text, add_special_tokens=req.add_special_tokens), text)]
        out: list[tuple[list[int], str | None]] = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                if not prompt:
                    raise ApiError("prompt is empty: send at least one token of text")
                ids = self.codec.encode(prompt, add_special_tokens=req.add_special_tokens)
                if not ids:
                    raise ApiError("prompt encodes to no tokens: send some text the tokenizer knows")
                out.append((ids, prompt))
            elif not prompt:
                raise ApiError("prompt is empty: send a string or a non-empty list of token ids")
            else:
                out.append((list(prompt), None))
        return out

    def _start(self, req) -> list[Choice]:
        """Every prompt of `req` checked, then submitted: one Choice each (all or none)."""
        self._check_model(req.model)
        reason = req.unsupported()
        if not reason and isinstance(req, ChatCompletionRequest):
            reason = request_problem(req.tools, effective_tool_choice(req), self.tool_parser)
        if reason:
            raise ApiError(reason)
        guide = guide_for(req.response_format)
        if guide is not None and self.guided_decoding_backend is None:
            raise ApiError(GUIDED_OFF)
        if guide is not None:
            self.guided_decoding()
        chat = isinstance(req, ChatCompletionRequest)
        planned = []
        task = self._lora_task(req)
        for ids, text in self._prompts(req):
            params = engine_params(req, ids, limits=self.engine.limits, vocab_size=self.engine.vocab_size,
                                   end_id=self.codec.end_id, stop_ids=self.codec.stop_ids,
                                   seed=self.seeds.seed(req.seed), guide=guide)
            if task is not None:
                params = replace(params, lora_task_id=task)
            problem = self.engine.request_problem(ids, params)
            if problem:
                raise ApiError(problem)
            planned.append((ids, text, params))
        choices: list[Choice] = []
        try:
            for i, (ids, text, params) in enumerate(planned):
                echo = "" if chat or not req.echo else (text if text is not None else
                                                        self.codec.decode(ids, req.skip_special_tokens))
                if params.beam_width > 1:
                    results: list = []
                    gen = self.service.submit(ids, params, req.priority, beam_results=results)
                    choices += [Choice(i * req.n + j, gen, echo, first=j == 0, prompt=i, beam=j, beams=results)
                                for j in range(req.n)]
                    continue
                count = req.sampled_best_of()  # n, or best_of when above it (the n best kept, _prompt_bodies)
                for j, child in enumerate(children(replace(params, num_return_sequences=count))):
                    record = TokenLogprobs() if child.logprobs is not None or child.prompt_logprobs is not None else None
                    gen = self.service.submit(ids, child, req.priority, logprobs=record)
                    # trtllm-serve's order: prompt i's sequence j is choice i * n + j.
                    choices.append(Choice(i * count + j, gen, echo, first=j == 0, prompt=i))
        except QueueFull as err:
            self._release(choices)
            raise ApiError(str(err), HTTPStatus.TOO_MANY_REQUESTS, "RateLimitError") from None
        except (ValueError, RuntimeError) as err:
            self._release(choices)
            raise ApiError(str(err), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError") from None
        return choices

    def guided_decoding(self) -> None:
        """The engine's guided decoder, made from the tokenizer on first use."""
        if getattr(self.engine, "guided", None) is None:
            self.engine.guided = GuidedDecoder.from_tokenizer_dir(self.codec.directory, self.engine.vocab_size,
                                                               trust_remote_code=self.codec.trust_remote_code)

    def _release(self, choices: list[Choice]) -> None:
        for c in choices:
            self.service.release(c.gen)

    def _shaper(self, choice: Choice, req) -> LogprobShaper | None:
        gen = choice.gen
        if gen.logprobs is None or logprob_counts(req)[0] is None:  # a record kept to rank best_of only
            return None
        if isinstance(req, ChatCompletionRequest):
            return LogprobShaper(self.codec, gen.logprobs, True, req.top_logprobs or 0)
        return LogprobShaper(self.codec, gen.logprobs, False, req.logprobs, len(choice.echo))

    def _echoed(self, choice: Choice, req) -> dict | None:
        """Completions' echoed prompt's log-probs (with echo and logprobs)."""
        gen = choice.gen
        if not choice.echo or gen.params.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.codec, gen.prompt_ids, gen.logprobs, req.logprobs, req.skip_special_tokens)

    async def _pieces(self, choice: Choice, req):
        """(text to send, finish_reason, stop_reason, log-probs of the tokens whose text it is) as tokens
        arrive; the last one has a finish_reason, None when the request was cancelled under it."""
        gen = choice.gen
        detok = Detokenizer(self.codec, req.skip_special_tokens)
        stops = StopStrings(req.stop_strings(), req.include_stop_str_in_output)
        shaper = self._shaper(choice, req)
        user_stops = set(req.stop_token_ids or ())
        sent = 0  # characters of generated text released

        def push(tokens: list[int]) -> str:
            if shaper is None:
                return detok.push(tokens)
            piece = ""
            for t in tokens:
                shaper.add(t, len(detok.text))
                piece += detok.push([t])
            return piece

        async for tokens, finished in gen.events():
            stop_token = None
            if (finished and tokens and tokens[-1] in user_stops and gen.stats.finish_reason == "stop_word"
                    and not req.include_stop_str_in_output):
                # A stop token id ends the text and is left out of it (the LLM API drops it too).
                stop_token, tokens = tokens[-1], tokens[:-1]
            elif finished and tokens and tokens[-1] in user_stops and gen.stats.finish_reason == "stop_word":
                stop_token = tokens[-1]
            piece = stops.feed(push(tokens)) if tokens else ""
            if finished and stops.hit is None:
                piece += stops.feed(detok.finish())
            if stops.hit is not None:
                self.service.release(gen)  # the engine need not go on
                self.metrics.request_done(gen, "stop")
                sent += len(piece)
                yield piece, "stop", stops.hit, shaper and shaper.release(sent)
                return
            if finished:
                if gen.cancelled:
                    yield piece, None, None, None
                    return
                reason = gen.finish_reason(self.codec.stop_ids)
                self.metrics.request_done(gen, reason)
                yield piece + stops.flush(), reason, stop_token, shaper and shaper.release(None)
                return
            sent += len(piece)
            lp = shaper and shaper.release(sent)
            if piece or lp:
                yield piece, None, None, lp

    async def _watch(self, raw: Request, choices: list[Choice]) -> None:
        """Cancel the request's generations when its client goes away (upstream polls is_disconnected the
        same way)."""
        while not all(c.gen.done for c in choices):
            if await raw.is_disconnected():
                log.info("client gone; cancelling request %s", choices[0].gen.request_id)
                self._release(choices)
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    # -- responses --------------------------------------------------------------------------

    async def respond(self, req, raw: Request) -> Response:
        # An adapter's answers carry its name, as vLLM's do.
        env = Envelope(isinstance(req, ChatCompletionRequest), req.model if req.model in self.adapters else self.model)
        choices = self._start(req)
        watcher = asyncio.create_task(self._watch(raw, choices))
        if req.stream:
            return StreamingResponse(self._stream(choices, req, env, watcher), media_type="text/event-stream")
        prompts: dict[int, list[Choice]] = {}
        for c in choices:
            prompts.setdefault(c.prompt, []).append(c)
        try:
            per_prompt = await asyncio.gather(*(self._prompt_bodies(cs, req, env) for cs in prompts.values()))
        except RuntimeError as err:
            return _error(f"generation failed: {err}", HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        finally:
            watcher.cancel()
            self._release(choices)
        return JSONResponse(merged([body for bodies in per_prompt for body in bodies]))

    async def _prompt_bodies(self, choices: list[Choice], req, env: Envelope) -> list[dict]:
        """One prompt's n bodies: its beams', the n best of its best_of sampled sequences, or its n sequences."""
        if choices[0].beams is not None:
            return await self._beam_bodies(choices, req, env)
        bodies = list(await asyncio.gather(*(self._complete(c, req, env) for c in choices)))
        if len(choices) == req.n:
            return bodies
        # Sampled best_of > n: the n with the highest cumulative log-prob, best first (ties: the earlier child).
        ranked = sorted(range(len(choices)), key=lambda j: -choices[j].gen.logprobs.cum)[:req.n]
        kept = []
        for rank, j in enumerate(ranked):
            body = bodies[j]
            body["choices"][0]["index"] = choices[j].prompt * req.n + rank
            body["usage"] = usage(len(choices[j].gen.prompt_ids) if rank == 0 else 0,
                                  body["usage"]["completion_tokens"])
            kept.append(body)
        return kept

    async def _beam_bodies(self, choices: list[Choice], req, env: Envelope) -> list[dict]:
        """A beam search's bodies, one per returned beam (best first), once the search has ended. A beam's
        log-probs are its chosen tokens' (BeamResult.log_probs: log_softmax after temperature, "raw" at 1)."""
        gen = choices[0].gen
        async for _ in gen.events():  # the beams end together; the last event brings the best one's tokens
            pass
        if gen.cancelled:
            return []
        self.metrics.request_done(gen, "stop" if gen.stats.finish_reason == "end_id" else "length")
        bodies = []
        for c in choices:
            if c.beams is None or c.beam is None or c.beam >= len(c.beams):
                continue
            beam = c.beams[c.beam]
            text = self.codec.decode(beam.tokens, req.skip_special_tokens)
            reason: str | None = "stop" if beam.reason == "end_id" else "length"
            logprobs = None
            if logprob_counts(req)[0] is not None:
                logprobs = whole_logprobs(self.codec, beam.tokens, beam.log_probs, env.chat, len(c.echo),
                                          req.skip_special_tokens)
            answer = ChatAnswer.wanted(req, self.tool_parser, self.reasoning_parser) if env.chat else None
            message = answer.message(text) if answer is not None else None
            if answer is not None:
                reason = answer.finish_reason(reason)
            bodies.append(env.final(c.echo + text, reason, None, len(gen.prompt_ids) if c.first else 0,
                                    len(beam.tokens), message, index=c.index, logprobs=logprobs))
        return bodies

    async def _complete(self, choice: Choice, req, env: Envelope) -> dict:
        """One choice's whole body."""
        text, reason, stop_reason = [choice.echo], None, None
        answer = ChatAnswer.wanted(req, self.tool_parser, self.reasoning_parser) if env.chat else None
        logprobs = empty(env.chat) if self._shaper(choice, req) is not None else None
        async for piece, reason, stop_reason, lp in self._pieces(choice, req):  # noqa: B007 - the last ones are kept
            text.append(piece)
            if logprobs is not None:
                extend(logprobs, lp)
        if logprobs is not None:  # the prompt's come first; the engine has them once the first token is out
            logprobs = extend(extend(empty(env.chat), self._echoed(choice, req)), logprobs)
        gen = choice.gen
        message = answer.message("".join(text)) if answer is not None else None
        if answer is not None:
            reason = answer.finish_reason(reason)
        return env.final("".join(text), reason, stop_reason, len(gen.prompt_ids) if choice.first else 0,
                         len(gen.output), message, index=choice.index, logprobs=logprobs)

    async def _events(self, choice: Choice, req, env: Envelope):
        """One choice's chunks."""
        if env.chat:  # OpenAI's first chat chunk names the role
            yield env.chunk("", role=True, index=choice.index)
        echo = bool(choice.echo)
        answer = ChatAnswer.wanted(req, self.tool_parser, self.reasoning_parser) if env.chat else None
        async for piece, reason, stop_reason, lp in self._pieces(choice, req):
            if reason is None and choice.gen.cancelled:
                return  # the client is gone
            if echo:  # with the first tokens: the engine records the prompt's log-probs before it sends them
                echo = False
                yield env.chunk(choice.echo, index=choice.index, logprobs=self._echoed(choice, req))
            if answer is not None:  # reasoning and tool calls parsed out of the pieces
                delta = answer.delta(piece, reason is not None)
                if delta or lp or reason is not None:
                    yield env.chunk(None, answer.finish_reason(reason), stop_reason, delta=delta or {},
                                    index=choice.index, logprobs=lp)
            elif piece or lp or reason is not None:
                yield env.chunk(piece, reason, stop_reason, index=choice.index, logprobs=lp)

    async def _stream(self, choices: list[Choice], req, env: Envelope, watcher: asyncio.Task):
        try:
            try:
                events = (self._events(choices[0], req, env) if len(choices) == 1 else
                          merge_streams([self._events(c, req, env) for c in choices]))
                async for chunk in events:
                    yield _sse(chunk)
            except RuntimeError as err:
                body = error_body(f"generation failed: {err}", "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)
                yield _sse(body)
            else:
                if req.include_usage():
                    yield _sse(env.usage_chunk(sum(len(c.gen.prompt_ids) for c in choices if c.first),
                                               sum(len(c.gen.output) for c in choices)))
            yield "data: [DONE]\n\n"
        finally:  # also when the response task is cancelled because the client left
            watcher.cancel()
            self._release(choices)

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
            choices = self._start(req)
            try:
                async for _ in self._pieces(choices[0], req):
                    pass
            finally:
                self._release(choices)
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
               reasoning_parser: str | None = None, guided_decoding_backend: str | None = None,
               lora_adapters: dict[str, Path] | None = None) -> FastAPI:
    """A FastAPI app serving `engine` under `served_model_name`. `tokenizer` is the Hugging Face
    tokenizer directory (or a loaded TextCodec); `chat_template` (Jinja text) replaces the
    tokenizer's own; `trust_remote_code` lets a tokenizer directory's own code run; `tool_parser` and
    `reasoning_parser` are trtllm-serve's --tool_parser / --reasoning_parser (parsers_problem refuses a
    name or family they cannot serve); `guided_decoding_backend` is LLM()'s ("xgrammar"; None: guided decoding off,
    a response_format other than text is refused as trtllm-serve refuses it). `lora_adapters` (name -> PEFT directory,
    task ids 1..N in this order) are served under their names and listed in /v1/models; a request's `lora_request`
    names any adapter by path as trtllm-serve's does. The batcher starts with the app's lifespan and stops with it."""
    problem = parsers_problem(tool_parser, reasoning_parser, engine.dims.architecture)
    if problem:
        raise ToolchainError(problem)
    codec = tokenizer if isinstance(tokenizer, TextCodec) else TextCodec(tokenizer, chat_template, trust_remote_code)
    if chat_template is not None:
        codec.chat_template = chat_template
    if guided_decoding_backend not in (None, "xgrammar"):
        raise ToolchainError(f"guided_decoding_backend {guided_decoding_backend!r} is not served by the CPU engine, "
                             "which guides with XGrammar only", "set guided_decoding_backend: xgrammar")
    for name, path in (lora_adapters or {}).items():
        if not Path(path).is_dir():
            raise ToolchainError(f"LoRA adapter {name!r}: {path} is not a directory",
                                 "point --lora-adapter NAME=DIR at the directory PEFT's save_pretrained wrote")
    if lora_adapters and getattr(engine, "lora", None) is None:
        raise ToolchainError("LoRA adapters were given but the engine was built without LoRA",
                             "build it with the spec's lora section (LLM-API path: lora_config in --config)")
    front = OpenAIFrontend(engine, codec, served_model_name, scheduler, engine_type, tool_parser, reasoning_parser,
                           guided_decoding_backend, lora_adapters)

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
        return JSONResponse(model_list(front.model, front.created, tuple(front.adapters)))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": toolchain.__version__})

    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/health_generate", front.health_generate, methods=["GET"])
    app.add_api_route("/metrics", front.iteration_stats, methods=["GET"])
    app.add_api_route("/prometheus/metrics", front.prometheus, methods=["GET"])
    return app
