"""The evaluation text, as token windows.

Default: the held-out split of the tiny model's corpus (every 20th standard
library file, never trained on; toolchain.tinymodel.corpus), so the shipped
model is judged on text it has not seen and the set needs no download. Any
model can be evaluated on it (it is plain Python source), or on `--text FILE`.
"""

from __future__ import annotations

from pathlib import Path
from toolchain.errors import ToolchainError
from toolchain.tinymodel.corpus import load_corpus, read_text


def default_documents() -> tuple[str, list[str]]:
    """(description, texts) of the held-out split, in its fixed sorted order."""

    corpus = load_corpus()
    return (f"held-out split of the tiny-model corpus ({len(corpus.heldout)} files, every 20th "
            f"standard-library source under {corpus.root})", [read_text(p) for p in corpus.heldout])


def file_documents(path: Path) -> tuple[str, list[str]]:
    path = Path(path)
    if not path.is_file():
        raise ToolchainError(f"text file not found: {path}", "pass --text with an existing UTF-8 text file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ToolchainError(f"text file {path} is empty", "pass a file with a few thousand tokens of text")
    return f"text file {path}", [text]


# Tokenize at most this many times the evaluated tokens: windows are spread
# over the text, and a huge --text file must not cost minutes of tokenizing.
STREAM_FACTOR = 64


def token_stream(tokenizer, documents: list[str], limit: int) -> list[int]:
    """Documents encoded one after another, each as the tokenizer frames a
    prompt (BOS when it adds one) followed by EOS when it has one, the way
    documents are packed for training; at most `limit` tokens."""
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for text in documents:
        ids = list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
        stream.extend(ids)
        if len(stream) >= limit:
            break
    return stream[:limit]


def token_windows(stream: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens, about `max_tokens` in all,
    spread evenly over the stream (the tiny model's own held-out measure
    does the same), so the figure speaks for the whole text rather than its
    first file. A stream shorter than that is used whole."""
    if window < 2:
        raise ToolchainError(f"window {window} is too short", "use --window 2 or more")
    if len(stream) < 2:
        raise ToolchainError(f"the evaluation text is {len(stream)} token(s) long", "use a longer text")
    count = max(1, max_tokens // window)
    if len(stream) <= count * window:
        chunks = [stream[s:s + window] for s in range(0, len(stream), window)]
        return [c for c in chunks if len(c) >= 2]
    # Evenly spaced starts from the first to the last full window; the spacing
    # exceeds `window` because the stream is longer than count * window.
    last = len(stream) - window
    starts = [i * last // (count - 1) for i in range(count)] if count > 1 else [0]
    return [stream[s:s + window] for s in starts]
