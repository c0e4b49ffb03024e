"""How the OpenAI server moves tokens from the engine to a stream: each token is
decoded once (not the text around it again), and one engine step over several
requests wakes the event loop once, each request's tokens arriving as that step
produced them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_engine_cpu_util import _one_thread, load_engine  # noqa: F401

from toolchain.engine.cpu import SamplingParams

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "models" / "tiny-llama"
# Leading spaces, punctuation and characters the vocabulary spells in byte-fallback pieces (several tokens each).
TEXT = "Hello, wörld! def f(x):\n    return x ** 2  # naïve ≤ 😀 ok\n\tend."


@pytest.fixture(scope="module")
def codec():
    from toolchain.openai.text import TextCodec

    return TextCodec(TOKENIZER)


class CountingCodec:
    """The codec with its whole-list decode counted."""

    def __init__(self, codec):
        self.codec, self.decodes = codec, 0

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.codec.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_decodes_each_token_once_and_concatenates_to_the_text(codec, skip_special_tokens):
    from toolchain.openai.text import Detokenizer

    ids = codec.encode(TEXT, add_special_tokens=False) + [codec.end_id]
    assert len(ids) > 30 and any(len(codec.decode([i])) == 0 or "\ufffd" in codec.decode([i]) for i in ids), \
        "the text should need byte-fallback tokens"
    counting = CountingCodec(codec)
    detok = Detokenizer(counting, skip_special_tokens)
    pieces = [detok.push([i]) for i in ids]
    assert counting.decodes == 0, f"{counting.decodes} decodes of the token list for {len(ids)} streamed tokens"
    pieces.append(detok.finish())
    assert "".join(pieces) == codec.decode(ids, skip_special_tokens)
    assert not any("\ufffd" in p for p in pieces), "a piece split a character"


def test_stream_of_several_tokens_at_once(codec):
    from toolchain.openai.text import Detokenizer

    ids = codec.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(codec)
    text = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.finish()
    assert text == codec.decode(ids)


def test_one_loop_wakeup_per_engine_step(hf_llama, tmp_path_factory):
    """Four requests decoding together: the loop is woken about once per step, not once per token."""
    from toolchain.openai.service import EngineService

    engine = load_engine(tmp_path_factory, hf_llama)
    service = EngineService(engine)
    n_tokens = 24
    prompts = [[1, 5, 9, 33], [1, 17, 101, 3, 44], [1, 249, 7], [7] * 6]

    async def run():
        loop = asyncio.get_running_loop()
        wakeups = 0
        threadsafe = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        steps_before = service.batcher.stats.steps
        params = SamplingParams(max_new_tokens=n_tokens, temperature=0.0, end_id=-1)
        gens = [service.submit(p, params) for p in prompts]

        async def read(gen):
            events = [tokens async for tokens, _ in gen.events()]
            return events

        events = await asyncio.gather(*(read(g) for g in gens))
        return events, wakeups, service.batcher.stats.steps - steps_before

    service.start()
    try:
        events, wakeups, steps = asyncio.run(run())
    finally:
        service.stop()
    expected = [engine.generate(p, SamplingParams(max_new_tokens=n_tokens, temperature=0.0, end_id=-1))
                for p in prompts]
    for got, want in zip(events, expected, strict=True):
        assert [t for tokens in got for t in tokens] == list(want)
    tokens = len(prompts) * n_tokens
    assert steps >= n_tokens
    assert wakeups <= steps + len(prompts), f"{wakeups} loop wake-ups for {steps} steps ({tokens} tokens)"


def test_the_engine_waits_for_the_loop_to_read_each_step(hf_llama, tmp_path_factory):
    """A reader slower than the engine's steps: the batcher lets the loop answer each step before it runs
    the next (the two share the GIL), so the engine never runs ahead of the stream."""
    import time

    from toolchain.openai.service import EngineService

    engine = load_engine(tmp_path_factory, hf_llama)
    service = EngineService(engine)
    n_tokens = 24

    async def run():
        gen = service.submit([1, 5, 9, 33], SamplingParams(max_new_tokens=n_tokens, temperature=0.0, end_id=-1))
        seen = []  # (steps the batcher had run, tokens read) at each read
        async for _tokens, _ in gen.events():
            seen.append((service.batcher.stats.steps, len(gen.output)))
            time.sleep(0.002)  # the loop busy for several of this engine's steps
        return seen

    service.start()
    try:
        seen = asyncio.run(run())
    finally:
        service.stop()
    assert seen[-1][1] == n_tokens
    # Each step read on its own (not several piled up while the reader was busy) ...
    assert len(seen) >= n_tokens - 3, f"{n_tokens} tokens came in {len(seen)} reads: {seen}"
    # ... and steps the engine had run beyond the tokens the reader had seen (one token a step), at its worst; a few
    # are allowed for a loop the host did not schedule within TURN_WAIT_S.
    ahead = max(steps - read for steps, read in seen)
    assert ahead <= 3, f"the engine ran {ahead} steps ahead of the reader: {seen}"


def test_response_ids_take_no_system_call(monkeypatch):
    """The id of each response is drawn without os.urandom, a system call that lets go of the GIL mid-request
    (for the engine thread to take); it keeps upstream's shape, cmpl-/chatcmpl- and 32 hex digits."""
    import os
    import re

    from toolchain.openai.protocol import Envelope

    calls = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: calls.append(n) or real(n))
    ids = {Envelope(chat, "m").id for chat in (False, True) * 50}
    assert calls == []
    assert len(ids) == 100 and all(re.fullmatch(r"(cmpl|chatcmpl)-[0-9a-f]{32}", i) for i in ids)
