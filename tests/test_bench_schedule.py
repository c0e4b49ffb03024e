"""Open-loop arrival schedules: seeded, with the asked-for rate and burstiness (no timing); levels and the collector."""

from __future__ import annotations

import pytest

from toolchain.bench import schedule


def test_same_seed_same_schedule_and_levels_differ():
    a = schedule.arrivals(50, count=200, seed="0:1")
    assert a == schedule.arrivals(50, count=200, seed="0:1")
    assert a != schedule.arrivals(50, count=200, seed="0:2")
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))


@pytest.mark.parametrize("arrival, burstiness, cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0),
                                                     ("gamma", 4.0, 0.5), ("constant", 1.0, 0.0)])
def test_mean_rate_and_burstiness(arrival, burstiness, cv):
    g = schedule.gaps(20000, 100.0, arrival, burstiness, seed=3)
    assert g.mean() == pytest.approx(0.01, rel=0.05)
    # gamma with shape k has coefficient of variation 1/sqrt(k): burstiness < 1 clusters arrivals
    assert g.std() / g.mean() == pytest.approx(cv, abs=0.08)


def test_duration_bound_schedule_stops_at_the_horizon():
    a = schedule.arrivals(200, duration_s=2.0, seed=1)
    assert max(a) < 2.0 and len(a) == pytest.approx(400, rel=0.15)
    # the duration schedule is a prefix of the same seeded process
    assert a[:50] == schedule.arrivals(200, count=50, seed=1)


def test_bad_arguments():
    with pytest.raises(ValueError):
        schedule.gaps(3, 0)
    with pytest.raises(ValueError):
        schedule.gaps(3, 1, "uniform")
    with pytest.raises(ValueError):
        schedule.arrivals(1)


def test_levels_run_with_the_heap_frozen_out_of_the_collector():
    """A full collection over everything alive (tokenizer included) would stall the loop mid-level."""
    import asyncio
    import gc

    from toolchain.bench.datasets import Prompt, Session, Turn
    from toolchain.bench.loadgen import Runner
    from toolchain.bench.protocols.transport import Reply

    seen = []

    class Transport:
        def build(self, rec, prompt, turn, priority):
            return b""

        async def run(self, rec, prompt, turn, priority=0, request=None):
            seen.append(gc.get_freeze_count())
            rec.t_send = rec.t_final = 1
            return Reply()

    class Plan:
        def prompt(self, s, k, history):
            return Prompt("x", None, None, 1)

    runner = Runner(Transport(), Plan(), timeout_s=1.0)
    sessions = [Session(i, turns=[Turn(max_tokens=1)]) for i in range(4)]
    asyncio.run(runner.closed_loop(sessions[:2], 2, 0))
    asyncio.run(runner.open_loop(sessions[2:], [0.0, 0.001], 1))
    assert len(seen) == 4 and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0 and all(r.ok for r in runner.records)
