"""Synthetic prompts of exact token length and per-chunk token counting (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchain.bench.records import RequestRecord, Response
from toolchain.bench.tokens import TokenCounter, token_count_source
from toolchain.bench.workload import PromptFactory, build_prompts, corpus_text, count_tokens, load_tokenizer
from toolchain.errors import ToolchainError

# Words the live test's mock model streams; each is one token of the test tokenizer.
MOCK_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def make_word_tokenizer(out: Path) -> Path:
    """A WordLevel tokenizer over the prompt corpus plus MOCK_WORDS, saved as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=8000, special_tokens=["[UNK]", "[PAD]", "</s>"])
    tok.train_from_iterator([corpus_text(), " ".join(MOCK_WORDS) + " !"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    return load_tokenizer(make_word_tokenizer(tmp_path_factory.mktemp("tok")))


def test_prompts_have_exact_token_lengths(word_tokenizer):
    prompts = build_prompts(word_tokenizer, count=6, mean=40, stddev=0, seed=3, max_len=100)
    assert [p.isl for p in prompts] == [40] * 6
    assert all(count_tokens(word_tokenizer, p.text) == 40 for p in prompts)
    assert len({p.text for p in prompts}) == 6  # distinct windows: no prefix-cache flattery


def test_prompt_lengths_vary_with_stddev_and_are_seeded(word_tokenizer):
    a = build_prompts(word_tokenizer, count=20, mean=30, stddev=8, seed=1, max_len=40)
    b = build_prompts(word_tokenizer, count=20, mean=30, stddev=8, seed=1, max_len=40)
    assert [p.text for p in a] == [p.text for p in b]
    lengths = [p.isl for p in a]
    assert len(set(lengths)) > 3 and max(lengths) <= 40 and min(lengths) >= 1
    assert all(count_tokens(word_tokenizer, p.text) == p.isl for p in a)


def test_exact_length_with_a_bpe_tokenizer(tmp_path):
    # Byte-level BPE does not round-trip every window length: the factory must still land exactly.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus_text(100_000)], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    bpe = load_tokenizer(tmp_path)
    factory = PromptFactory(bpe, seed=0, corpus=corpus_text(100_000))
    prompts = [factory.make(n) for n in (1, 7, 64, 200)]
    assert [count_tokens(bpe, p.text) for p in prompts] == [1, 7, 64, 200]


def test_token_counter_counts_chunks(word_tokenizer):
    counter = TokenCounter(word_tokenizer)
    assert counter.count("") == 0
    assert counter.count(" alpha") == 1
    assert counter.count("alpha bravo") == 2
    assert counter.count(" ") == 1  # text came from a generated token
    r = RequestRecord(0, "m0", responses=[Response(1, 0, ""), Response(2, 0, " alpha"), Response(3, 0, " bravo golf")])
    counter.fill([r])
    assert [x.n_tok for x in r.responses] == [0, 1, 2] and r.osl == 3
    assert all(x.text is None for x in r.responses)
    assert token_count_source([r]) == "tokenizer"


def test_missing_tokenizer_dir_is_a_user_error(tmp_path):
    with pytest.raises(ToolchainError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ToolchainError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)
