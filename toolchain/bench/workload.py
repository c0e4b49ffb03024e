"""Synthetic prompts of exact token lengths, made without any download.

The text is the Python standard library's own documentation
(`pydoc_data/topics.py`, the language reference as prose), which every Python
install carries; plain stdlib sources are the fallback. The corpus is tokenised
once with the deployment's tokenizer, a window of N tokens is cut at a seeded
random offset and decoded, and the window is adjusted until the decoded text
re-encodes to exactly N tokens (decode/encode round trips are not always
length-preserving). Each request gets its own offset so prompts differ and a
prefix cache cannot flatter the numbers. The stdlib differs between Python
versions, so prompts are reproducible per machine, not across machines.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.remote_code import auto_tokenizer

CORPUS_FILES = ("pydoc_data/topics.py", "argparse.py", "textwrap.py", "difflib.py", "typing.py")
PROMPT_CORPUS = "python stdlib pydoc_data/topics.py (language reference prose)"
CORPUS_MAX_CHARS = 400_000  # ~100k tokens: plenty of distinct windows, tokenised in well under a second
_MAX_TRIES = 16


@dataclass(frozen=True)
class Prompt:
    text: str
    isl: int
    """Token count of `text` with the deployment tokenizer (no special tokens)."""


def load_tokenizer(tokenizer_dir: Path, trust_remote_code: bool = False):
    """The deployment's tokenizer, from a local directory only."""

    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise ToolchainError(f"tokenizer directory not found: {tokenizer_dir}",
                             "set model.tokenizer (or model.checkpoint) to a directory holding tokenizer files")
    try:
        tokenizer = auto_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    except ToolchainError:
        raise
    except Exception as err:  # transformers raises many types for a bad directory
        raise ToolchainError(f"cannot load a tokenizer from {tokenizer_dir}: {err}",
                             "point model.tokenizer at a directory with tokenizer.json or tokenizer_config.json") from None
    # The corpus is tokenized in one piece to cut prompts from it; that is not a
    # model input, so the "longer than model_max_length" warning would only mislead.
    tokenizer.model_max_length = int(1e12)
    return tokenizer


def corpus_text(max_chars: int = CORPUS_MAX_CHARS) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for rel in CORPUS_FILES:
        path = stdlib / rel
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(text)
            size += len(text)
            if size >= max_chars:
                break
    if not parts:  # unusual layout: any stdlib module will do
        for path in sorted(stdlib.glob("*.py")):
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
            size += len(parts[-1])
            if size >= max_chars:
                break
    return "\n".join(parts)[:max_chars]


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def sample_lengths(mean: int, stddev: float, count: int, rng: random.Random, max_len: int) -> list[int]:
    """Normal lengths (rounded, at least 1, at most max_len); exactly `mean` when stddev is 0."""
    if stddev <= 0:
        return [min(mean, max_len)] * count
    return [min(max_len, max(1, round(rng.gauss(mean, stddev)))) for _ in range(count)]


class PromptFactory:
    def __init__(self, tokenizer, seed: int = 0, corpus: str | None = None):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = tokenizer(corpus if corpus is not None else corpus_text(), add_special_tokens=False)["input_ids"]
        # Special tokens inside a prompt would decode to markers the server treats specially.
        self.ids = [i for i in ids if i not in special]
        if len(self.ids) < 16:
            raise ToolchainError("the tokenizer turns the prompt corpus into almost no tokens",
                                 "check that model.tokenizer is a text tokenizer")

    def make(self, n_tokens: int) -> Prompt:
        """A prompt of exactly n_tokens tokens (closest found after a few windows, rarely off)."""
        best: Prompt | None = None
        for _ in range(_MAX_TRIES):
            offset = self.rng.randrange(len(self.ids))
            length = n_tokens
            for _ in range(4):
                window = [self.ids[(offset + k) % len(self.ids)] for k in range(max(1, length))]
                text = self.tokenizer.decode(window, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                got = count_tokens(self.tokenizer, text)
                if got == n_tokens:
                    return Prompt(text, got)
                if best is None or abs(got - n_tokens) < abs(best.isl - n_tokens):
                    best = Prompt(text, got)
                length += n_tokens - got
        assert best is not None  # the loop ran at least once
        return best


def build_prompts(tokenizer, *, count: int, mean: int, stddev: float, seed: int, max_len: int) -> list[Prompt]:
    rng = random.Random(seed)
    lengths = sample_lengths(mean, stddev, count, rng, max_len)
    factory = PromptFactory(tokenizer, seed=rng.randrange(1 << 30))
    return [factory.make(n) for n in lengths]


def sample_output_lengths(mean: int, stddev: float, count: int, rng: random.Random, max_len: int) -> list[int]:
    """Requested output lengths: normal around `mean`, at least 1, at most max_len."""
    return sample_lengths(mean, stddev, count, rng, max_len)
