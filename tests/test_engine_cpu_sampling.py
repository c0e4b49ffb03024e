"""Sampling with TensorRT-LLM semantics: greedy rules, seeded sampling, top-k /
top-p, end_id, stop words, min_tokens and request validation."""

from __future__ import annotations

import pytest
import torch
from test_engine_cpu_util import PROMPTS, _one_thread, load_engine  # noqa: F401

from toolchain.engine.cpu import SamplingParams
from toolchain.engine.cpu.sampling import Sampler
from toolchain.errors import ToolchainError

PROMPT = PROMPTS[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama):
    return load_engine(tmp_path_factory, hf_llama, 1, 1)


@pytest.fixture(scope="module")
def greedy(engine):
    return engine.generate(PROMPT, SamplingParams(max_new_tokens=40))


def sample(engine, **kw):
    kw.setdefault("max_new_tokens", 24)
    return engine.generate(PROMPT, SamplingParams(**kw))


def test_greedy_rules():
    assert SamplingParams(1).greedy
    assert SamplingParams(1, top_k=1).greedy
    assert SamplingParams(1, top_k=40, temperature=0.0).greedy
    assert not SamplingParams(1, top_k=2).greedy
    assert not SamplingParams(1, top_p=0.9).greedy
    assert not SamplingParams(1, top_k=1, top_p=0.5).greedy  # sampled path, but top-1 leaves one choice


def test_seeded_sampling_is_reproducible(engine, greedy):
    a = sample(engine, top_k=50, temperature=1.5, seed=7)
    assert a == sample(engine, top_k=50, temperature=1.5, seed=7)
    others = [sample(engine, top_k=50, temperature=1.5, seed=s) for s in (8, 9)]
    assert all(o != a for o in others)
    assert a != greedy[:24]


def test_seed_none_is_seed_zero(engine):
    # TRT-LLM's default random seed is 0: unseeded requests are reproducible too.
    assert sample(engine, top_p=0.95, temperature=2.0) == sample(engine, top_p=0.95, temperature=2.0, seed=0)


def test_unseeded_stream_gives_unseeded_requests_seeds_of_their_own(engine):
    # The PyTorch backend's shared generator (seeded 42 per server): successive unseeded requests differ,
    # a fresh stream repeats the sequence, and a request's own seed passes through.
    from toolchain.engine.cpu.sampling import UnseededStream

    stream, again = UnseededStream(), UnseededStream()
    seeds = [stream.seed(None) for _ in range(3)]
    assert len(set(seeds)) == 3 and seeds == [again.seed(None) for _ in range(3)]
    assert stream.seed(7) == 7
    texts = {tuple(sample(engine, top_p=0.95, temperature=2.0, seed=stream.seed(None))) for _ in range(3)}
    assert len(texts) > 1


def test_top_k_one_equals_greedy(engine, greedy):
    assert sample(engine, top_k=1, top_p=0.5, temperature=3.0, seed=3) == greedy[:24]
    assert sample(engine, top_k=1) == greedy[:24]
    assert sample(engine, top_k=40, temperature=0.0, seed=5) == greedy[:24]


def test_top_k_and_top_p_filter():
    logits = torch.tensor([4.0, 3.5, 3.0, 0.0, -1.0, -2.0])
    seen_k = {Sampler(SamplingParams(1, top_k=2, temperature=5.0, seed=s)).pick(logits, 0) for s in range(60)}
    assert seen_k == {0, 1}
    # softmax(logits) ~ [0.50, 0.30, 0.18, ...]: top_p 0.7 keeps the first two, 0.85 the first three.
    seen_p = {Sampler(SamplingParams(1, top_p=0.7, seed=s)).pick(logits, 0) for s in range(60)}
    assert seen_p == {0, 1}
    seen_p = {Sampler(SamplingParams(1, top_p=0.85, seed=s)).pick(logits, 0) for s in range(80)}
    assert seen_p == {0, 1, 2}
    seen_all = {Sampler(SamplingParams(1, top_p=1.0, temperature=50.0, seed=s)).pick(logits, 0) for s in range(80)}
    assert len(seen_all) == 6


