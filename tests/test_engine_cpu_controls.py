"""Sampling controls with TensorRT-LLM semantics (penalties.py): repetition, presence and frequency penalties over
prompt + output, min_p, embedding_bias, bad_words and no_repeat_ngram_size, each changing the pick as specified on
hand-made logits, each validated in one line, and neutral values leaving greedy output exactly as it was."""

from __future__ import annotations

import pytest
import torch
from test_engine_cpu_util import PROMPTS, _one_thread, load_engine  # noqa: F401

from toolchain.engine.cpu import SamplingParams
from toolchain.engine.cpu.penalties import banned, process
from toolchain.engine.cpu.sampling import Sampler
from toolchain.errors import ToolchainError

PROMPT = PROMPTS[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama):
    return load_engine(tmp_path_factory, hf_llama, 1, 1)


def pick(logits: list[float], tokens: list[int] = (), generated: int = 0, **kw) -> int:
    return Sampler(SamplingParams(1, **kw)).pick(torch.tensor(logits), generated, list(tokens))


NEUTRAL = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, bad_words=[],
               no_repeat_ngram_size=0)


def test_neutral_values_change_nothing(engine):
    plain = engine.generate(PROMPT, SamplingParams(max_new_tokens=30))
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=30, embedding_bias=torch.zeros(engine.vocab_size),
                                                  **NEUTRAL)) == plain
    sampled = dict(max_new_tokens=20, top_k=40, top_p=0.9, temperature=1.3, seed=11)
    assert engine.generate(PROMPT, SamplingParams(**sampled, **NEUTRAL)) == \
        engine.generate(PROMPT, SamplingParams(**sampled))
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(process(logits, SamplingParams(1, **NEUTRAL), [1, 2, 3, 2], 0), logits)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    assert pick([2.0, 1.9, -5.0], tokens=[0]) == 0
    assert pick([2.0, 1.9, -5.0], tokens=[0], repetition_penalty=2.0) == 1  # 2.0 / 2 = 1.0 < 1.9
    assert pick([-1.0, -1.1, -5.0], tokens=[0], repetition_penalty=2.0) == 1  # -1.0 * 2 = -2.0 < -1.1
    assert pick([2.0, 1.9, -5.0], tokens=[0], repetition_penalty=0.5) == 0  # < 1 rewards repeats
    assert pick([1.0, 1.9, -5.0], tokens=[0], repetition_penalty=0.5) == 0  # 1.0 / 0.5 = 2.0 > 1.9


def test_presence_penalty_counts_a_token_once_frequency_per_occurrence():
    logits = [1.0, 0.8, -5.0]
    assert pick(logits, tokens=[0, 0, 0], presence_penalty=0.1) == 0  # 0.9 > 0.8, however often it appeared
    assert pick(logits, tokens=[0], presence_penalty=0.3) == 1
    assert pick(logits, tokens=[0], frequency_penalty=0.1) == 0  # 1.0 - 0.1 = 0.9
    assert pick(logits, tokens=[0, 0, 0], frequency_penalty=0.1) == 1  # 1.0 - 0.3 = 0.7
    assert pick(logits, tokens=[0, 0, 0], frequency_penalty=-0.1) == 0
    # the prompt counts as much as the output (the C++ runtime's penalties read the whole sequence)
    assert pick(logits, tokens=[0, 2, 2], generated=0, presence_penalty=0.3) == 1


def test_embedding_bias_is_added_first():
    bias = torch.zeros(4)
    bias[3] = 10.0
    assert pick([1.0, 2.0, 0.0, -3.0]) == 1
    assert pick([1.0, 2.0, 0.0, -3.0], embedding_bias=bias) == 3
    bias[1] = -100.0
    assert pick([1.0, 2.0, 0.0, -3.0], embedding_bias=-bias.abs()) == 0


