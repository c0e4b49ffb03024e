"""The spec's `validation` section: the load `toolchain bench` applies, the SLOs its report is judged against, and
the quality bounds `toolchain deploy` gates on (measured through the deployment's OpenAI endpoint).

`spec.py` holds it as `DeploymentSpec.validation` and re-exports every class here; the bench reads it through the
spec it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from toolchain.slo import parse_slo
from toolchain.spec_section import Section as _Section


class SharedPrefixSection(_Section):
    num_prefixes: int = Field(0, ge=0)
    """Distinct system prompts shared between requests (0: no shared prefix)."""
    prefix_tokens: int = Field(128, ge=1)
    """Length of each system prompt in tokens."""
    users_per_prefix: int = Field(4, ge=1)
    """Distinct user prompts (of input_tokens) per system prompt; requests cycle over prefix x user."""


class MultiTurnSection(_Section):
    turns: int = Field(1, ge=1)
    """Turns per session (1: single requests); each turn resends the history plus a new user message."""
    think_time_s: float = Field(0.0, ge=0)
    """Pause between a turn's last token and the next turn's send."""


class TrafficClass(_Section):
    name: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Class name, used in the report's per-class metrics."""
    share: float = Field(1.0, gt=0)
    """Relative share of sessions in this class (shares are normalised)."""
    priority: int = Field(0, ge=0)
    """Request priority sent to the server (Triton request priority, OpenAI `priority`); 0 sends none."""
    input_tokens: int | None = Field(None, ge=1)
    """Mean prompt length for this class; default: the workload's input_tokens."""
    output_tokens: int | None = Field(None, ge=1)
    """Requested output tokens for this class; default: the workload's output_tokens."""
    adapter: str | None = None
    """The LoRA adapter (a lora.adapters name) this class's requests use; none: the base model."""


class WorkloadSection(_Section):
    num_requests: int = Field(32, ge=1)
    """Measured requests per load level (ignored when duration_s is set)."""
    warmup_requests: int = Field(2, ge=0)
    """Requests sent first and excluded from the report."""
    concurrency: int = Field(4, ge=1)
    """Requests kept outstanding at once (mode concurrency, closed loop)."""
    input_tokens: int = Field(64, ge=1)
    """Mean prompt length in tokens."""
    input_tokens_stddev: float = Field(0.0, ge=0)
    """Standard deviation of the prompt length."""
    output_tokens: int = Field(32, ge=1)
    """Requested output tokens (max_tokens); the mean when output_tokens_stddev > 0."""
    output_tokens_stddev: float = Field(0.0, ge=0)
    """Standard deviation of the requested output length."""
    seed: int = 0
    """Seed for every random choice (prompts, lengths, arrivals, classes, cancellations)."""
    endpoint: str = Field("ensemble", min_length=1)
    """Model the bench sends to: a Triton model (ensemble, tensorrt_llm_bls, or tensorrt_llm for token ids) or the OpenAI `model` field."""
    ignore_eos: bool = True
    """Force exactly output_tokens tokens: end_id = -1 and min_tokens where the model declares them (OpenAI: ignore_eos, min_tokens)."""
    mode: Literal["concurrency", "rate"] = "concurrency"
    """`concurrency`: closed loop with N outstanding; `rate`: open loop at a request rate from a precomputed schedule."""
    sweep: list[float] = Field(default_factory=list)
    """Load levels to run in order (concurrencies or req/s by mode); empty: one level at concurrency or rate."""
    rate: float = Field(1.0, gt=0)
    """Request rate in requests/s (mode rate)."""
    arrival: Literal["poisson", "gamma", "constant"] = "poisson"
    """Inter-arrival distribution (mode rate); gamma uses burstiness as its shape."""
    burstiness: float = Field(1.0, gt=0)
    """Gamma shape for arrival gamma: < 1 burstier than Poisson, > 1 more regular (1 is Poisson)."""
    duration_s: float | None = Field(None, gt=0)
    """Run each level this long instead of num_requests requests."""
    protocol: Literal["triton-grpc", "triton-http", "openai-completions", "openai-chat"] = "triton-grpc"
    """Wire protocol: Triton gRPC streaming, Triton HTTP generate_stream (SSE), or OpenAI-compatible SSE."""
    url: str | None = None
    """Server address (host:port for gRPC, http://host:port otherwise); default: from the serving section."""
    streaming: bool = True
    """Stream tokens; false sends non-streaming requests (TTFT then equals E2E)."""
    prompts_file: Path | None = None
    """JSONL prompts (one object a line: prompt, messages, input_ids or turns; optional output_tokens, class); replaces synthetic prompts."""
    shared_prefix: SharedPrefixSection = Field(default_factory=SharedPrefixSection)
    """N system prompts x M users per prompt (prefix-cache workloads)."""
    multi_turn: MultiTurnSection = Field(default_factory=MultiTurnSection)
    """Sessions whose turns carry the conversation history."""
    classes: list[TrafficClass] = Field(default_factory=list)
    """Priority classes, each with its share of traffic; reported separately."""
    cancel_fraction: float = Field(0.0, ge=0, le=1)
    """Share of requests cancelled mid-stream (after a random number of tokens); counted, never timed."""
    request_timeout_s: float | None = Field(None, gt=0)
    """Seconds one request may take before it is cancelled and counted as failed; default: derived from the workload and the SLOs, 5 x (ttft limit + output_tokens x tpot limit) or 5 x the e2e limit, at least 30 s, and 300 s where no SLO bounds a whole request (report.json's workload.request_timeout_s shows the value used)."""
    max_consecutive_failures: int | None = Field(None, ge=1)
    """A level stops (outstanding requests cancelled, report incomplete, bench exits non-zero) once this many requests in a row time out or fail; default: the level's concurrency, at least 3 (3 in mode rate)."""

    @model_validator(mode="after")
    def _classes_distinct(self) -> "WorkloadSection":
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be distinct, got {names}")
        if any(v <= 0 for v in self.sweep):
            raise ValueError(f"sweep levels must be > 0, got {self.sweep}")
        if self.mode == "concurrency" and any(v != int(v) for v in self.sweep):
            raise ValueError(f"concurrency sweep levels must be whole numbers, got {self.sweep}")
        return self


