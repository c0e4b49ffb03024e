"""The inflight batcher's scheduling over the paged KV cache: priorities, the queue
bound, both capacity policies (pause and resume included), chunked context, prefix
reuse and cancellation, each checked against the tokens a request gets alone."""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine_cpu_batcher import TIMEOUT, Collector
from test_engine_cpu_util import _one_thread, engine_dir  # noqa: F401

from toolchain.engine.cpu import (CpuEngine, InflightBatcher, KvCacheConfig, QueueFull, RequestStats, SamplingParams,
                                  SchedulerConfig)
from toolchain.errors import ToolchainError

TPB = 16


def make_engine(factory, hf_dir, *, max_tokens=None, reuse=True, **build) -> CpuEngine:
    build = {"plugin_config": {"tokens_per_block": TPB}, **build}
    return CpuEngine.load(engine_dir(factory, hf_dir, 1, 1, **build),
                          kv_cache=KvCacheConfig(tokens_per_block=TPB, max_tokens=max_tokens, enable_block_reuse=reuse))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 240 + 1 for i in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def test_a_pool_smaller_than_one_sequence_fails_at_start_up(tmp_path_factory, hf_llama):
    with pytest.raises(ToolchainError, match=r"KV cache holds 64 tokens .* less than one max_seq_len \(160\)"):
        make_engine(tmp_path_factory, hf_llama, max_tokens=64)


def test_priority_orders_admission_fifo_among_equals(tmp_path_factory, hf_llama):
    engine = make_engine(tmp_path_factory, hf_llama, max_batch_size=1)
    col, gate = Collector(), threading.Event()
    with InflightBatcher(engine) as b:
        b.submit("first", prompt(0, 5), greedy(5), col.callback("first", gate))
        assert col.first_token["first"].wait(TIMEOUT)  # the loop is held: the rest queue up behind it
        for rid, priority in (("low", 0.2), ("high-1", 0.9), ("default", 0.5), ("high-2", 0.9)):
            b.submit(rid, prompt(1, 5), greedy(2), col.callback(rid), priority=priority)
        gate.set()
        col.wait()
    started = sorted(col.done, key=lambda rid: col.index(rid, lambda e: e[1]))
    assert started == ["first", "high-1", "high-2", "default", "low"]
    with pytest.raises(ValueError, match="priority"):
        InflightBatcher(engine).submit("x", [1], greedy(1), col.callback("x"), priority=1.5)


def test_a_full_queue_refuses_with_the_executors_error(tmp_path_factory, hf_llama):
    engine = make_engine(tmp_path_factory, hf_llama, max_batch_size=1)
    col, gate = Collector(), threading.Event()
    with InflightBatcher(engine, SchedulerConfig(max_queue_size=2)) as b:
        b.submit("run", prompt(0, 5), greedy(4), col.callback("run", gate))
        assert col.first_token["run"].wait(TIMEOUT)  # admitted, so no longer queued
        b.submit("q1", prompt(1, 5), greedy(2), col.callback("q1"))
        b.submit("q2", prompt(2, 5), greedy(2), col.callback("q2"))
        with pytest.raises(QueueFull, match="Maximum queue size of 2 has been reached"):
            b.submit("q3", prompt(3, 5), greedy(2), col.callback("q3"))
        gate.set()
        col.wait("run", "q1", "q2")
        b.submit("q4", prompt(4, 5), greedy(2), col.callback("q4"))  # room again once admitted
        col.wait("q4")
    assert all(col.final(r)[3] is None for r in ("run", "q1", "q2", "q4"))


def contended(tmp_path_factory, hf_llama, policy):
    """Four requests whose longest lengths (12 + 60 tokens = 5 blocks each) cannot all be
    held in a 160-token (10-block) pool at once."""
    engine = make_engine(tmp_path_factory, hf_llama, max_tokens=160, reuse=False)
    requests = [(prompt(i, 12), greedy(60)) for i in range(4)]
    alone = [engine.generate(p, s) for p, s in requests]
    col = Collector()
    stats = {i: RequestStats() for i in range(4)}
    with InflightBatcher(engine, SchedulerConfig(policy=policy)) as b:
        for i, (p, s) in enumerate(requests):
            b.submit(i, p, s, col.callback(i), stats=stats[i])
        col.wait()
    assert [col.tokens(i) for i in range(4)] == alone
    assert engine.kv.used_blocks == 0
    return b.stats, stats


def test_guaranteed_no_evict_admits_only_what_can_finish(tmp_path_factory, hf_llama):
    st, per_request = contended(tmp_path_factory, hf_llama, "guaranteed_no_evict")
    assert st.max_running == 2 and st.paused_total == 0  # 2 x 5 blocks reserved fill the pool


def test_max_utilization_pauses_and_resumes_without_losing_tokens(tmp_path_factory, hf_llama):
    st, per_request = contended(tmp_path_factory, hf_llama, "max_utilization")
    assert st.max_running > 2  # admitted on the context's need alone
    assert st.paused_total > 0 and sum(s.paused for s in per_request.values()) == st.paused_total


