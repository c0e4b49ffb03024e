"""The CPU engine's KV-block events as a Dynamo worker relays them (toolchain/dynamo/kv_events.py): each full block
the cache registers is published once as stored, chained to its parent, with the engine's own hash; partly filled
blocks (kept for partial reuse) never are; a block whose registration ends is published as removed. No Dynamo
needed: the publisher is a recorder with KvEventPublisher's method names."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchain.dynamo.kv_events import KvEventRelay

REPO = Path(__file__).resolve().parents[1]


class Recorder:
    def __init__(self):
        self.stored: list[tuple[list[int], list[int], list[int], int | None]] = []
        self.removed: list[int] = []

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None):
        self.stored.append((token_ids, num_block_tokens, block_hashes, parent_hash))

    def publish_removed(self, block_hashes):
        self.removed += block_hashes


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from toolchain.llmapi.cpu_llm import load_engine

    eng, _, _ = load_engine({"model": str(REPO / "models" / "tiny-llama"), "dtype": "float32",
                             "kv_cache_config": {"max_tokens": 4096, "tokens_per_block": 32}},
                            tmp_path_factory.mktemp("kv-events"), 1)
    return eng


def test_no_listener_by_default(engine):
    assert engine.kv.events is None


def test_full_blocks_are_stored_once_chained_and_removed_when_dropped(engine):
    from toolchain.engine.cpu import SamplingParams

    rec = Recorder()
    relay = KvEventRelay(rec, engine.kv.tokens_per_block)
    engine.kv.forget_cached()
    engine.kv.events = relay
    try:
        prompt = list(range(100, 170))  # 70 tokens: two full blocks and a partial one
        engine.generate(prompt, SamplingParams(max_new_tokens=1))
        assert len(rec.stored) == 2 and relay.stored_blocks == 2
        (t0, n0, h0, p0), (t1, n1, h1, p1) = rec.stored
        assert (t0, t1) == (prompt[:32], prompt[32:64]) and n0 == n1 == [32]
        assert p0 is None and p1 == h0[0]  # the second block hangs under the first
        # The same prefix again: its blocks are reused, nothing new is stored for them.
        engine.generate(prompt[:64] + [7, 8, 9], SamplingParams(max_new_tokens=1))
        assert len(rec.stored) == 2
        assert engine.kv.forget_cached() >= 2
        assert set(rec.removed) == {h0[0], h1[0]} and relay.removed_blocks == 2
    finally:
        engine.kv.events = None


def test_a_failing_publisher_never_fails_the_engine(engine):
    from toolchain.engine.cpu import SamplingParams

    class Broken:
        def publish_stored(self, *a, **k):
            raise RuntimeError("event plane gone")

        def publish_removed(self, *a, **k):
            raise RuntimeError("event plane gone")

    relay = KvEventRelay(Broken(), engine.kv.tokens_per_block)
    engine.kv.forget_cached()
    engine.kv.events = relay
    try:
        assert len(engine.generate(list(range(200, 270)), SamplingParams(max_new_tokens=2))) == 2
        engine.kv.forget_cached()
        assert relay.stored_blocks == relay.removed_blocks == 0
    finally:
        engine.kv.events = None
