"""Request bodies and error bodies of the OpenAI-compatible server, with
trtllm-serve's field names (TensorRT-LLM 1.2 `tensorrt_llm/serve/openai_protocol.py`).

As upstream, unknown fields are refused (extra="forbid"), so a client that asks
for something this server would silently ignore gets a 400 instead. Fields the
CPU engine cannot honour are accepted only at their neutral value;
`unsupported()` names the first one that is not.
"""

from __future__ import annotations

import random
import time
from http import HTTPStatus
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from toolchain.llmapi.lora import LoRARequest

TokenIds = list[StrictInt]  # "5" or true must not pass as a token id


class ApiError(Exception):
    """An error answered as trtllm-serve's ErrorResponse body."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.status)


def error_body(message: str, err_type: str = "BadRequestError", status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> dict:
    # ErrorResponse: object, message, type, param, code (the HTTP status as an int).
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": int(status)}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: Optional[bool] = True  # upstream's default once stream_options is sent
    continuous_usage_stats: Optional[bool] = False


class ResponseFormat(_Body):
    """trtllm-serve's `response_format` (tensorrt_llm/serve/openai_protocol.py, ResponseFormat): the
    OpenAI types plus trtllm-serve's own (json with a bare `schema`, regex, ebnf, structural_tag);
    `structured.guide_for` maps it to the engine's guided-decoding Guide."""

    type: Literal["text", "json", "json_schema", "json_object", "regex", "ebnf", "structural_tag"]
    schema_: Optional[dict] = Field(default=None, alias="schema")
    json_schema: Optional[dict] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    format: Optional[dict] = None  # structural_tag in XGrammar's form
    structures: Optional[list[dict]] = None  # structural_tag in the LLM API's form: [{"begin", "schema", "end"}]
    triggers: Optional[list[str]] = None


# The most log-probabilities one position may ask for (OpenAI caps chat top_logprobs at 20; trtllm-serve's
# check_logprobs_limit value is UNVERIFIED here, so the larger of OpenAI's caps is taken).
MAX_LOGPROBS = 20


class _Sampling(_Body):
    """Fields shared by both endpoints, in upstream's names and defaults."""

    model: str
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    best_of: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = Field(default_factory=list)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # trtllm-serve's sampling extensions that the CPU engine implements (or accepts at their neutral value)
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search only (upstream's defaults: 1.0 and False)
    early_stopping: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: Optional[list[StrictInt]] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    # trtllm-serve's adapter selection (openai_protocol.py: `lora_request: Optional[LoRARequest] = None` on both
    # requests): the dataclass itself, so a lora_path that does not exist is a 400 with its own words.
    lora_request: Optional[LoRARequest] = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]

    def unsupported(self) -> str | None:
        """The first requested feature the CPU engine does not have, as a one-line reason."""
        best_of = self.best_of or self.n
        if self.n < 1:
            return f"n must be at least 1, got {self.n}"
        if best_of < self.n:  # the LLM API's words (SamplingParams._validate)
            return f"best_of ({best_of}) cannot be less than n ({self.n})"
        if best_of > 1 and not self.use_beam_search and (self.temperature == 0 or self.top_k == 1):
            # As the LLM API refuses several returns of greedy decoding (SamplingParams._validate).
            return (f"Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, got "
                    f"best_of={best_of}.")
        if self.stream and self.beam_width() > 1:
            # UNVERIFIED whether trtllm-serve streams beams; the CPU engine's beams end together (beam_search.py).
            return "stream=true with use_beam_search is not supported by the CPU engine's OpenAI server; send stream=false"
        if self.stream and best_of > self.n and not self.use_beam_search:
            # The n best of best_of are known only once all have ended (UNVERIFIED how trtllm-serve streams them).
            return f"stream=true with best_of ({best_of}) above n ({self.n}) is not supported; send stream=false"
        if self.beam_width() > 1 and self.stop_strings():
            return "stop strings with use_beam_search are not supported by the CPU engine; send stop_token_ids"
        if self.stream_options is not None and not self.stream:
            return "stream_options can only be sent with stream=true"  # upstream refuses it as well
        return None

    def beam_width(self) -> int:
        """The beam search's width (1: no beam search). The LLM API's rule (SamplingParams docstring): with
        use_beam_search, best_of is the beam width when given, else n; n sequences are returned."""
        return (self.best_of or self.n) if self.use_beam_search else 1

    def sampled_best_of(self) -> int:
        """How many sequences a sampled request generates per prompt: best_of when above n (the n with the
        highest cumulative log-prob are returned), else n."""
        return self.n if self.use_beam_search else max(self.best_of or self.n, self.n)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix is not supported"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be within [0, {MAX_LOGPROBS}], got {self.logprobs}"
        return super().unsupported()