def test_chunked_context_splits_long_prompts_in_whole_blocks(tmp_path_factory, hf_llama, monkeypatch):
    engine = make_engine(tmp_path_factory, hf_llama, max_num_tokens=40, max_input_len=120)
    long_prompt, short_prompt = prompt(7, 100), prompt(8, 6)
    want_long, want_short = engine.generate(long_prompt, greedy(5)), engine.generate(short_prompt, greedy(30))
    engine.kv.enable_block_reuse = False  # the second run must compute the whole prompt again
    steps, real_step = [], engine.step

    def recording_step(batch):
        steps.append([(len(s.prompt), n) for s, n in batch if s.in_context or len(s.prompt) == 6])
        return real_step(batch)

    monkeypatch.setattr(engine, "step", recording_step)
    col, gate = Collector(), threading.Event()
    with InflightBatcher(engine, SchedulerConfig(enable_chunked_context=True)) as b:
        b.submit("short", short_prompt, greedy(30), col.callback("short", gate))
        assert col.first_token["short"].wait(TIMEOUT)
        b.submit("long", long_prompt, greedy(5), col.callback("long"))
        gate.set()
        col.wait()
    assert col.tokens("long") == want_long and col.tokens("short") == want_short
    chunks = [n for step in steps for plen, n in step if plen == 100]
    assert sum(chunks) == 100 and len(chunks) >= 3
    assert all(n % TPB == 0 for n in chunks[:-1]) and all(sum(n for _, n in step) <= 40 for step in steps)
    # the running decode kept going in every step that carried a chunk
    assert all(any(plen == 6 for plen, _ in step) for step in steps if any(plen == 100 for plen, _ in step))


def test_shared_prefix_reuses_blocks_with_identical_tokens(tmp_path_factory, hf_llama):
    engine = make_engine(tmp_path_factory, hf_llama)
    system = prompt(9, 3 * TPB)
    turns = [system + prompt(10 + i, 5) for i in range(3)]
    cold = make_engine(tmp_path_factory, hf_llama, reuse=False)
    want = [cold.generate(p, greedy(8)) for p in turns]
    col = Collector()
    stats = [RequestStats() for _ in turns]
    with InflightBatcher(engine) as b:
        for i, p in enumerate(turns):  # one after another, so each finds the previous one's blocks
            b.submit(i, p, greedy(8), col.callback(i), stats=stats[i])
            col.wait(i)
    assert [col.tokens(i) for i in range(3)] == want
    assert stats[0].kv_cache_reused_blocks == 0 and stats[0].kv_cache_alloc_total_blocks == 4
    assert [s.kv_cache_reused_blocks for s in stats[1:]] == [3, 3]
    assert all(s.kv_cache_alloc_total_blocks == 1 for s in stats[1:])


def test_cancelling_a_thousand_streams_leaves_no_block_in_use(tmp_path_factory, hf_llama):
    engine = make_engine(tmp_path_factory, hf_llama, max_batch_size=16)
    col = Collector()
    with InflightBatcher(engine, SchedulerConfig(policy="max_utilization")) as b:
        for i in range(1000):
            b.submit(i, prompt(i, 8), greedy(100), col.callback(i))
        # The sixteenth stream has a token, so all sixteen ran together (none finishes in 100 tokens).
        assert col.first_token[15].wait(TIMEOUT)
        for i in range(1000):
            b.cancel(i)
        col.wait()
        assert b.stats.max_running == 16
    assert all(col.final(i)[3] is None for i in range(1000))
    assert engine.kv.used_blocks == 0 and engine.kv.free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kind, accepted", [("perfect", 4), ("half", 2), ("wrong", 0)])
def test_draft_tokens_are_verified_in_the_context_step_and_never_change_greedy_output(
        tmp_path_factory, hf_llama, kind, accepted):
    """draft_input_ids as the TRT-LLM executor takes them (external draft tokens): verified with the
    end of the context in one forward; the agreeing prefix plus one token comes out of that step,
    the rejected tokens' KV is dropped, and decoding goes on from there."""
    engine = make_engine(tmp_path_factory, hf_llama, max_draft_len=4)
    p = prompt(3, 10)
    want = engine.generate(p, greedy(12))
    off_by_one = [(t + 1) % 240 + 1 for t in want]
    draft = {"perfect": want[:4], "half": want[:2] + off_by_one[2:4], "wrong": off_by_one[:4]}[kind]
    col, stats = Collector(), RequestStats()
    with InflightBatcher(engine) as b:
        b.submit("d", p, greedy(12), col.callback("d"), stats=stats, draft_tokens=draft)
        col.wait()
    assert col.tokens("d") == want
    assert (stats.total_draft_tokens, stats.total_accepted_draft_tokens) == (4, accepted)
    assert stats.acceptance_rate == accepted / 4
    assert b.stats.steps == 12 - accepted  # the context step emitted accepted + 1 tokens
    first = col.calls("d")[0][1]
    assert first == want[:accepted + 1]  # streamed together, as one response


