"""Wire protocols: each turns one prompt into a request and stamps every response.

A transport is an object with

- `prepare()` (sync, before any load): reach the server, check the model and
  its contract, fail with one line (`ToolchainError`) when something is wrong;
- `await open()` / `await close()` around a run (connections, sessions);
- `await run(rec, prompt, turn, priority) -> Reply`: send, then append a
  `Response(t_ns, n_tok, text)` to `rec.responses` for every response the
  moment it arrives (the stamp is the first thing taken), set `rec.t_final`,
  and stop early when `turn.cancel_after` tokens have arrived (`rec.cancelled`).
  Errors are stored in `rec.error`, never raised; a timeout is the caller's
  `asyncio.wait_for` cancelling the coroutine, which must then cancel the call.

Attributes: `token_ids` (prompts are token ids), `chat` (prompts are
messages), `contract` (a short description for the report), `inputs_sent`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from toolchain.bench.records import RequestRecord, Response


@dataclass
class Reply:
    text: str = ""
    ids: list[int] = field(default_factory=list)


class Stream:
    """Per-request bookkeeping shared by the transports: stamps, counts, cancellation."""

    __slots__ = ("rec", "cancel_after", "tokens", "keep_text", "parts", "ids", "cumulative", "whole")

    def __init__(self, rec: RequestRecord, cancel_after: int | None, keep_text: bool):
        self.rec, self.cancel_after, self.keep_text = rec, cancel_after, keep_text
        self.tokens = 0
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.cumulative = 0  # last cumulative server count seen (num_output_tokens)
        self.whole = ""  # the last cumulative text seen (the LLM API's output.text)

    def new_text(self, whole: str) -> str:
        """The part of a cumulative text not seen before."""
        new = whole[len(self.whole):] if whole.startswith(self.whole) else whole
        self.whole = whole
        return new

    def text(self, t_ns: int, text: str) -> bool:
        """A text chunk whose tokens the tokenizer counts later. Returns True to cancel now."""
        self.rec.responses.append(Response(t_ns, 0, text))
        if text:
            self.parts.append(text)
            self.tokens += 1  # a chunk is at least one token: the cancel trigger needs no tokenizer
        return self._cancel_due()

    def counted(self, t_ns: int, n_tok: int, text: str | None = None, ids=None) -> bool:
        """A response whose token count the server gave. Returns True to cancel now."""
        self.rec.responses.append(Response(t_ns, n_tok, text or None))
        self.tokens += n_tok
        if text and self.keep_text:
            self.parts.append(text)
        if ids is not None and self.keep_text:
            self.ids.extend(ids)
        return self._cancel_due()

    def _cancel_due(self) -> bool:
        if self.cancel_after is not None and self.tokens >= self.cancel_after:
            self.rec.cancelled = True
            self.rec.t_final = time.perf_counter_ns()
            return True
        return False

    def reply(self) -> Reply:
        return Reply("".join(self.parts), self.ids)


def short(err: BaseException) -> str:
    """One line, at most 200 characters, from any client exception."""
    for attr in ("message", "details"):
        fn = getattr(err, attr, None)
        if callable(fn):
            try:
                text = fn()
                if text:
                    return " ".join(str(text).split())[:200]
            except Exception:
                pass
    return " ".join((str(err) or type(err).__name__).split())[:200]
