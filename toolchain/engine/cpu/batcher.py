"""Inflight batching: requests join the running batch at the next engine step.

One background thread loops: take cancellations and new arrivals, admit
waiting requests in arrival order while the batch has room (max_batch_size)
and the step's token budget allows (max_num_tokens: prompt tokens of the
admitted plus one per decoding request), then run one `engine.step` over
everyone: the admitted are prefilled and all the others decode one token,
every linear as one matmul over the whole batch. New tokens go out through
each request's callback right after the step (streaming).

A failing request is finished with an error and the loop goes on: a bad
request is rejected before admission; if a batched step fails, each request
is retried alone so only the one that fails gets the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from toolchain.engine.cpu.engine import CpuEngine, Sequence
from toolchain.engine.cpu.sampling import SamplingParams

log = logging.getLogger(__name__)

Callback = Callable[[list[int], bool, "str | None"], None]


@dataclass
class _Request:
    request_id: object
    prompt: list[int]
    params: SamplingParams
    callback: Callback
    seq: Sequence | None = None
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class BatcherStats:
    """Counters for tests and reports: how much batching actually happened, and the last
    iteration's composition (what TensorRT-LLM's executor reports as iteration stats)."""

    steps: int = 0
    tokens: int = 0
    max_running: int = 0
    joined_running: int = 0  # admissions that happened while other requests were mid-generation
    # the last iteration
    active: int = 0                  # running + queued
    scheduled: int = 0               # in the batch
    context: int = 0                 # of them prefilled in this step
    context_tokens: int = 0          # their prompt tokens
    generation: int = 0              # of them decoding
    timestamp_us: int = 0            # when it ended (wall clock)

    def idle(self) -> None:
        self.active = self.scheduled = self.context = self.context_tokens = self.generation = 0


class InflightBatcher:
    def __init__(self, engine: CpuEngine):
        self.engine = engine
        self.stats = BatcherStats()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._cancel: set = set()
        self._known: set = set()  # ids of running requests (batcher thread only)
        # Owned by the batcher thread alone: arrivals waiting for room, and the running batch.
        self._queue: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- client side -------------------------------------------------------------

    def start(self) -> "InflightBatcher":
        with self._cv:
            if self._thread is not None:
                raise RuntimeError("InflightBatcher already started")
            self._thread = threading.Thread(target=self._loop, name="cpu-engine-batcher", daemon=True)
            self._thread.start()
        return self

    def submit(self, request_id, prompt_ids: list[int], params: SamplingParams, callback: Callback) -> None:
        """Queue a request; `callback(new_tokens, finished, error)` runs on the batcher thread."""
        with self._cv:
            if self._stopping:
                raise RuntimeError("InflightBatcher is stopped")
            self._waiting.append(_Request(request_id, prompt_ids, params, callback))
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
            never_started = thread is None
            orphans = list(self._waiting) if never_started else []
            if never_started:
                self._waiting.clear()
        for req in orphans:  # no loop will ever answer them
            self._finish(req, "cancelled", "the engine is shutting down")
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

    def _finish(self, req: _Request, reason: str, error: str | None = None, notify: bool = True) -> None:
        if req.seq is not None and not req.seq.finished:
            req.seq.finish(reason)
        if req in self._running:
            self._running.remove(req)
        self._known.discard(req.request_id)
        if notify:
            self._deliver(req, [], True, error)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not (self._waiting or self._queue or self._running or self._stopping or self._cancel):
                    self.stats.idle()  # nothing in flight: the gauges read zero, not the last step
                while not (self._waiting or self._queue or self._running or self._stopping or self._cancel):
                    self._cv.wait()
                if self._stopping:
                    pending = list(self._waiting) + list(self._running)
                    self._waiting.clear()
                    break
                cancel, self._cancel = self._cancel, set()
                arrived = list(self._waiting)
                self._waiting.clear()
            self._queue.extend(arrived)
            try:
                self._apply_cancels(cancel)
                self._admit()
                if self._running:
                    self._step()
            except Exception as err:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("inflight batcher step failed")
                for req in list(self._running):
                    self._finish(req, "error", f"internal engine error: {type(err).__name__}: {err}")
        for req in pending + list(self._queue):
            self._finish(req, "cancelled", "the engine is shutting down")

    def _apply_cancels(self, cancel: set) -> None:
        if not cancel:
            return
        for req in [r for r in self._running if r.request_id in cancel]:
            self._finish(req, "cancelled")
        kept = deque()
        for req in self._queue:
            if req.request_id in cancel:
                self._finish(req, "cancelled")
            else:
                kept.append(req)
        self._queue = kept

    def _admit(self) -> None:
        """Move queued requests into the batch, in arrival order, within the step's limits."""
        limits = self.engine.limits
        budget = limits.max_num_tokens - len(self._running)
        while self._queue and len(self._running) < limits.max_batch_size:
            req = self._queue[0]
            if req.request_id in self._known:
                self._queue.popleft()
                self._deliver(req, [], True, f"request id {req.request_id!r} is already in flight")
                continue
            try:
                problem = self.engine.request_problem(req.prompt, req.params)
            except Exception as err:  # malformed input the checks did not foresee
                problem = f"invalid request: {type(err).__name__}: {err}"
            if problem is not None:
                self._queue.popleft()
                self._deliver(req, [], True, problem)
                continue
            # Keep the token bound, except when nothing runs: a prompt longer than the budget must still go.
            if len(req.prompt) > budget and self._running:
                break
            self._queue.popleft()
            try:
                req.seq = self.engine.start(req.prompt, req.params)
            except Exception as err:  # e.g. out of memory for the KV cache
                self._deliver(req, [], True, f"cannot start request: {err}")
                continue
            budget -= len(req.prompt)
            if any(r.seq.prefilled for r in self._running):
                self.stats.joined_running += 1
            self._known.add(req.request_id)
            self._running.append(req)

    def _step(self) -> None:
        batch = list(self._running)
        prefill = [r for r in batch if not r.seq.prefilled]
        try:
            emitted = self.engine.step([r.seq for r in batch])
        except Exception:
            log.exception("batched step failed; retrying its %d requests one by one", len(batch))
            emitted = []
            for req in batch:
                try:
                    emitted.extend(self.engine.step([req.seq]))
                except Exception as err:
                    req.seq.error = f"engine step failed: {type(err).__name__}: {err}"
                    req.seq.finish("error")
                    emitted.append([])
        st = self.stats
        st.steps += 1
        st.max_running = max(st.max_running, len(batch))
        st.active = len(batch) + len(self._queue)
        st.scheduled, st.context = len(batch), len(prefill)
        st.context_tokens = sum(len(r.prompt) for r in prefill)
        st.generation = len(batch) - len(prefill)
        st.timestamp_us = time.time_ns() // 1000
        for req, tokens in zip(batch, emitted):
            self.stats.tokens += len(tokens)
            seq = req.seq
            if seq.finished:
                self._running.remove(req)
                self._known.discard(req.request_id)
                self._deliver(req, tokens, True, seq.error)
            elif tokens:
                self._deliver(req, tokens, False)  # a raising callback cancels its request there
