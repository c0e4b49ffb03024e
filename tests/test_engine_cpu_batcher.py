"""The inflight batcher: concurrent and late-joining requests get exactly the
tokens `generate` gives them alone, tokens stream per step, and cancellation,
limits and failures affect only the request concerned."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from test_engine_cpu_util import PROMPTS, _one_thread, load_engine  # noqa: F401

from toolchain.engine.cpu import CpuEngine, InflightBatcher, SamplingParams

TIMEOUT = 30


class Collector:
    """Callbacks for many requests; records every call in one global order."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[tuple[object, list[int], bool, str | None]] = []
        self.done: dict[object, threading.Event] = {}
        self.first_token: dict[object, threading.Event] = {}

    def callback(self, rid, gate: threading.Event | None = None):
        """`gate`: hold the batcher thread inside the first token's callback until it is set,
        so the test acts while the request is certainly mid-generation."""
        self.done[rid] = threading.Event()
        self.first_token[rid] = threading.Event()

        def cb(tokens, finished, error):
            with self.lock:
                self.events.append((rid, list(tokens), finished, error))
            if finished:
                self.done[rid].set()
            if tokens and not self.first_token[rid].is_set():
                self.first_token[rid].set()
                if gate is not None:
                    assert gate.wait(TIMEOUT)
        return cb

    def wait(self, *rids):
        for rid in rids or list(self.done):
            assert self.done[rid].wait(TIMEOUT), f"request {rid} did not finish"

    def tokens(self, rid):
        return [t for r, toks, _, _ in self.events if r == rid for t in toks]

    def calls(self, rid):
        return [e for e in self.events if e[0] == rid]

    def final(self, rid):
        calls = self.calls(rid)
        assert calls and calls[-1][2], f"request {rid} has no final callback"
        assert sum(c[2] for c in calls) == 1, "finished must be reported exactly once"
        return calls[-1]

    def index(self, rid, pred):
        return next(i for i, e in enumerate(self.events) if e[0] == rid and pred(e))


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama):
    return load_engine(tmp_path_factory, hf_llama, 2, 1)


@pytest.fixture
def batcher(engine):
    b = InflightBatcher(engine).start()
    yield b
    b.stop()


REQUESTS = [
    (PROMPTS[0], dict(max_new_tokens=30)),
    (PROMPTS[1], dict(max_new_tokens=12, top_k=20, temperature=1.3, seed=11)),
    (PROMPTS[2], dict(max_new_tokens=25, top_p=0.9, seed=5)),
    (PROMPTS[3], dict(max_new_tokens=18)),
    ([3, 1, 4, 1, 5, 9, 2, 6], dict(max_new_tokens=22, top_k=5, seed=2)),
    (PROMPTS[1][:4], dict(max_new_tokens=9)),
]


def test_staggered_requests_match_generate_alone(engine, batcher):
    alone = [engine.generate(p, SamplingParams(**kw)) for p, kw in REQUESTS]
    col = Collector()
    for i, (prompt, kw) in enumerate(REQUESTS):
        batcher.submit(i, prompt, SamplingParams(**kw), col.callback(i))
        time.sleep(0.004 * (i % 3))
    col.wait()
    for i in range(len(REQUESTS)):
        assert col.tokens(i) == alone[i], f"request {i}"
        assert col.final(i)[3] is None
        # Streaming: one callback per generated token (plus possibly an empty final one).
        assert len([c for c in col.calls(i) if c[1]]) == len(alone[i])
    assert batcher.stats.max_running > 1


def test_request_joins_a_running_batch(engine, batcher):
    long_params, short_params = SamplingParams(max_new_tokens=120), SamplingParams(max_new_tokens=10, seed=4, top_k=9)
    long_alone = engine.generate(PROMPTS[0], long_params)
    short_alone = engine.generate(PROMPTS[1], short_params)
    col, gate = Collector(), threading.Event()
    batcher.submit("long", PROMPTS[0], long_params, col.callback("long", gate))
    assert col.first_token["long"].wait(TIMEOUT)
    batcher.submit("short", PROMPTS[1], short_params, col.callback("short"))
    gate.set()
    col.wait()
    # The short request streamed and finished while the long one was still generating.
    assert col.index("short", lambda e: e[2]) < col.index("long", lambda e: e[2])
    assert batcher.stats.joined_running >= 1
    assert col.tokens("long") == long_alone and col.tokens("short") == short_alone