class SloSection(_Section):
    ttft_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile time to first token must be at most this."""
    tpot_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile time per output token must be at most this."""
    e2e_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile end-to-end latency must be at most this."""
    itl_p99_ms: float | None = Field(None, gt=0)
    """99th-percentile gap between streamed token-bearing responses must be at most this."""
    extra: list[str] = Field(default_factory=list)
    """More thresholds as strings, e.g. "ttft_p90_ms<=200", "itl p99.9 <= 80 ms", "send_lag_mean_ms<=1"."""

    @model_validator(mode="after")
    def _extra_parse(self) -> "SloSection":
        for text in self.extra:
            parse_slo(text)  # raises ValueError naming the string
        return self


class QualitySection(_Section):
    max_perplexity_ratio: float | None = Field(None, gt=0)
    """Deploy fails when the endpoint's held-out perplexity over the HF reference's (float32, same tokens) exceeds this, e.g. 1.05."""
    min_greedy_agreement: float | None = Field(None, ge=0, le=1)
    """Deploy fails when the share of positions where the endpoint's most likely next token is the reference's is below this."""
    min_choice_accuracy: float | None = Field(None, ge=0, le=1)
    """Deploy fails when the endpoint's accuracy on the shipped multiple-choice set is below this."""
    max_choice_accuracy_drop: float | None = Field(None, ge=0, le=1)
    """Deploy fails when the endpoint's multiple-choice accuracy is more than this below the reference's."""
    tokens: int = Field(1024, ge=2)
    """Held-out tokens the gate's eval sends (`toolchain eval --max-tokens`)."""
    window: int = Field(256, ge=2)
    """Tokens per prompt (capped at limits.max_input_len)."""

    def bounds(self) -> dict[str, float]:
        """The bounds set, by field name; empty: no gate (the default)."""
        names = ("max_perplexity_ratio", "min_greedy_agreement", "min_choice_accuracy", "max_choice_accuracy_drop")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class ValidationSection(_Section):
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    """The load `toolchain bench` applies."""
    slo: SloSection = Field(default_factory=SloSection)
    """Service-level objectives the report is judged against."""
    quality: QualitySection = Field(default_factory=QualitySection)
    """Bounds on the quality measured through the OpenAI endpoint (`toolchain eval --endpoint`); deploy gates on any set."""
