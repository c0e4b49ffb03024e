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
    """Prompt length in tokens (deployment tokenizer, no special tokens; server count when it reports one)."""
    max_tokens: int = 0
    """Requested output length."""
    level: int = 0
    """Index of the load level (sweep position) this request belongs to."""
    cls: str = "default"
    """Traffic class name."""
    adapter: str | None = None
    """The LoRA adapter (a lora.adapters name) the request asked for; None: the base model."""
    session: int | None = None
    """Multi-turn session number (None for single requests)."""
    turn: int = 0
    t_sched: int | None = None
    """When the load schedule meant the request to go out (open loop: the precomputed
    arrival; closed loop: the moment a slot became free)."""
    t_send: int | None = None
    """Just before the request was handed to the transport."""
    t_final: int | None = None
    """End of the request: final-flag response (flag-only included), SSE [DONE] or stream close."""
    status: str | None = None
    """The answer's status line where the protocol has one before the body (HTTP: "HTTP 200")."""
    t_status: int | None = None
    """When the status line and headers had arrived."""
    responses: list[Response] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False
    """Cancelled on purpose mid-stream (workload cancel_fraction); counted, never timed."""
    timed_out: bool = False
    token_source: str = "tokenizer"
    """Where per-response token counts came from: "server" (output ids / num_output_tokens),
    "server-total" (a server usage total; per-chunk split by the tokenizer) or "tokenizer"."""
    server_osl: int | None = None
    """Output tokens as the server reported them in total (OpenAI usage, final num_output_tokens)."""
    client_osl: int | None = None
    """The tokenizer's estimate of the same output, kept next to the server figure."""
    draft_tokens: int | None = None
    """Speculative decoding: draft tokens proposed over the request (total_draft_tokens), if reported."""
    accepted_draft_tokens: int | None = None
    """Of them, accepted by the target (total_accepted_draft_tokens)."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.t_send is not None and self.t_final is not None

    def token_responses(self) -> list[Response]:
        return [r for r in self.responses if r.n_tok > 0]

    @property
    def osl(self) -> int:
        if self.server_osl is not None:
            return self.server_osl
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

    @property
    def send_lag_ns(self) -> int | None:
        if self.t_sched is None or self.t_send is None:
            return None
        return self.t_send - self.t_sched
