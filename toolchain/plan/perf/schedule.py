"""A replica over time: its pipeline stages and draft (`Deployment`), the workload, and in-flight batching in
steady state (TTFT, TPOT and throughput at a concurrency; the best batch; the queue above the batch limit).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from toolchain.gpus import Gpu
from toolchain.plan.perf.attention import Span
from toolchain.plan.perf.efficiency import Efficiency
from toolchain.plan.perf.host import step_time
from toolchain.plan.perf.step import (ACT_BYTES, StageCost, StepTime, Work, add, context_work, generation_work,
                                      transfer_seconds)

# ------------------------------------------------------------------------------------------- a deployment


@dataclass(frozen=True)
class Deployment:
    """Everything the schedule reads about one replica (tp x pp GPUs) of the deployment."""

    gpu: Gpu
    stages: tuple[StageCost, ...]
    tp: int
    math_precision: str
    eff: Efficiency
    draft: StageCost | None = None
    """A draft_target draft model (tp 1, all layers, on rank 0's GPU), run draft_len times per step."""
    draft_len: int = 0
    tokens_per_step: float = 1.0
    """Tokens a generating sequence gains per step: 1 + acceptance x draft_len."""
    shards: int = 1
    """Rank shards one process runs one after another: tp for the CPU engine in one process, else 1."""

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def iteration(self, work: Work, sequences: float, generating: float = 0.0, context: float = 0.0,
                  whole: Work | None = None) -> tuple[float, StepTime]:
        """Seconds of one engine iteration running `work` for `sequences` sequences (`generating` of them past
        their prompt, with `context` cached tokens each: the draft model drafts for those), and the slowest
        stage's step. With pp > 1 the batch splits into min(pp, sequences) micro-batches that follow each other
        through the stages: each token crosses every stage (pp stage times and pp - 1 transfers), and with fewer
        micro-batches than stages the rest of the pipeline idles (the bubble). `whole` is work of one sequence
        that stays in one micro-batch (a prompt chunk whose TTFT is asked), on top of its share of `work`."""
        micro = max(1, min(self.pp, math.floor(sequences))) if self.pp > 1 else 1
        part = work.scaled(1 / micro)
        if whole is not None:
            part = add(part, whole)
        steps = [step_time(c, self.gpu, part, math_precision=self.math_precision, tp=self.tp, eff=self.eff,
                           shards=self.shards) for c in self.stages]
        slowest = max(steps, key=lambda s: s.seconds)
        assert self.gpu.link is not None
        seconds = self.pp * slowest.seconds
        if self.pp > 1 and self.gpu.link.gb_s > 0:  # 0: the stages share one process (the CPU engine)
            seconds += (self.pp - 1) * transfer_seconds(part.tokens * self.stages[0].hidden * ACT_BYTES,
                                                        self.gpu.link, self.eff.link)
        if self.draft is not None and self.draft_len and generating > 0:
            draft = step_time(self.draft, self.gpu, generation_work(generating, context), eff=self.eff)
            seconds += self.draft_len * draft.seconds
        return seconds, slowest


@dataclass(frozen=True)
class Workload:
    isl: int
    osl: int
    max_num_tokens: int
    chunked: bool = True
    """Chunked context: a prompt runs in chunks of max_num_tokens; else whole in one step."""
    batch_wait_iters: int = 0
    """TensorRT-LLM's batch_wait_timeout_iters: iterations new prompts are held back to gather more (0: off, the
    default; see `batch_wait`)."""
    batch_wait_ratio: float = 0.0
    """TensorRT-LLM's batch_wait_max_tokens_ratio: held prompts go once the iteration's tokens reach this share of
    max_num_tokens (0: off, the default)."""
    requests: int = 0
    """Requests a benchmark run sends in all, when it sends a fixed number from a standing start: the first C
    arrive together (`first_wave_ttft`) and weigh C / requests in the mean TTFT (`predict` with `bench_run`
    passes a level's validation.workload.num_requests, as `toolchain bench` runs it). 0: the steady state alone
    (`toolchain plan`, tune)."""

    @property
    def chunk(self) -> int:
        return min(self.isl, self.max_num_tokens) if self.chunked else self.isl

    @property
    def context_steps(self) -> int:
        return math.ceil(self.isl / self.chunk)

    def prompt_spans(self, prompts: float) -> tuple[Span, ...]:
        """The chunks of `prompts` prompts, each after the ones before it (what windows and MLA's context form
        read per chunk)."""
        return tuple(Span(prompts, j * self.chunk, min(self.chunk, self.isl - j * self.chunk), causal=True)
                     for j in range(self.context_steps))

    @property
    def prior_tokens(self) -> int:
        """Cached prompt tokens the chunks of one prompt read before their own: sum of each chunk's start."""
        return sum(min(j * self.chunk, self.isl) for j in range(self.context_steps))


@dataclass(frozen=True)
class Point:
    """The steady state at one concurrency."""

    concurrency: int
    output_tokens_per_s: float
    ttft_s: float
    tpot_s: float
    context_bound: str
    generation_bound: str


def generation_alone(dep: Deployment, generating: float, context: float, verify: int = 1) -> float:
    """Seconds of a generation-only iteration of `generating` sequences (0 for none)."""
    if generating <= 0:
        return 0.0
    return dep.iteration(generation_work(generating, context, verify), generating, generating, context)[0]


def arrival_wait(mean_iteration: float, rate: float, prompt_work: float) -> float:
    """What a request of a closed loop in steady state waits before its prompt's first chunk runs.

    Its requests are staggered: each arrives when another ends, at an iteration's end, while the next iteration
    has just started without it; it waits for that one (half an iteration on average: the client's round trip
    eats into it, and at concurrency 1 no iteration runs). Then it queues behind prompts that arrived before
    it and still wait for room: prompts reach the engine at `rate` (C per cycle) and each holds the prompt room
    for `prompt_work` seconds (its chunks' time beyond the generation iterations they displace), a single
    server with utilization rho = rate x work, whose mean wait with random arrivals and fixed service is
    rho x work / (2 (1 - rho)) (the M/D/1 queue: the Pollaczek-Khinchine mean wait rate E[S^2] / (2 (1 - rho))
    with E[S^2] = work^2). rho is kept below 0.95: past that the cycle itself is prompt-bound and steady_state
    stretches it instead."""
    work = max(prompt_work, 0.0)
    rho = min(rate * work, 0.95)
    return 0.5 * mean_iteration + rho * work / (2 * (1 - rho))


def batch_wait(w: Workload, arrivals: float, generating: float) -> tuple[float, float]:
    """(Mean iterations a prompt is held back, prompts released together) under TensorRT-LLM's batch waiting
    (PyExecutor._waiting_requests in tensorrt_llm/_torch/pyexecutor/py_executor.py, which _schedule calls when
    both context and generation requests are scheduled): while generation requests run, waiting prompts are not
    scheduled until batch_wait_timeout_iters iterations have passed since the last release, or the iteration's
    tokens (their prompt tokens and one per generating sequence) reach batch_wait_max_tokens_ratio x
    max_num_tokens; with either setting 0 the test passes at once and nothing waits. A prompt that finds none
    waiting opens a window of W = min(timeout, (k - 1) / a) iterations, k the prompts the threshold needs and a
    the prompts arriving per iteration; the a W that join it later wait W / 2 on average, and all 1 + a W run
    their first chunks in one iteration."""
    if w.batch_wait_iters <= 0 or w.batch_wait_ratio <= 0 or arrivals <= 0:
        return 0.0, 1.0
    need = max(w.batch_wait_ratio * w.max_num_tokens - generating, 0.0)
    k = max(1, math.ceil(need / w.isl))
    window = min(float(w.batch_wait_iters), (k - 1) / arrivals)
    joined = arrivals * window
    return (window + joined * window / 2) / (1 + joined), 1 + joined


def first_wave_ttft(dep: Deployment, w: Workload, concurrency: int) -> float:
    """Mean TTFT of the first `concurrency` requests of a benchmark run, sent together into an idle engine
    (a closed-loop client starts by filling every slot at once: vLLM's benchmark_serving.py with
    --request-rate inf and --max-concurrency C): their prompts fill iterations of max_num_tokens prompt tokens
    one after another (whole prompts when they fit one iteration, as the scheduler packs them), so the k-th
    iteration's prompts see their first token after k such iterations; a prompt longer than max_num_tokens
    runs its own chunks, the prompts one after another."""
    c = max(concurrency, 1)
    if w.chunked and w.isl > w.max_num_tokens:
        one = sum(dep.iteration(context_work(min(w.chunk, w.isl - j * w.chunk), j * w.chunk), 1)[0]
                  for j in range(w.context_steps))
        return one * (c + 1) / 2
    per = max(1, w.max_num_tokens // w.isl)

    def prompts(n: int) -> float:
        return dep.iteration(context_work(w.isl).scaled(n), n)[0]

    full, rest = divmod(c, per)
    total = sum(per * (k + 1) for k in range(full)) * prompts(per)
    if rest:
        total += rest * (full * prompts(per) + prompts(rest))
    return total / c


def steady_state(dep: Deployment, w: Workload, concurrency: int) -> Point:
    """In-flight batching with `concurrency` requests always in the system (a closed loop, or trtllm-bench's
    queue that refills a slot as soon as a request ends), over one cycle of I iterations in which each of the C
    slots serves one request.

    A request spends cs = `context_steps` iterations on its prompt (its first token comes from the last) and
    gen_steps = (osl - 1) / tokens_per_step generating. The C prompts of a cycle ride in P iterations, as many as
    max_num_tokens (less the generation tokens beside them) needs and at least cs; when P exceeds a request's life
    the prompts queue and the cycle stretches to P iterations. The cycle is P mixed iterations (prompt tokens of
    r = C cs / P requests beside the others' generation tokens) and I - P generation-only ones; a request not on
    its prompt generates in gen_steps of its I - cs other iterations. Throughput = C x osl / cycle. TPOT is the
    mean iteration a request sees while it generates (the P - cs that carry other prompts, and the rest). TTFT is
    its own chunks beside the others' generation tokens after its wait for the iteration in flight and the prompts
    ahead of it (`arrival_wait`: the requests are staggered, each arriving as another ends), and with
    `w.requests` the run's first wave (`first_wave_ttft`) weighed in."""
    c, cs = concurrency, w.context_steps
    verify = 1 + dep.draft_len
    gen_steps = max(w.osl - 1, 0) / dep.tokens_per_step
    context = w.isl + w.osl / 2  # the mean cache of a generating sequence
    iters, prompts_iters = cs + gen_steps, cs
    for _ in range(4):  # the room for prompts depends on the cycle's length and the length on that room
        busy = gen_steps / (iters - cs) if iters > cs else 0.0  # the chance a request off its prompt generates
        g_mixed = (c - c * cs / prompts_iters) * busy
        room = max(w.max_num_tokens - g_mixed * verify, 1.0)
        if w.chunked:  # prompt tokens fill the room left; one prompt's chunks take cs iterations
            prompts_iters = max(math.ceil(c * w.isl / room), cs)
        else:  # whole prompts only: as many as fit the room share an iteration
            prompts_iters = math.ceil(c / max(1, int(room // w.isl)))
        iters = max(cs + gen_steps, prompts_iters)
    busy = gen_steps / (iters - cs) if iters > cs else 0.0
    in_prompt = c * cs / prompts_iters
    g_mixed, g_plain = (c - in_prompt) * busy, c * busy
    per = c / prompts_iters  # prompts' worth of tokens per mixed iteration
    prefill = Work(per * w.isl, per, per * w.prior_tokens, per * w.isl * (w.isl + 1) / 2, w.prompt_spans(per))
    mixed, _ = dep.iteration(add(generation_work(g_mixed, context, verify), prefill), g_mixed + in_prompt,
                             g_mixed, context)
    plain, gen_step = dep.iteration(generation_work(g_plain, context, verify), g_plain, g_plain, context)
    cycle = prompts_iters * mixed + (iters - prompts_iters) * plain
    throughput = c * w.osl / cycle if cycle > 0 else 0.0
    seen = iters - cs
    tpot = ((prompts_iters - cs) * mixed + (iters - prompts_iters) * plain) / seen / dep.tokens_per_step \
        if seen > 0 else 0.0

    others_gen = generation_work(g_mixed, context, verify)
    context_step: StepTime | None = None
    own = 0.0  # the request's own chunks, each beside the generation tokens of a mixed iteration
    for j in range(cs):
        start = j * w.chunk
        chunk = context_work(min(w.chunk, w.isl - start), start)
        t, slow = dep.iteration(others_gen, g_mixed + 1.0, g_mixed, context, whole=chunk)
        own += t
        context_step = context_step or slow
    assert context_step is not None
    ttft = own + dep.eff.ttft_ms * 1e-3
    if c > 1 and cycle > 0:
        ttft += arrival_wait(cycle / iters, c / cycle, own - cs * generation_alone(dep, g_mixed, context, verify))
    held, group = batch_wait(w, c / iters, g_plain) if c > 1 and g_plain > 0 else (0.0, 1.0)
    if held > 0:  # held back for generation-only iterations, then released with the prompts that joined it
        ttft += held * generation_alone(dep, g_plain, context, verify)
        chunk = context_work(w.chunk)
        ttft += (dep.iteration(add(others_gen, chunk.scaled(group - 1)), g_mixed + group, g_mixed, context,
                               whole=chunk)[0]
                 - dep.iteration(others_gen, g_mixed + 1.0, g_mixed, context, whole=chunk)[0])
    if w.requests > c:  # the run's first C requests arrive together: 1 in requests / C waves of a benchmark
        wave = first_wave_ttft(dep, w, c) + dep.eff.ttft_ms * 1e-3
        ttft += (wave - ttft) * c / w.requests
    if g_plain == 0:  # one output token: the bound of a generation step of the batch all the same
        gen_step = dep.iteration(generation_work(c, context, verify), c)[1]
    return Point(c, throughput, ttft, tpot, context_step.bound, gen_step.bound)


def batch_candidates(limit: int) -> list[int]:
    """The concurrencies tried for the maximum: every one up to 64, then 64 steps up to `limit` (the throughput
    curve is smooth there, and a plan stays quick whatever the KV cache holds)."""
    limit = max(limit, 1)
    return sorted({*range(1, min(limit, 64) + 1), *(max(1, round(limit * k / 64)) for k in range(1, 65))})


def best_point(dep: Deployment, w: Workload, limit: int) -> Point:
    """The concurrency up to `limit` with the highest output throughput (the smallest such on a tie)."""
    best: Point | None = None
    for c in batch_candidates(limit):
        point = steady_state(dep, w, c)
        if best is None or point.output_tokens_per_s > best.output_tokens_per_s * (1 + 1e-9):
            best = point
    assert best is not None
    return best


def queued(dep: Deployment, w: Workload, concurrency: int, limit: int) -> Point:
    """The steady state at `concurrency` when at most `limit` requests run at once: above it the batch runs full
    and the rest queue. A closed loop keeps C requests in the system, so by Little's law each spends C / (request
    rate) in it; what the running ones do not spend on their own service (TTFT + (osl - 1) TPOT at `limit`) is
    the wait for a slot, which its TTFT carries."""
    if concurrency <= limit:
        return steady_state(dep, w, concurrency)
    full = steady_state(dep, w, limit)
    rate = full.output_tokens_per_s / w.osl  # requests per second
    service = full.ttft_s + max(w.osl - 1, 0) * full.tpot_s
    wait = max(concurrency / rate - service, 0.0) if rate > 0 else 0.0
    return dataclasses.replace(full, concurrency=concurrency, ttft_s=full.ttft_s + wait)


