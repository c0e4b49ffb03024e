"""Raw per-request records: everything is derived from these, offline.

All timestamps are `time.perf_counter_ns()` values (monotonic; they cannot step
under NTP). Keeping the raw responses lets a metric be redefined later without
re-running the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Response:
    """One streamed response: when it arrived and how many output tokens it carried."""

    t_ns: int
    n_tok: int = 0
    text: str | None = None
    """Raw chunk text, kept until tokens are counted (None when the count came from the server)."""


@dataclass
class RequestRecord:
    index: int
    request_id: str
    warmup: bool = False
    isl: int = 0
    """Prompt length in tokens (deployment tokenizer, no special tokens)."""
    max_tokens: int = 0
    """Requested output length."""
    t_sched: int | None = None
    """When the load schedule released the request (closed loop: a slot became free)."""
    t_send: int | None = None
    """Just before the request was written to the gRPC stream."""
    t_final: int | None = None
    """Arrival of the response carrying the final flag (flag-only responses included)."""
    responses: list[Response] = field(default_factory=list)
    error: str | None = None
    token_source: str = "tokenizer"
    """Where per-response token counts came from: "server" (output_ids) or "tokenizer" (re-tokenised text)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.t_send is not None and self.t_final is not None

    def token_responses(self) -> list[Response]:
        return [r for r in self.responses if r.n_tok > 0]

    @property
    def osl(self) -> int:
        return sum(r.n_tok for r in self.responses)

    @property
    def t_first_resp(self) -> int | None:
        return self.responses[0].t_ns if self.responses else None

    @property
    def t_first_tok(self) -> int | None:
        return next((r.t_ns for r in self.responses if r.n_tok > 0), None)

    @property
    def t_last_tok(self) -> int | None:
        return next((r.t_ns for r in reversed(self.responses) if r.n_tok > 0), None)
