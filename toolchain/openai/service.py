"""The generating side of the OpenAI server: the CPU engine's `InflightBatcher`
seen from asyncio.

`EngineService.submit` queues one request on the batcher and returns a
`Generation` whose `events()` yields the batcher's callbacks on the event loop.
The callbacks run on the batcher thread; a `Handoff` carries them over, waking
the loop once per engine step for every request that step advanced (not once
per request), so the loop answers a step's tokens in one pass and the engine
thread is not interrupted mid-step by the loop taking the GIL for each one.
`cancel` finishes a request early; the batcher gives its KV blocks back at once. After every step the batcher records one iteration
stats entry in the executor's JSON shape (what trtllm-serve's `/metrics`
returns), kept in a bounded queue that `/metrics` drains, as the executor's
iteration stats queue is drained by `getLatestIterationStats`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from toolchain.engine.cpu import CpuEngine, InflightBatcher, QueueFull, RequestStats, SamplingParams, SchedulerConfig

ITER_STATS_MAX = 1000  # ExecutorConfig iterStatsMaxIterations default
# Longest the batcher waits, after a step, for the loop to have answered that step's tokens (a stuck loop
# must never stop the engine).
TURN_WAIT_S = 0.01


class StatsBatcher(InflightBatcher):
    """The inflight batcher, plus one iteration-stats record per step.

    Hooks the batcher's `_step` because the batcher has no public per-iteration
    hook yet; everything read here is what the step itself maintains."""

    def __init__(self, engine: CpuEngine, config: SchedulerConfig | None = None,
                 on_iteration: Callable[[dict], None] | None = None):
        super().__init__(engine, config)
        self.records: collections.deque = collections.deque(maxlen=ITER_STATS_MAX)
        self.records_lock = threading.Lock()
        self.on_iteration = on_iteration
        self.handoff: Handoff | None = None  # the loop the callbacks of a step are handed to at once
        # Cumulative over the server's life, as the executor's KV cache manager counts them.
        self.kv_alloc_total = self.kv_alloc_new = self.kv_reused = 0

    def _step(self, batch) -> None:
        for req, _ in batch:  # blocks counted at each (re)admission, once
            st = req.stats
            now = (st.kv_cache_alloc_total_blocks, st.kv_cache_alloc_new_blocks, st.kv_cache_reused_blocks)
            seen = getattr(req, "_counted_kv", (0, 0, 0))
            self.kv_alloc_total += now[0] - seen[0]
            self.kv_alloc_new += now[1] - seen[1]
            self.kv_reused += now[2] - seen[2]
            req._counted_kv = now
        # The step's record is kept before its tokens go out (the handoff wakes the loop when this block ends):
        # a client that has its answer finds the step in /metrics and the Prometheus gauges.
        with nullcontext() if self.handoff is None else self.handoff.step():
            tokens_before = self.stats.tokens
            t0 = time.perf_counter()
            super()._step(batch)
            latency_ms = (time.perf_counter() - t0) * 1000.0
            completed = sum(1 for req, _ in batch if req.seq.finished)
            record = self._record(batch, latency_ms, completed, self.stats.tokens - tokens_before)
            with self.records_lock:
                self.records.append(record)
            if self.on_iteration is not None:
                self.on_iteration(record)

    def _record(self, batch, latency_ms: float, completed: int, tokens: int) -> dict:
        st, kv, lim = self.stats, self.engine.kv, self.engine.limits
        missed = self.kv_alloc_total  # context blocks not found in the cache
        looked_up = self.kv_reused + missed
        return {
            "timestamp": datetime.now().strftime("%m-%d-%Y %H:%M:%S.%f"),
            "iter": st.steps - 1,
            "iterLatencyMS": latency_ms,
            "numActiveRequests": len(self._running),
            "numQueuedRequests": len(self._queue),
            "numCompletedRequests": completed,
            "maxNumActiveRequests": lim.max_batch_size,
            "maxBatchSizeStatic": lim.max_batch_size,
            "maxBatchSizeRuntime": lim.max_batch_size,
            "maxNumTokensStatic": lim.max_num_tokens,
            "maxNumTokensRuntime": lim.max_num_tokens,
            "gpuMemUsage": 0,  # nothing runs on a GPU
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": kv.num_blocks,
                "freeNumBlocks": kv.free_blocks,
                "usedNumBlocks": kv.used_blocks,
                "tokensPerBlock": kv.tokens_per_block,
                "allocTotalBlocks": self.kv_alloc_total,
                "allocNewBlocks": self.kv_alloc_new,
                "reusedBlocks": self.kv_reused,
                "missedBlocks": missed,
                "cacheHitRate": self.kv_reused / looked_up if looked_up else 0.0,
            },
            "inflightBatchingStats": {
                "numScheduledRequests": st.scheduled,
                "numContextRequests": st.context,
                "numGenRequests": st.generation,
                "numPausedRequests": st.paused,
                "numCtxTokens": st.context_tokens,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": tokens / len(batch) if batch else 0.0,
            },
        }

    def drain(self) -> list[dict]:
        with self.records_lock:
            out = list(self.records)
            self.records.clear()
        return out

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping


class Handoff:
    """Callbacks from the batcher thread to one event loop. Each `put` is queued; the loop is woken
    with one `call_soon_threadsafe` for all of them: at once outside a step, at the end of the step
    inside one (`step()`), so a step over N requests costs the loop one wake-up, not N. After a step
    the batcher lets the loop take its turn (the readers it woke have each run) before the next
    step starts, waiting at most TURN_WAIT_S."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Generation, tuple]] = []
        self._held = False  # the batcher is inside a step: wake the loop at its end
        self._scheduled = False  # a dispatch is queued on the loop and has not run yet
        self._answered = threading.Event()

    def put(self, gen: "Generation", item: tuple) -> None:
        """Batcher thread. Raises RuntimeError once the loop is closed (the batcher then cancels the request)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._items.append((gen, item))
            if self._held or self._scheduled:
                return
            self._scheduled = True
        self._wake()

    @contextmanager
    def step(self):
        with self._lock:
            self._held = True
        try:
            yield
        finally:
            with self._lock:
                self._held = False
                wake = bool(self._items) and not self._scheduled
                self._scheduled = self._scheduled or wake
            if wake:
                self._answered.clear()
                self._wake()
                # The loop's turn: the engine thread and the event loop share one GIL, and a loop that
                # answers a step's tokens while the next step runs takes the GIL from it between every
                # torch call; on a busy host each of those handoffs waits for a CPU (the batcher's run-
                # queue wait per token fell from 3.2 to 0.55 ms with this, benchmarks/README.md).
                self._answered.wait(TURN_WAIT_S)

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._dispatch)
        except RuntimeError:  # closed under us: nobody is left to read these
            with self._lock:
                self._items.clear()
                self._scheduled = False
            raise

    def _dispatch(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for gen, item in items:
            gen.arrive(item)
        # After the readers this woke have each run their turn (they were queued first).
        self.loop.call_soon(self._answered.set)


@dataclass
class Generation:
    """One request in flight, as the HTTP handler sees it."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    handoff: Handoff
    logprobs: Any = None  # the engine's TokenLogprobs record, when the request asked for log-probs
    stats: RequestStats = field(default_factory=RequestStats)
    arrival_ns: int = field(default_factory=time.time_ns)
    first_token_ns: int = 0
    last_token_ns: int = 0
    output: list[int] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False  # by us: client gone or a stop string matched
    error: str | None = None
    pending: collections.deque = field(default_factory=collections.deque)  # arrived, not yet read by events()
    waiter: asyncio.Future | None = None

    def callback(self, tokens, finished, error=None) -> None:
        # Batcher thread. Raises RuntimeError once the loop is closed; the batcher then cancels the request.
        self.handoff.put(self, ([int(t) for t in tokens or ()], finished, error))

    def arrive(self, item: tuple) -> None:
        """Event loop: one callback's (tokens, finished, error)."""
        self.pending.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _take(self) -> tuple[list[int], bool, str | None]:
        """Everything that arrived since the last read, as one event: a reader that fell behind gets
        the tokens of several steps together rather than one stale step at a time."""
        tokens, finished, error = self.pending.popleft()
        while self.pending and not finished:
            more, finished, error = self.pending.popleft()
            tokens = tokens + more
        return tokens, finished, error

    async def events(self):
        """(new tokens, finished) until the request ends; raises RuntimeError on an engine error."""
        while not self.done:
            if not self.pending:
                self.waiter = self.handoff.loop.create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None
            tokens, finished, error = self._take()
            if tokens:
                now = time.time_ns()
                self.first_token_ns = self.first_token_ns or now
                self.last_token_ns = now
                self.output += tokens
            if finished:
                self.done = True
                if error:
                    self.error = error
                    raise RuntimeError(error)
            yield tokens, finished

    def finish_reason(self, stop_ids: list[int]) -> str:
        """OpenAI's reason for the engine's: "length" at max_new_tokens, else "stop" (end_id or a
        stop word). Read from RequestStats where the batcher records it; otherwise told apart as
        `Sequence.take` decides: a stop word first, then max_new_tokens, anything shorter is end_id."""
        engine_reason = getattr(self.stats, "finish_reason", None)
        if engine_reason in ("length", "end_id", "stop_word"):
            return "length" if engine_reason == "length" else "stop"
        if self.output and any(self.output[-1:] == w for w in ([i] for i in stop_ids)):
            return "stop"
        return "length" if len(self.output) >= self.params.max_new_tokens else "stop"


