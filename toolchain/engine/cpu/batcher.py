"""Inflight batching over the paged KV cache, scheduled as TensorRT-LLM's executor does.

One background thread loops; each iteration:

1. takes arrivals and cancellations (a cancelled request's blocks go back to the
   pool at once);
2. capacity: under `max_utilization`, makes sure every running request has the
   block its next token needs, pausing the last started request (lowest priority,
   latest arrival) while blocks run short: its blocks are released (full ones stay
   cached for reuse) and it goes back to the front of its priority in the queue,
   keeping its tokens, to be re-prefilled when it resumes. Under
   `guaranteed_no_evict` every running request holds a reservation for its
   longest possible length, so nothing is ever paused;
3. admits queued requests in order (priority, higher first; arrival among equals)
   while the batch has room (`max_batch_size`), the step has tokens left
   (`max_num_tokens`) and the pool has the blocks the policy asks for: the
   context's blocks (after prefix reuse) for `max_utilization`, plus the
   reservation to completion for `guaranteed_no_evict`. The first request that
   does not fit stops admission (no overtaking);
4. runs one `engine.step`: decoding requests one token each first, then context
   chunks. With `enable_chunked_context` a context longer than the tokens left
   is cut to a multiple of tokens_per_block and continues next step, so a long
   prompt never stalls running decodes for more than one step's budget.

New tokens go out through each request's callback right after the step. A
failing request is finished with an error and the loop goes on: a bad request is
rejected before admission; if a batched step fails, each request is retried
alone so only the one that fails gets the error.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from toolchain.engine.cpu.beam_search import BeamSequence, start_sequence, step_with_beams
from toolchain.engine.cpu.engine import CpuEngine, Sequence
from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.engine.cpu.sampling import SamplingParams

log = logging.getLogger(__name__)

Callback = Callable[[list[int], bool, "str | None"], None]
POLICIES = ("guaranteed_no_evict", "max_utilization")
DEFAULT_PRIORITY = 0.5  # executor::Request::kDefaultPriority


class QueueFull(RuntimeError):
    pass


@dataclass(frozen=True)
class SchedulerConfig:
    """The executor settings the tensorrt_llm model parameters control."""

    policy: str = "guaranteed_no_evict"  # batch_scheduler_policy
    enable_chunked_context: bool = False
    max_queue_size: int = 0  # requests waiting for admission; 0 = unbounded

    def problem(self) -> str | None:
        if self.policy not in POLICIES:
            return f"batch_scheduler_policy {self.policy!r} (use {' or '.join(POLICIES)})"
        if self.max_queue_size < 0:
            return f"max_queue_size {self.max_queue_size} must be >= 0"
        return None


@dataclass
class RequestStats:
    """Filled in by the batcher for the perf-metrics outputs of one request."""

    first_scheduled_ns: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    paused: int = 0  # times it was paused (max_utilization)
    total_draft_tokens: int = 0  # draft_input_ids brought for verification
    total_accepted_draft_tokens: int = 0
    finish_reason: str | None = None  # the sequence's: "length", "end_id", "stop_word", "cancelled", "error"

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


@dataclass
class _Request:
    request_id: object
    prompt: list[int]
    params: SamplingParams
    callback: Callback
    priority: float
    order: int
    stats: RequestStats
    draft: list[int] = field(default_factory=list)
    draft_logits: object = None
    draft_threshold: float | None = None
    logits: list | None = None  # return_generation_logits: the engine extends it with each step's rows
    logprobs: TokenLogprobs | None = None  # log-probs / context logits: the engine fills it (logprobs.py)
    sequence: Sequence | None = None  # the engine's, from _enqueue on: every queued or running request has one
    counted: bool = True  # still counted against max_queue_size (until first admitted or dropped)
    paused: bool = False  # back in the queue after a pause (max_utilization)
    speculation: tuple[int, int] = (0, 0)  # (drafted, accepted) already added to the batcher's totals
    submitted: float = field(default_factory=time.perf_counter)
    beam_results: list | None = None  # beam search: the returned beams (beams.BeamResult), filled when it ends

    @property
    def rank(self) -> tuple[float, int]:
        return (-self.priority, self.order)

    @property
    def seq(self) -> Sequence:
        """The sequence of a queued or running request."""
        if self.sequence is None:
            raise RuntimeError(f"request {self.request_id!r} has no sequence: it was never enqueued")
        return self.sequence


@dataclass
class BatcherStats:
    """Counters for tests and reports: how much batching actually happened, and the last
    iteration's composition (what TensorRT-LLM's executor reports as iteration stats)."""

    steps: int = 0
    tokens: int = 0
    max_running: int = 0
    joined_running: int = 0  # admissions that happened while other requests were mid-generation
    paused_total: int = 0  # pauses since start (max_utilization)
    chunked_steps: int = 0  # steps that ran a context chunk short of its prompt's end
    # speculative decoding since start: draft tokens verified, accepted, and the request-steps that verified some
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0
    # the last iteration
    active: int = 0                  # running + queued
    scheduled: int = 0               # in the batch
    context: int = 0                 # of them in the context phase
    context_tokens: int = 0          # their context tokens this step
    generation: int = 0              # of them decoding
    paused: int = 0                  # paused requests waiting to resume
    timestamp_us: int = 0            # when it ended (wall clock)

    def idle(self) -> None:
        self.active = self.scheduled = self.context = self.context_tokens = self.generation = self.paused = 0


class InflightBatcher:
    def __init__(self, engine: CpuEngine, config: SchedulerConfig | None = None):
        self.engine = engine
        self.config = config or SchedulerConfig()
        problem = self.config.problem()
        if problem:
            raise ValueError(problem)
        self.stats = BatcherStats()
        self._cv = threading.Condition()
        self._arrivals: list[_Request] = []
        self._cancel: set = set()
        self._waiting_count = 0  # submitted and not yet admitted (paused requests excluded), for max_queue_size
        self._order = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Owned by the batcher thread alone: queued requests and the running batch, both kept in rank order.
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._known: set = set()  # ids of admitted requests

    # -- client side -------------------------------------------------------------

    def start(self) -> "InflightBatcher":
        with self._cv:
            if self._thread is not None:
                raise RuntimeError("InflightBatcher already started")
            self._thread = threading.Thread(target=self._loop, name="cpu-engine-batcher", daemon=True)
            self._thread.start()
        return self

    def submit(self, request_id, prompt_ids: list[int], params: SamplingParams, callback: Callback, *,
               priority: float = DEFAULT_PRIORITY, stats: RequestStats | None = None,
               draft_tokens: list[int] | None = None, draft_logits=None,
               draft_acceptance_threshold: float | None = None, generation_logits: list | None = None,
               logprobs: TokenLogprobs | None = None, beam_results: list | None = None) -> None:
        """Queue a request; `callback(new_tokens, finished, error)` runs on the batcher thread.
        `draft_tokens` (draft_input_ids) are verified with the end of its context, by token
        equality or, with `draft_logits`, by TensorRT-LLM's probability rule. `generation_logits`
        (return_generation_logits), a list the caller owns, receives the logits rows [n, V] of
        each step's n new tokens before the callback hears of them; None keeps none. `logprobs`, a
        record the caller owns, is filled likewise with what the params' logprobs / prompt_logprobs /
        return_context_logits ask for. `beam_results`, a list the caller owns, receives a beam search's
        returned beams (beams.BeamResult, best first) before the final callback, which brings the best
        beam's tokens.

        Raises QueueFull when max_queue_size requests already wait (the executor's
        refusal), ValueError for a priority outside [0, 1]."""
        if not isinstance(priority, (int, float)) or not 0.0 <= priority <= 1.0:
            raise ValueError(f"priority must be in [0, 1], got {priority!r}")
        with self._cv:
            if self._stopping:
                raise RuntimeError("InflightBatcher is stopped")
            limit = self.config.max_queue_size
            if limit and self._waiting_count >= limit:
                # The executor's words (TensorRT-LLM cpp/tensorrt_llm/executor/executorImpl.cpp, enqueueRequests).
                raise QueueFull(f"Maximum queue size of {limit} has been reached, please try again later")
            self._waiting_count += 1
            self._arrivals.append(_Request(request_id, prompt_ids, params, callback, float(priority),
                                           next(self._order), stats or RequestStats(), list(draft_tokens or ()),
                                           draft_logits=draft_logits, draft_threshold=draft_acceptance_threshold,
                                           logits=generation_logits, logprobs=logprobs,
                                           beam_results=beam_results))
            self._cv.notify()

    def cancel(self, request_id) -> None:
        """Finish a request early; its callback gets finished=True with no error."""
        with self._cv:
            self._cancel.add(request_id)
            self._cv.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still queued or running finish with an error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
            orphans = list(self._arrivals) if thread is None else []
            if thread is None:
                self._arrivals.clear()
        for req in orphans:  # no loop will ever answer them
            self._deliver(req, [], True, "the engine is shutting down")
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> "InflightBatcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- batcher thread ------------------------------------------------------------

    def _deliver(self, req: _Request, tokens: list[int], finished: bool, error: str | None = None) -> bool:
        """Call the client back; a raising callback cancels its own request only."""
        try:
            req.callback(tokens, finished, error)
            return True
        except Exception:
            log.exception("callback of request %r raised; cancelling it", req.request_id)
            if not finished:
                self._finish(req, "cancelled", notify=False)
            return False

    def _dequeued(self, req: _Request) -> None:
        if req.counted:
            req.counted = False
            with self._cv:
                self._waiting_count -= 1

    def _finish(self, req: _Request, reason: str, error: str | None = None, notify: bool = True) -> None:
        seq = req.sequence
        if seq is not None:
            if not seq.finished:
                seq.finish(reason)
            self.engine.release(seq)  # the blocks go back at once
        req.stats.finish_reason = seq.reason if seq is not None else reason
        if req in self._running:
            self._running.remove(req)
            self._known.discard(req.request_id)
        elif req in self._queue:
            self._queue.remove(req)
            self._dequeued(req)
        if notify:
            self._deliver(req, [], True, error)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not (self._arrivals or self._queue or self._running or self._stopping or self._cancel):
                    self.stats.idle()  # nothing in flight: the gauges read zero, not the last step
                while not (self._arrivals or self._queue or self._running or self._stopping or self._cancel):
                    self._cv.wait()
                if self._stopping:
                    pending = self._arrivals + self._queue + self._running
                    self._arrivals = []
                    break
                cancel, self._cancel = self._cancel, set()
                arrived, self._arrivals = self._arrivals, []
            try:
                self._enqueue(arrived)
                self._apply_cancels(cancel)
                batch = self._schedule()
                if batch:
                    self._step(batch)
            except Exception as err:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("inflight batcher step failed")
                for req in list(self._running):
                    self._finish(req, "error", f"internal engine error: {type(err).__name__}: {err}")
        for req in pending:
            if isinstance(req.sequence, BeamSequence):
                req.sequence.finish("cancelled")  # its other beams' blocks go back too
            if req.sequence is not None:
                self.engine.release(req.sequence)
            self._deliver(req, [], True, "the engine is shutting down")

    def _enqueue(self, arrived: list[_Request]) -> None:
        for req in arrived:
            try:
                problem = self.engine.request_problem(req.prompt, req.params, req.draft, req.draft_logits)
            except Exception as err:  # malformed input the checks did not foresee
                problem = f"invalid request: {type(err).__name__}: {err}"
            if problem is None and (req.request_id in self._known
                                    or any(q.request_id == req.request_id for q in self._queue)):
                problem = f"request id {req.request_id!r} is already in flight"
            if problem is None and req.params.beam_width > 1 and self.config.policy != "guaranteed_no_evict":
                # A paused request resumes by re-prefilling one sequence; a beam search's other beams would be lost.
                problem = ("beam search (beam_width > 1) needs batch_scheduler_policy guaranteed_no_evict on the "
                           "CPU engine")
            if problem is None and req.params.beam_width > 1 and req.logits is not None:
                problem = "return_generation_logits with beam search (beam_width > 1) is not supported by the CPU engine"
            if problem is not None:
                self._dequeued(req)
                self._deliver(req, [], True, problem)
                continue
            try:
                req.sequence = start_sequence(self.engine, req.prompt, req.params, req.draft, req.draft_logits,
                                              req.draft_threshold, logprobs=req.logprobs)
            except Exception as err:  # the log-prob record's own check, or a guide's matcher failing
                self._dequeued(req)
                self._deliver(req, [], True, str(err))
                continue
            req.sequence.generation_logits = req.logits
            if isinstance(req.sequence, BeamSequence):
                req.sequence.results = req.beam_results
            req.stats.total_draft_tokens = len(req.draft)
            bisect.insort(self._queue, req, key=lambda r: r.rank)

    def _apply_cancels(self, cancel: set) -> None:
        if not cancel:
            return
        for req in [r for r in self._running + self._queue if r.request_id in cancel]:
            self._finish(req, "cancelled")

    # -- scheduling ------------------------------------------------------------------

    def _pause(self, req: _Request) -> None:
        """max_utilization: give a running request's blocks back; it resumes from the queue
        with its tokens, re-prefilling them (reusing whatever blocks are still cached)."""
        self.engine.release(req.seq)
        self.engine.hold_lora(req.seq)  # a paused request keeps its adapter cached (PeftCacheManager: host cache)
        self._running.remove(req)
        self._known.discard(req.request_id)
        req.paused = True
        bisect.insort(self._queue, req, key=lambda r: r.rank)
        req.stats.paused += 1
        self.stats.paused_total += 1

    def _make_room(self) -> set:
        """max_utilization: every running request gets the block its next step needs; returns
        the ids paused for it."""
        engine = self.engine
        paused: set = set()  # request ids
        while True:
            need = sum(1 for r in self._running if not r.seq.in_context and engine.needs_block(r.seq, 1))
            if need <= engine.kv.free_blocks or not self._running:
                return paused
            victim = self._running[-1]
            paused.add(victim.request_id)
            self._pause(victim)

    def _chunk(self, seq: Sequence, budget: int, first_context: bool) -> int:
        """Tokens of `seq`'s context to run this step within `budget`, 0 for none."""
        pending = seq.pending
        if pending <= budget:
            return pending
        if self.config.enable_chunked_context:
            tpb = self.engine.kv.tokens_per_block
            return budget // tpb * tpb
        # Unchunked, a context larger than a whole step (a resumed request's prompt + output) could
        # never fit: it runs as the step's only context rather than wait forever.
        return pending if first_context and pending > self.engine.limits.max_num_tokens else 0

    def _schedule(self) -> list[tuple[_Request, int]]:
        engine, lim = self.engine, self.engine.limits
        guaranteed = self.config.policy == "guaranteed_no_evict"
        paused_now = set() if guaranteed else self._make_room()
        batch: list[tuple[_Request, int]] = []
        budget = lim.max_num_tokens
        # Generation first, then contexts already under way (TensorRT-LLM's micro-batch order).
        for req in self._running:
            if not req.seq.in_context and budget > 0 and len(batch) < lim.max_batch_size:
                batch.append((req, 1))
                budget -= self._tokens_of(req.seq, 1)
        for req in self._running:
            if req.seq.in_context and len(batch) < lim.max_batch_size:
                n = self._chunk(req.seq, budget, first_context=not any(r.seq.in_context for r, _ in batch))
                if n:
                    batch.append((req, n))
                    budget -= self._tokens_of(req.seq, n)
        # Admissions, in rank order, stopping at the first that does not fit.
        if guaranteed:
            free = engine.kv.free_blocks - sum(engine.blocks_to_finish(r.seq) for r in self._running)
        else:
            free = engine.kv.free_blocks - sum(1 for r in self._running
                                               if not r.seq.in_context and engine.needs_block(r.seq, 1))
        while self._queue and len(self._running) < lim.max_batch_size and len(batch) < lim.max_batch_size:
            req = self._queue[0]
            seq = req.seq
            if req.request_id in paused_now:  # paused for room this very step
                break
            need = engine.blocks_to_add(seq) + (engine.blocks_to_finish(seq) if guaranteed else 0)
            if need > free:
                break
            first_context = not any(r.seq.in_context for r, _ in batch)
            context = len(seq.tokens) - (0 if seq.wants_context else engine.kv.matched_tokens(
                seq.tokens, engine.kv.reuse_root(seq.params.lora_task_id)))
            if context > budget and not (self.config.enable_chunked_context and budget >= engine.kv.tokens_per_block
                                         or first_context and context > lim.max_num_tokens):
                break  # cannot start this step
            self._queue.pop(0)
            self._dequeued(req)
            req.paused = False
            engine.add(seq)
            st, table = req.stats, seq.table
            # Counted around each context allocation, as the backend's kvCacheMetrics are.
            st.kv_cache_reused_blocks += table.reused
            st.kv_cache_alloc_new_blocks += table.alloc_new
            st.kv_cache_alloc_total_blocks += table.alloc_total
            table.reused = table.alloc_new = table.alloc_total = 0
            if not st.first_scheduled_ns:
                st.first_scheduled_ns = time.time_ns()
            free -= need
            n = self._chunk(seq, budget, first_context)
            if any(not r.seq.in_context for r in self._running):
                self.stats.joined_running += 1
            bisect.insort(self._running, req, key=lambda r: r.rank)
            self._known.add(req.request_id)
            if n:
                batch.append((req, n))
                budget -= self._tokens_of(seq, n)
        return batch

    @staticmethod
    def _tokens_of(seq: Sequence, n: int) -> int:
        """Tokens a chunk puts through the step: drafts ride on a context's last chunk, a Medusa
        tree on a generation step."""
        return n + len(seq.riders(n))

    def _step(self, batch: list[tuple[_Request, int]]) -> None:
        items = [(r.seq, n) for r, n in batch]
        context = [(r, n) for r, n in batch if r.seq.in_context]
        try:
            emitted = step_with_beams(self.engine, items)
        except Exception:
            log.exception("batched step failed; retrying its %d requests one by one", len(batch))
            emitted = []
            for seq, n in items:
                try:
                    emitted.extend(step_with_beams(self.engine, [(seq, n)]))
                except Exception as err:
                    seq.error = f"engine step failed: {type(err).__name__}: {err}"
                    seq.finish("error")
                    emitted.append([])
        st = self.stats
        st.steps += 1
        st.max_running = max(st.max_running, len(batch))
        st.active = len(self._running) + len(self._queue)
        st.scheduled, st.context = len(batch), len(context)
        st.context_tokens = sum(n for _, n in context)
        st.generation = len(batch) - len(context)
        st.paused = sum(1 for r in self._queue if r.paused)
        st.chunked_steps += any(r.seq.in_context for r, _ in context)
        st.timestamp_us = time.time_ns() // 1000
        for (req, _), tokens in zip(batch, emitted, strict=False):
            st.tokens += len(tokens)
            seq = req.seq
            drafted, accepted = seq.drafted - req.speculation[0], seq.accepted_draft - req.speculation[1]
            if drafted > 0 or accepted > 0:
                st.draft_tokens += drafted
                st.accepted_draft_tokens += accepted
                st.draft_steps += drafted > 0
                req.speculation = (seq.drafted, seq.accepted_draft)
            req.stats.total_accepted_draft_tokens = seq.accepted_draft
            req.stats.total_draft_tokens = seq.drafted
            if seq.finished:
                req.stats.finish_reason = seq.reason
                self.engine.release(seq)
                self._running.remove(req)
                self._known.discard(req.request_id)
                self._deliver(req, tokens, True, seq.error)
            elif tokens:
                self._deliver(req, tokens, False)  # a raising callback cancels its request there