def test_a_draft_is_verified_when_reused_blocks_cover_all_but_the_last_token(tmp_path_factory, hf_llama):
    """The BLS's loop sends each step's whole sequence again: when cached blocks hold all of it but
    the last token, that one token is the context's last chunk and still carries the draft."""
    engine = make_engine(tmp_path_factory, hf_llama, max_draft_len=4)
    p = prompt(5, 2 * TPB + 1)
    want = engine.generate(p, greedy(6))
    engine.generate(p, greedy(1))  # leaves the prompt's full blocks cached
    seq = engine.start(p, greedy(5), draft=want[:4])
    engine.add(seq)
    try:
        assert seq.pending == 1  # every block but the last token's came from the cache
        emitted = engine.step([(seq, seq.pending)])[0]
    finally:
        engine.release(seq)
    assert emitted == want[:5] and seq.accepted_draft == 4


def test_draft_logits_are_judged_by_trtllm_probability_rule(tmp_path_factory, hf_llama):
    """With draft_logits a position is rejected when any token's target probability is below
    threshold x draft probability (TensorRT-LLM acceptDraftTokensByLogitsKernel); an accepted
    position emits the draft token, a rejected one samples max(p - q, 0) renormalised."""
    engine = make_engine(tmp_path_factory, hf_llama, max_draft_len=4)
    p = prompt(7, 9)
    want = engine.generate(p, greedy(8))
    vocab = engine.vocab_size

    def run(draft, logits, threshold=None, n=5):
        seq = engine.start(p, greedy(n), draft, logits, threshold)
        engine.add(seq)
        try:
            emitted = engine.step([(seq, seq.pending)])[0]
        finally:
            engine.release(seq)
        return emitted, seq.accepted_draft

    # The target's own distributions as the draft's: p == q, never below u * q (random u <= 1).
    own = engine.forward_logits(p + want[:3])[-4:]
    assert run(want[:4], own) == (want[:5], 4)
    # Threshold 0 accepts anything, even tokens the target would never pick: upstream's rule is not lossless.
    wrong = [(t + 1) % 240 + 1 for t in want[:4]]
    flat = torch.zeros(4, vocab)
    emitted, accepted = run(wrong, flat, threshold=0.0)
    assert accepted == 4 and emitted[:4] == wrong
    # A huge threshold rejects the first position; the draft's mass (all on its token) is taken out of
    # p, so greedy picks the target's own best token unless that was the draft's.
    peaked = torch.full((4, vocab), -30.0)
    peaked[torch.arange(4), torch.tensor(wrong)] = 30.0
    assert run(wrong, peaked, threshold=1e9) == ([want[0]], 0)
    with pytest.raises(ToolchainError, match=rf"draft_logits must be \[4 draft tokens, {vocab} vocab\]"):
        engine.start(p, greedy(5), wrong, torch.zeros(3, vocab))


def test_draft_tokens_need_an_engine_built_for_them(tmp_path_factory, hf_llama):
    plain = make_engine(tmp_path_factory, hf_llama)
    with pytest.raises(ToolchainError, match="built without speculative decoding"):
        plain.start(prompt(1, 5), greedy(4), draft=[5, 6])
    spec = make_engine(tmp_path_factory, hf_llama, max_draft_len=4)
    with pytest.raises(ToolchainError, match="5 draft tokens exceed the engine's max_draft_len 4"):
        spec.start(prompt(1, 5), greedy(8), draft=[5, 6, 7, 8, 9])
    with pytest.raises(ToolchainError, match="draft_input_ids: token id 999"):
        spec.start(prompt(1, 5), greedy(8), draft=[5, 999])


def test_sampled_requests_with_a_draft_draw_exactly_what_they_draw_without(tmp_path_factory, hf_llama):
    """Verification samples the target position by position from the request's own generator, so a
    draft changes how many tokens a step yields, never which: per seed the tokens are identical (a
    stronger property than matching the distribution)."""
    engine = make_engine(tmp_path_factory, hf_llama, max_draft_len=4)
    p = prompt(5, 8)
    for seed in range(6):
        params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, seed=seed)
        want = engine.generate(p, params)
        # A draft guessed from another seed's run: some of it agrees, some does not.
        draft = engine.generate(p, SamplingParams(max_new_tokens=4, temperature=1.0, top_k=20, seed=seed + 100))
        col, stats = Collector(), RequestStats()
        with InflightBatcher(engine) as b:
            b.submit(seed, p, params, col.callback(seed), stats=stats, draft_tokens=draft)
            col.wait()
        assert col.tokens(seed) == want, seed
        assert stats.total_accepted_draft_tokens == next((i for i, (a, w) in enumerate(zip(draft, want)) if a != w), 4)
