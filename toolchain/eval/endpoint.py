"""A running deployment's OpenAI-compatible `/v1/completions`, asked for the log-probabilities of prompts it is
sent as token ids: what `toolchain eval --endpoint` measures (this project's OpenAI server, trtllm-serve, Dynamo's
frontend).

Each prompt goes out as lm-evaluation-harness's `local-completions` sends a log-likelihood request
(lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload): `echo: true, logprobs: 1,
max_tokens: 1`. One generated token because servers refuse `max_tokens: 0`; it is read past and ignored. The
answer is the OpenAI completions `logprobs` object (trtllm-serve's tensorrt_llm/serve/openai_protocol.py,
CompletionLogProbs): `tokens`, `token_logprobs` and `top_logprobs`, the echoed prompt's first, its first entry
None (no context before the first token).

`top_logprobs` names tokens by their text, not their id. Servers render a token either as the tokenizer's own
piece (convert_ids_to_tokens), as its decoded text, or as "token_id:N" (vLLM's return_tokens_as_token_ids); the
echoed prompt, whose ids are known, shows which, and `Rendering` then names any id the way the server does, so
the server's top-1 token can be set against the reference's argmax id.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

from toolchain.errors import ToolchainError

NO_PROMPT_LOGPROBS = ("the endpoint returned no prompt log-probabilities: it must support echo with logprobs on "
                      "/v1/completions")
DEFAULT_TIMEOUT_S = 300.0


def base_url(url: str) -> str:
    """The server's root for an address given as host:port, http://host:port, .../v1 or .../v1/completions."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    for tail in ("/v1/completions", "/v1"):
        if url.endswith(tail):
            url = url[: -len(tail)]
    return url


def _message(body: bytes) -> str:
    """The error text of an answer: OpenAI's {"error": {"message"}} or trtllm-serve's ErrorResponse {"message"}."""
    text = body.decode(errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text.splitlines()[0][:300] if text else "(empty body)"
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return text[:300]


class Endpoint:
    """One OpenAI-compatible server: its model name (GET /v1/models) and echoed prompt log-probabilities."""

    def __init__(self, url: str, model: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.url = base_url(url)
        self.timeout = timeout
        self.model = model or self._served_model()

    def _call(self, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raise ToolchainError(f"{self.url}{path} answered HTTP {err.code}: {_message(err.read())}",
                                 _fix_for(err.code)) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as err:
            reason = getattr(err, "reason", err)
            raise ToolchainError(f"cannot reach {self.url}{path}: {reason}",
                                 "start the deployment (`toolchain serve SPEC`) or pass --endpoint with the address "
                                 "of its OpenAI-compatible server") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ToolchainError(f"{self.url}{path} answered with a body that is not JSON",
                                 "pass --endpoint the address of an OpenAI-compatible server") from None

    def _served_model(self) -> str:
        data = self._call("/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise ToolchainError(f"{self.url}/v1/models lists no model", "pass --model with the served model's name")
        return str(models[0]["id"])

    def echo(self, ids: list[int]) -> "Echoed":
        """The prompt `ids`' own log-probabilities and top-1 alternatives, position by position."""
        body = {"model": self.model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1}
        data = self._call("/v1/completions", body)
        try:
            logprobs = data["choices"][0]["logprobs"]
        except (KeyError, IndexError, TypeError):
            logprobs = None
        if not isinstance(logprobs, dict):
            raise ToolchainError(NO_PROMPT_LOGPROBS, "serve the model with a server that echoes prompt log-probs "
                                                     "(this project's OpenAI server, trtllm-serve)")
        return Echoed.parse(logprobs, len(ids))


def _fix_for(status: int) -> str:
    if status == 404:
        return "pass --endpoint the server's root (http://host:port) and --model a model it serves"
    if status in (401, 403):
        return "this endpoint needs credentials toolchain eval does not send; evaluate a deployment that is open to it"
    if 400 <= status < 500:
        return "the server refused the request toolchain eval sends (echo, logprobs 1, max_tokens 1, token-id prompt)"
    return "see the server's log"


@dataclass
class Echoed:
    """An echoed prompt of n tokens: `tokens[i]` as the server names it, `logprobs[i]` its log-probability given
    tokens[:i] (None at i = 0), `top[i]` the server's most likely token at i (its name and log-probability; None
    at 0)."""

    tokens: list[str]
    logprobs: list[float | None]
    top: list[tuple[str, float] | None]

    @classmethod
    def parse(cls, logprobs: dict, n: int) -> "Echoed":
        tokens, values, tops = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
        if not isinstance(values, list) or not isinstance(tokens, list) or len(values) < n or len(tokens) < n:
            raise ToolchainError(NO_PROMPT_LOGPROBS, "serve the model with a server that echoes prompt log-probs "
                                                     "(this project's OpenAI server, trtllm-serve)")
        if any(v is None for v in values[1:n]):
            raise ToolchainError(NO_PROMPT_LOGPROBS + " (some prompt positions have none)",
                                 "serve the model with a server that echoes prompt log-probs")
        if not isinstance(tops, list) or len(tops) < n or any(not t for t in tops[1:n]):
            raise ToolchainError("the endpoint returned no top log-probabilities for the prompt: it must answer "
                                 "`logprobs: 1` with each position's most likely token", "see the server's docs")
        top: list[tuple[str, float] | None] = [None]
        for alternatives in tops[1:n]:
            name, value = max(alternatives.items(), key=lambda kv: kv[1])
            top.append((str(name), float(value)))
        return cls([str(t) for t in tokens[:n]], [None] + [float(v) for v in values[1:n]], top)


class Rendering:
    """How the server names a token id, learnt from an echoed prompt whose ids are known."""

    def __init__(self, tokenizer) -> None:
        convert, decode = tokenizer.convert_ids_to_tokens, tokenizer.decode
        # Most specific first: the tokenizer's pieces are one-to-one with ids; decoded text is not (several byte
        # tokens decode to U+FFFD), so a server naming tokens that way can only be compared by text.
        self._ways: list[tuple[str, Callable[[int], str]]] = [
            ("token_id:N", lambda i: f"token_id:{i}"),
            ("the tokenizer's pieces", lambda i: str(convert(int(i)))),
            ("decoded text", lambda i: decode([int(i)])),
            ("decoded text without special tokens", lambda i: decode([int(i)], skip_special_tokens=True)),
        ]
        self.name: str | None = None
        self._name_of: Callable[[int], str] | None = None

    def learn(self, ids: list[int], echoed: Echoed) -> None:
        """Settle on the first way that names every echoed token as its id; refuse when none does. Position 0
        is left out: it has no log-probability, and servers differ in how they echo a leading BOS."""
        pairs = list(zip(ids[1:], echoed.tokens[1:], strict=True))
        if self._name_of is not None and all(self._name_of(i) == t for i, t in pairs):
            return
        for name, way in self._ways:
            if all(way(i) == t for i, t in pairs):
                self.name, self._name_of = name, way
                return
        mismatch = next((i, t) for i, t in pairs if self._ways[2][1](i) != t)
        raise ToolchainError(f"the endpoint echoed token id {mismatch[0]} as {mismatch[1]!r}, which this tokenizer "
                             "names otherwise: the server's tokenizer is not the spec's",
                             "set model.tokenizer to the tokenizer the deployment serves")

    def __call__(self, token_id: int) -> str:
        assert self._name_of is not None, "learn() from an echoed prompt first"
        return self._name_of(token_id)