class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) go to the chat template as they came.
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[TextPart], None] = None

    def for_template(self) -> dict:
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            kinds = {p.type for p in self.content} - {"text"}
            if kinds:
                raise ApiError(f"content part type {sorted(kinds)[0]!r} is not supported: this server takes text only")
            data["content"] = "".join(p.text or "" for p in self.content)
        return data


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    max_completion_tokens: Optional[int] = Field(default=None, validation_alias="max_tokens")
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template adds what the model needs
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = "none"  # its rules: openai/tools.py request_problem

    @property
    def max_tokens(self) -> int | None:
        return self.max_completion_tokens

    def unsupported(self) -> str | None:
        if self.top_logprobs and not self.logprobs:
            return "logprobs must be true when using top_logprobs"  # trtllm-serve's words
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            return f"top_logprobs must be within [0, {MAX_LOGPROBS}], got {self.top_logprobs}"
        if not self.messages:
            return "messages is empty: send at least one message"
        return super().unsupported()


# -- responses -------------------------------------------------------------------------


_IDS = random.Random()  # its own generator, seeded once from the OS: no one else's seed() repeats our ids


def new_id(prefix: str) -> str:
    """`prefix-` and 32 hex digits, the shape of upstream's `random_uuid()` (uuid4().hex). Drawn from
    `random`, not os.urandom: that system call lets go of the GIL in the middle of a request, and the
    engine thread (just handed that request) takes it for up to a switch interval (measured 1.4 ms a
    request on this host). An id must be unique, not secret."""
    return f"{prefix}-{_IDS.getrandbits(128):032x}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def merged(bodies: list[dict]) -> dict:
    """One response of several prompts' bodies: their choices in order, their usage summed."""
    choices = [c for b in bodies for c in b["choices"]]
    total = [sum(b["usage"][k] for b in bodies) for k in ("prompt_tokens", "completion_tokens")]
    return {**bodies[0], "choices": choices, "usage": usage(*total)}


def model_list(name: str, created: int, adapters: tuple[str, ...] = ()) -> dict:
    """trtllm-serve's list (its one ModelCard), then each LoRA adapter with the base as `parent`, as vLLM's and
    Dynamo's frontends list loaded adapters (an extension: trtllm-serve 1.2 lists the base only)."""
    base = {"id": name, "object": "model", "created": created, "owned_by": "tensorrt_llm"}
    return {"object": "list", "data": [base, *({**base, "id": a, "parent": name} for a in adapters)]}


class Envelope:
    """The fixed part of one response's bodies: id, object, created, model."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, text: str, finish_reason: str | None, stop_reason, prompt_tokens: int, completion_tokens: int,
              message: dict | None = None, *, index: int = 0, logprobs: dict | None = None) -> dict:
        """`message`: the chat message when it is more than the text (chat_output.ChatAnswer.message)."""
        if self.chat:
            message = message or {"role": "assistant", "content": text}
            choice = {"index": index, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            body = self._base("text_completion")
        return {**body, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, stop_reason=None, role: bool = False,
              delta: dict | None = None, *, index: int = 0, logprobs: dict | None = None) -> dict:
        """`delta`: the chat delta when it is more than the text (chat_output.ChatAnswer.delta)."""
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": text or ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._base("text_completion")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**body, "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


UNION_FIELDS = {"prompt": "a string or a list of token ids", "stop": "a string or a list of strings",
                "content": "a string or a list of text parts"}


def validation_message(errors: list[dict]) -> str:
    """FastAPI's validation errors as one line: `field: problem; field: problem`. A field of
    several accepted shapes (a union) fails once per shape; it is named once, with the shapes."""
    out, seen = [], set()
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            line = f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        elif err.get("type") == "missing" and not loc:
            line = "the request needs a JSON body"
        elif any(p in UNION_FIELDS and i + 1 < len(loc) and isinstance(loc[i + 1], str) for i, p in enumerate(loc)):
            # A union branch tag (`str`, `list[int]`) follows the field: say which shapes it takes.
            i = next(i for i, p in enumerate(loc) if p in UNION_FIELDS and i + 1 < len(loc) and isinstance(loc[i + 1], str))
            where = ".".join(str(p) for p in loc[:i + 1])
            line = f"{where} must be {UNION_FIELDS[loc[i]]}"
        else:
            line = f"{_loc(err.get('loc', ()))}: {err.get('msg')}"
        if line not in seen:
            seen.add(line)
            out.append(line)
    more = f" (and {len(out) - 3} more)" if len(out) > 3 else ""
    return "; ".join(out[:3]) + more