class EngineService:
    def __init__(self, engine: CpuEngine, scheduler: SchedulerConfig | None = None,
                 on_iteration: Callable[[dict], None] | None = None):
        self.engine = engine
        self.batcher = StatsBatcher(engine, scheduler, on_iteration)
        self._ids = itertools.count(1)
        self.inflight: dict[int, Generation] = {}

    def _handoff(self) -> Handoff:
        loop = asyncio.get_running_loop()
        handoff = self.batcher.handoff
        if handoff is None or handoff.loop is not loop:
            handoff = self.batcher.handoff = Handoff(loop)
        return handoff

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: float | None = None,
               logprobs: Any = None) -> Generation:
        """Raises QueueFull when the queue bound is reached. `logprobs` (the engine's TokenLogprobs, owned by
        the caller) is filled by the engine before each callback hears of the tokens it covers."""
        gen = Generation(next(self._ids), prompt_ids, params, self._handoff(), logprobs=logprobs)
        kwargs: dict[str, Any] = {} if priority is None else {"priority": priority}
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        self.inflight[gen.request_id] = gen
        try:
            self.batcher.submit(gen.request_id, prompt_ids, params, gen.callback, stats=gen.stats, **kwargs)
        except (QueueFull, ValueError, RuntimeError):
            self.inflight.pop(gen.request_id, None)
            raise
        return gen

    def release(self, gen: Generation) -> None:
        """The handler is done with `gen`: cancel it in the batcher if it still runs."""
        self.inflight.pop(gen.request_id, None)
        if not gen.done:
            gen.cancelled = True
            self.batcher.cancel(gen.request_id)


async def merge_streams(streams: list):
    """The items of several async iterators as each produces them (the chunks of a request's several
    prompts, as trtllm-serve merges its generators for one completions request). An iterator's exception
    is raised here; the others are closed."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as err:  # handed to the reader, which raises it
            await queue.put((None, err))
        finally:
            await queue.put((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    left = len(tasks)
    try:
        while left:
            item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