def test_end_id_stops_and_is_not_emitted(engine, greedy):
    end = greedy[5]
    first = greedy.index(end)
    assert sample(engine, max_new_tokens=40, end_id=end) == greedy[:first]


def test_min_tokens_suppresses_end_id(engine, greedy):
    end = greedy[0]
    assert sample(engine, max_new_tokens=40, end_id=end) == []
    out = sample(engine, max_new_tokens=40, end_id=end, min_tokens=3)
    assert len(out) >= 3 and end not in out[:3]


def first_match(seq, word):
    return next(i + len(word) for i in range(len(seq) - len(word) + 1) if seq[i:i + len(word)] == word)


def test_stop_words_are_kept_in_output(engine, greedy):
    word = greedy[6:8]
    stop_at = first_match(greedy, word)
    assert sample(engine, max_new_tokens=40, stop_words=[word]) == greedy[:stop_at]
    # Several words: whichever completes first wins; a word never produced does nothing.
    other = greedy[3:4]
    absent = [next(t for t in range(250) if t not in greedy)] * 2
    out = sample(engine, max_new_tokens=40, stop_words=[absent, word, other])
    assert out == greedy[:min(stop_at, first_match(greedy, other))]


def test_max_new_tokens(engine, greedy):
    assert sample(engine, max_new_tokens=1) == greedy[:1]
    assert len(sample(engine, max_new_tokens=7, top_p=0.9, seed=1)) == 7


@pytest.mark.parametrize("prompt,kw,message", [
    ([], {}, "empty prompt"),
    ([1, 250], {}, "outside the vocabulary"),
    ([1, -1], {}, "outside the vocabulary"),
    (list(range(1, 66)), {}, "max_input_len 64"),
    (list(range(1, 60)), {"max_new_tokens": 102}, "max_seq_len 160; ask for at most 101"),
    ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
    ([1, 2], {"top_p": 1.5}, "top_p"),
    ([1, 2], {"top_k": -1}, "top_k"),
    ([1, 2], {"temperature": -0.1}, "temperature"),
    ([1, 2], {"end_id": 250}, "end_id"),
    ([1, 2], {"stop_words": [[]]}, "stop word"),
    ([1, 2], {"min_tokens": -2}, "min_tokens"),
])
def test_request_validation(engine, prompt, kw, message):
    kw.setdefault("max_new_tokens", 4)
    with pytest.raises(ToolchainError, match=message):
        engine.generate(prompt, SamplingParams(**kw))


def test_longest_request_that_fits(engine):
    prompt = list(range(1, 60))
    assert len(engine.generate(prompt, SamplingParams(max_new_tokens=101))) == 101


def test_integer_arrays_are_accepted(engine, greedy):
    import numpy as np

    assert engine.generate(np.array(PROMPT, dtype=np.int32), SamplingParams(max_new_tokens=5)) == greedy[:5]
    assert engine.generate(tuple(PROMPT), SamplingParams(max_new_tokens=5)) == greedy[:5]
    with pytest.raises(ToolchainError, match="list of token ids"):
        engine.generate("hello", SamplingParams(max_new_tokens=5))
    with pytest.raises(ToolchainError, match="outside the vocabulary"):
        engine.generate([1, 2.0], SamplingParams(max_new_tokens=5))


def test_numpy_parameters_are_accepted(engine, greedy):
    import numpy as np

    params = SamplingParams(max_new_tokens=np.int32(40), end_id=np.int64(greedy[4]), seed=np.uint64(2**63 + 5),
                            stop_words=[list(np.array(greedy[2:4]))], top_k=np.int32(1))
    assert params.problem(engine.vocab_size) is None
    end_at, stop_at = greedy.index(greedy[4]), first_match(greedy, greedy[2:4])
    want = greedy[:end_at] if end_at < stop_at else greedy[:stop_at]
    assert engine.generate(PROMPT, params) == want