def test_iteration_stats_describe_the_last_step_and_read_zero_when_idle(engine, batcher):
    seen = []
    col = Collector()
    params = SamplingParams(max_new_tokens=6)
    engine.kv.forget_cached()  # earlier tests ran these prompts: reused blocks would leave little to prefill

    def watch(i):
        inner = col.callback(i)

        def cb(tokens, finished, error=None):
            st = batcher.stats  # called from the batcher thread, right after the step that made these tokens
            seen.append((st.scheduled, st.context, st.context_tokens, st.generation, st.active))
            return inner(tokens, finished, error)
        return cb
    batcher.submit("a", PROMPTS[0], params, watch("a"))
    batcher.submit("b", PROMPTS[1], params, watch("b"))
    col.wait()
    first = seen[0]
    # the first step prefilled whatever it admitted, and counted their prompt tokens
    assert first[1] >= 1 and first[2] >= len(PROMPTS[0]) and first[0] == first[1] + first[3]
    assert any(g >= 1 and c == 0 for _, c, _, g, _ in seen)  # later steps only decoded
    assert all(s <= a for s, _, _, _, a in seen)
    deadline = time.monotonic() + TIMEOUT
    while batcher.stats.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (batcher.stats.active, batcher.stats.scheduled) == (0, 0) and batcher.stats.timestamp_us > 0


def test_cancel_running_and_queued(tmp_path_factory, hf_llama):
    engine = load_engine(tmp_path_factory, hf_llama, 1, 1, max_batch_size=1)
    col, gate = Collector(), threading.Event()
    with InflightBatcher(engine) as b:
        b.submit("a", PROMPTS[0], SamplingParams(max_new_tokens=150), col.callback("a", gate))
        b.submit("b", PROMPTS[1], SamplingParams(max_new_tokens=100), col.callback("b"))  # waits: batch of 1
        assert col.first_token["a"].wait(TIMEOUT)
        b.cancel("b")
        b.cancel("a")
        b.cancel("never-submitted")
        gate.set()
        col.wait("a", "b")
        assert col.final("a")[3] is None and 0 < len(col.tokens("a")) < 150
        assert col.final("b")[3] is None and col.tokens("b") == []
        # The loop is still serving.
        b.submit("c", [1, 2, 3], SamplingParams(max_new_tokens=3), col.callback("c"))
        col.wait("c")
    assert col.tokens("c") == engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize("prompt,kw,message", [
    ([], {}, "empty prompt"),
    ([5, 260], {}, "outside the vocabulary"),
    (list(range(1, 70)), {}, "max_input_len"),
    (list(range(1, 50)), {"max_new_tokens": 150}, "max_seq_len"),
    ([1, 2], {"top_p": 2.0}, "top_p"),
])
def test_invalid_requests_get_an_error_callback(batcher, prompt, kw, message):
    col = Collector()
    kw.setdefault("max_new_tokens", 4)
    batcher.submit("bad", prompt, SamplingParams(**kw), col.callback("bad"))
    batcher.submit("good", [1, 2], SamplingParams(max_new_tokens=4), col.callback("good"))
    col.wait()
    rid, tokens, finished, error = col.final("bad")
    assert tokens == [] and finished and message in error
    assert len(col.tokens("good")) == 4 and col.final("good")[3] is None


def test_duplicate_id_in_flight(batcher):
    col, col2, gate = Collector(), Collector(), threading.Event()
    batcher.submit("x", [1, 2], SamplingParams(max_new_tokens=60), col.callback("x", gate))
    assert col.first_token["x"].wait(TIMEOUT)
    batcher.submit("x", [1, 2], SamplingParams(max_new_tokens=3), col2.callback("x"))
    gate.set()
    col2.wait()
    col.wait()
    assert "already in flight" in col2.final("x")[3]
    assert len(col.tokens("x")) == 60


