"""The load generator: one asyncio loop drives every request of a level.

- concurrency (closed loop): N workers, each sends a session's turns back to
  back and takes the next session; t_sched is the moment a worker was free.
- rate (open loop): session arrivals come from a precomputed, seeded schedule
  (schedule.arrivals); the dispatcher sleeps until each arrival and starts the
  session whether or not earlier ones finished. Requests are built before the
  level starts, so the send path is only a stamp and a write; t_send - t_sched
  (send lag) is recorded for every request and latency is also reported from
  t_sched, so a client that falls behind cannot hide it.

Every request runs under `asyncio.wait_for(request_timeout_s)`; a timeout
cancels the call and counts as an error. Requests the workload marks for
cancellation stop after their cancel_after tokens. A connection failure, or
`failure_limit` requests in a row that timed out or failed (failfast.py),
stops the run: the requests in flight are cancelled (each transport cancels
its call when its coroutine is), nothing more is sent, `stopped` says why,
and the run is reported incomplete.

Garbage collection: each level starts with a full collection and then
freezes everything alive (`gc.freeze`) until it ends, so the collections
during the level scan only what the level allocated. Unfrozen, a full
collection over the ~250k objects a loaded tokenizer brings stalls the loop
for ~0.1 s in the middle of a level, which shows as send lag and as late
arrival stamps.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable

from toolchain.bench.datasets import Plan, Session
from toolchain.bench.failfast import MIN_STREAK, Streak, last_response
from toolchain.bench.records import RequestRecord

# Error texts that mean the server is gone rather than that one request failed.
_FATAL = ("unavailable", "connection refused", "cannot connect", "failed to connect", "server disconnected",
          "connect call failed", "connection reset")
START_LEAD_S = 0.05  # the first arrival is this far after the schedule is anchored


@contextmanager
def _frozen_gc():
    """A full collection now, then what is alive is left out of every collection until the level ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Runner:
    def __init__(self, transport, plan: Plan, *, timeout_s: float, think_time_s: float = 0.0,
                 on_done: Callable[[RequestRecord], None] | None = None, failure_limit: int = MIN_STREAK):
        self.transport, self.plan = transport, plan
        self.timeout_s, self.think_time_s = timeout_s, think_time_s
        self.on_done = on_done
        self.failure_limit = failure_limit
        """Requests in a row that may fail before the run stops; the caller sets it per level."""
        self.records: list[RequestRecord] = []
        self.aborted: str | None = None
        self.stopped: dict | None = None
        """Why the run stopped early, for report.json: the endpoint, the reason, the last response seen."""
        self.in_flight = 0
        self._streak = Streak()
        self._running: set[asyncio.Task] = set()  # tasks inside a request, to cancel on a stop
        self._cancelled: set[asyncio.Task] = set()  # the ones a stop cancelled

    # ---- one request / one session -------------------------------------------------------------------------
    def _record(self, s: Session, k: int, level: int, warm: bool, prompt) -> RequestRecord:
        tag = "w" if warm else f"L{level}-"
        rid = f"{tag}{s.index}" if len(s.turns) == 1 else f"{tag}{s.index}.{k}"
        rec = RequestRecord(index=len(self.records), request_id=rid, warmup=warm, isl=prompt.isl,
                            max_tokens=s.turns[k].max_tokens, level=level, cls=s.cls, adapter=s.adapter,
                            session=s.index if len(s.turns) > 1 else None, turn=k)
        self.records.append(rec)
        return rec

    async def _request(self, rec: RequestRecord, prompt, turn, priority: int, request=None):
        if self.aborted:  # a session that was sleeping (think time, arrival) when the run stopped
            rec.error = f"not sent: {self.aborted}"
            return None
        task = asyncio.current_task()
        assert task is not None  # always inside the loop's tasks
        self._running.add(task)
        self.in_flight += 1
        try:
            return await asyncio.wait_for(self.transport.run(rec, prompt, turn, priority, request), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            rec.error, rec.timed_out = f"timed out after {self.timeout_s:g} s", True
            return None
        except asyncio.CancelledError:
            if task not in self._cancelled:
                raise  # not ours: a stop signal or the caller
            if sys.version_info >= (3, 11):  # the cancel was ours and is handled: the task goes on
                task.uncancel()
            rec.error = f"unfinished: {self.aborted}"
            return None
        finally:
            self._running.discard(task)
            self.in_flight -= 1
            if not self.aborted:
                self._count(rec)
            if self.on_done is not None:
                self.on_done(rec)

    def _count(self, rec: RequestRecord) -> None:
        """Add an ended request to the streak; stop the run on a dead server or a long enough streak."""
        n = self._streak.add(rec)
        if rec.error and any(w in rec.error.lower() for w in _FATAL):
            self.stop(f"server stopped responding ({rec.error})", rec)
        elif n >= self.failure_limit:
            self.stop(self._streak.reason(), rec)

    def stop_if_none_answered(self, records: list[RequestRecord]) -> None:
        """Stop when every one of `records` (the warm-up) failed: an endpoint that answered none of them
        would make each level wait out a whole deadline before its streak could stop it."""
        if records and not self.aborted and all(r.error is not None and not r.cancelled for r in records):
            subject = "the one warm-up request" if len(records) == 1 else f"all {len(records)} warm-up requests"
            self.stop(self._streak.reason(subject), records[-1])

    def stop(self, reason: str, rec: RequestRecord) -> None:
        """Send nothing more and cancel every request in flight; `stopped` names the endpoint and what it sent."""
        now = time.perf_counter_ns()
        self.aborted = reason
        for task in self._running:
            self._cancelled.add(task)
            task.cancel()
        self.stopped = {"url": getattr(self.transport, "url", None), "model": getattr(self.transport, "model", None),
                        "level": "warmup" if rec.warmup else rec.level, "reason": reason,
                        "failed_requests": [r.request_id for r in self._streak.failed],
                        "cancelled_in_flight": len(self._running), "last_response": last_response(self.records, now)}

    async def _session(self, s: Session, level: int, t_sched: int | None, warm: bool = False, first=None) -> None:
        """t_sched None (closed loop): due as soon as the request is built, so building it is not send lag."""
        history: list[Any] = []
        for k, turn in enumerate(s.turns):
            if self.aborted:
                return
            if k == 0 and first is not None:
                rec, prompt, request = first
            else:
                prompt = self.plan.prompt(s, k, history)
                rec, request = self._record(s, k, level, warm, prompt), None
            now = time.perf_counter_ns()
            t_sched = now if t_sched is None else max(t_sched, now) if k else t_sched
            rec.t_sched = t_sched
            delay = (t_sched - time.perf_counter_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            reply = await self._request(rec, prompt, turn, s.priority, request)
            if reply is None or rec.error or rec.cancelled:
                return  # a conversation does not go on after a failed or abandoned turn
            history.append((turn, reply.text, reply.ids))
            t_sched = time.perf_counter_ns() + int(self.think_time_s * 1e9)

    # ---- load modes ----------------------------------------------------------------------------------------
    async def closed_loop(self, sessions: Iterable[Session], concurrency: int, level: int, *,
                          duration_s: float | None = None, warm: bool = False) -> None:
        with _frozen_gc():
            await self._closed_loop(sessions, concurrency, level, duration_s, warm)

    async def _closed_loop(self, sessions, concurrency: int, level: int, duration_s: float | None,
                           warm: bool) -> None:
        it = iter(sessions)
        deadline = None if duration_s is None else time.perf_counter_ns() + int(duration_s * 1e9)

        async def worker() -> None:
            while not self.aborted and (deadline is None or time.perf_counter_ns() < deadline):
                s = next(it, None)
                if s is None:
                    return
                await self._session(s, level, None, warm)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if duration_s is None:  # a count-bound iterator is finite: account for what was never sent
            self._not_sent(it, level, warm)

    async def open_loop(self, sessions: list[Session], offsets_s: list[float], level: int) -> None:
        with _frozen_gc():
            await self._open_loop(sessions, offsets_s, level)

    async def _open_loop(self, sessions: list[Session], offsets_s: list[float], level: int) -> None:
        # Build every first request now: the send path must be a stamp and a write.
        firsts = []
        for s in sessions:
            prompt = self.plan.prompt(s, 0, [])
            rec = self._record(s, 0, level, False, prompt)
            firsts.append((rec, prompt, self.transport.build(rec, prompt, s.turns[0], s.priority)))
        tasks = set()
        t0 = time.perf_counter_ns() + int(START_LEAD_S * 1e9)
        for i, (s, off) in enumerate(zip(sessions, offsets_s, strict=False)):
            if self.aborted:
                for rec, _, _ in firsts[i:]:
                    rec.error = f"not sent: {self.aborted}"
                break
            t_sched = t0 + int(off * 1e9)
            delay = (t_sched - time.perf_counter_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._session(s, level, t_sched, first=firsts[i]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    def _not_sent(self, it, level: int, warm: bool) -> None:
        if not self.aborted:
            return
        for s in it:  # count mode only: a finite iterator
            rec = self._record(s, 0, level, warm, self.plan.prompt(s, 0, []))
            rec.error = f"not sent: {self.aborted}"