def test_bad_words_mask_the_last_token_after_the_rest_of_the_word():
    logits = [3.0, 2.0, 1.0, 0.0]
    assert pick(logits, bad_words=[[0]]) == 1
    assert pick(logits, tokens=[2, 3], bad_words=[[3, 0]]) == 1  # the sequence ends with the word's prefix
    assert pick(logits, tokens=[3, 2], bad_words=[[3, 0]]) == 0  # it does not
    assert pick(logits, tokens=[2, 3], bad_words=[[2, 3, 0]]) == 1
    assert banned(SamplingParams(1, bad_words=[[0], [1]]), []) == {0, 1}


def test_no_repeat_ngram_size_masks_a_repeated_ngram():
    logits = [0.0, 3.0, 2.0, 1.0]
    assert pick(logits, tokens=[0, 1, 0]) == 1
    assert pick(logits, tokens=[0, 1, 0], no_repeat_ngram_size=2) == 2  # "0 1" already occurred
    assert pick(logits, tokens=[0, 1, 0], no_repeat_ngram_size=3) == 1  # "1 0 1" did not
    assert pick([0.0, 1.0, 3.0, 2.0], tokens=[0, 1, 2, 0, 1], no_repeat_ngram_size=3) == 3  # "0 1 2" did
    assert pick(logits, tokens=[1, 2], no_repeat_ngram_size=1) == 3


def test_min_p_drops_tokens_below_a_fraction_of_the_likeliest():
    logits = [3.0, 2.9, 1.0, 0.5]  # probabilities ~ 0.47, 0.43, 0.06, 0.04
    seen = {pick(logits, temperature=1.0, top_p=1.0, seed=s) for s in range(200)}
    assert seen == {0, 1, 2, 3}
    seen = {pick(logits, temperature=1.0, top_p=1.0, min_p=0.5, seed=s) for s in range(200)}
    assert seen == {0, 1}
    # min_p is relative to the distribution after temperature: at temperature 3 token 2 stays above 0.5 x max
    seen = {pick(logits, temperature=3.0, top_p=1.0, min_p=0.5, seed=s) for s in range(300)}
    assert seen == {0, 1, 2}


def test_min_tokens_and_bad_words_together():
    assert pick([5.0, 1.0, 0.0], generated=0, end_id=0, min_tokens=1, bad_words=[[1]]) == 2


def test_the_engine_honours_the_controls(engine):
    plain = engine.generate(PROMPT, SamplingParams(max_new_tokens=24))
    banned_first = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, bad_words=[[plain[0]]]))
    assert banned_first[0] != plain[0] and plain[0] not in banned_first
    no_repeat = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, no_repeat_ngram_size=2))
    seq = PROMPT + no_repeat
    pairs = [tuple(seq[i:i + 2]) for i in range(len(seq) - 1)]
    assert len(pairs) == len(set(pairs))
    bias = torch.zeros(engine.vocab_size)
    bias[77] = 1000.0
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=4, embedding_bias=bias)) == [77] * 4
    penalised = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, repetition_penalty=1e6))
    assert not set(penalised) & set(PROMPT) and len(set(penalised)) == len(penalised)


@pytest.mark.parametrize("kw, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be > 0"),
    (dict(presence_penalty=float("inf")), "presence_penalty must be a finite number"),
    (dict(frequency_penalty="1"), "frequency_penalty must be a finite number"),
    (dict(min_p=1.5), r"min_p must be within \[0, 1\]"),
    (dict(embedding_bias=torch.zeros(7)), r"embedding_bias must be a float tensor of \[250\]"),
    (dict(embedding_bias=torch.full((250,), float("nan"))), "embedding_bias must hold floats"),
    (dict(bad_words=[[]]), "each bad word must be a non-empty list of token ids below 250"),
    (dict(bad_words=[[250]]), "each bad word must be a non-empty list of token ids below 250"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be a non-negative integer"),
    (dict(logprobs=-1), "logprobs must be a non-negative integer or None"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs must be a non-negative integer or None"),
])
def test_bad_controls_are_refused_in_one_line(engine, kw, message):
    with pytest.raises(ToolchainError, match=message) as err:
        engine.start(PROMPT, SamplingParams(4, **kw))
    assert "\n" not in str(err.value)