def test_limits_bound_each_step(tmp_path_factory, hf_llama, monkeypatch):
    engine = load_engine(tmp_path_factory, hf_llama, 1, 1, max_batch_size=3, max_num_tokens=40)
    prompts = [[(i * 7 + j) % 240 + 1 for j in range(25)] for i in range(5)]
    alone = [engine.generate(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    steps = []
    real_step = engine.step

    def recording_step(batch):
        steps.append([n for _, n in batch])
        return real_step(batch)

    monkeypatch.setattr(engine, "step", recording_step)
    col = Collector()
    with InflightBatcher(engine) as b:
        for i, p in enumerate(prompts):
            b.submit(i, p, SamplingParams(max_new_tokens=6), col.callback(i))
        col.wait()
    assert max(len(s) for s in steps) <= 3
    assert all(sum(s) <= 40 for s in steps)  # two 25-token prefills never share a step
    assert [col.tokens(i) for i in range(5)] == alone


def test_failures_stay_with_their_request(engine, batcher, monkeypatch, caplog):
    poison = 13
    real_forward = engine.model.forward

    def forward(chunks, kv):
        if any(poison in c.tokens for c in chunks):
            raise RuntimeError("injected failure")
        return real_forward(chunks, kv)

    monkeypatch.setattr(engine.model, "forward", forward)
    col, gate = Collector(), threading.Event()
    batcher.submit("ok1", [1, 2, 3], SamplingParams(max_new_tokens=20), col.callback("ok1", gate))
    assert col.first_token["ok1"].wait(TIMEOUT)
    # Both join ok1's batch at the next step, so the batched step fails and is retried per request.
    batcher.submit("bad", [1, poison], SamplingParams(max_new_tokens=5), col.callback("bad"))
    batcher.submit("ok2", [4, 5], SamplingParams(max_new_tokens=5), col.callback("ok2"))
    gate.set()
    col.wait()
    assert "injected failure" in col.final("bad")[3]
    assert "retrying its 3 requests one by one" in caplog.text
    assert col.final("ok1")[3] is None and col.final("ok2")[3] is None
    monkeypatch.undo()
    assert col.tokens("ok1") == engine.generate([1, 2, 3], SamplingParams(max_new_tokens=20))
    assert col.tokens("ok2") == engine.generate([4, 5], SamplingParams(max_new_tokens=5))


def test_raising_callback_cancels_only_its_request(batcher):
    col = Collector()
    calls = itertools.count()

    def bad_callback(tokens, finished, error):
        if next(calls) == 2:
            raise ValueError("client went away")

    batcher.submit("bad", [1, 2], SamplingParams(max_new_tokens=50), bad_callback)
    batcher.submit("good", [2, 3], SamplingParams(max_new_tokens=30), col.callback("good"))
    col.wait()
    assert len(col.tokens("good")) == 30 and col.final("good")[3] is None
    # Both ran side by side; the raising one was dropped at its third call instead of running on.
    assert next(calls) == 3


def test_stop_before_start_answers_queued_requests(engine):
    col = Collector()
    b = InflightBatcher(engine)
    b.submit("q", [1, 2], SamplingParams(max_new_tokens=2), col.callback("q"))
    b.stop()
    col.wait("q")
    assert "shutting down" in col.final("q")[3]


def test_stop_finishes_pending_requests(engine):
    col, gate = Collector(), threading.Event()
    b = InflightBatcher(engine).start()
    b.submit("a", PROMPTS[0], SamplingParams(max_new_tokens=150), col.callback("a", gate))
    assert col.first_token["a"].wait(TIMEOUT)
    threading.Timer(0.2, gate.set).start()  # stop() blocks on the join; release the loop meanwhile
    b.stop()
    col.wait("a")
    assert "shutting down" in col.final("a")[3]
    with pytest.raises(RuntimeError, match="stopped"):
        b.submit("b", [1], SamplingParams(max_new_tokens=1), col.callback("b"))


def test_contract_surface():
    assert callable(CpuEngine.load)
    for name in ("start", "submit", "cancel", "stop"):
        assert callable(getattr(InflightBatcher, name))
    p = SamplingParams(5)
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.end_id, p.pad_id, p.stop_words, p.min_tokens) == \
        (1.0, 0, 0.0, None, -1, None, [], 0)
