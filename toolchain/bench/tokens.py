"""Per-response output token counts for text-only streams.

The ensemble streams per-chunk text, so counts are a client re-tokenisation
(an estimate; the report says so via token_count_source). Each chunk is
encoded behind a fixed prefix and the prefix's own tokens are subtracted:
encoding a chunk alone would let SentencePiece add a word-start marker to it
and over-count (the genai-perf technique). A non-empty chunk is at least one
token, since the server only sends text for generated tokens; an empty chunk
is none (e.g. Triton's empty first response).
"""

from __future__ import annotations

from toolchain.bench.records import RequestRecord

_PREFIX = "!"


class TokenCounter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._prefix_len = self._len(_PREFIX)

    def _len(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count(self, text: str) -> int:
        if not text:
            return 0
        return max(1, self._len(_PREFIX + text) - self._prefix_len)

    def fill(self, records: list[RequestRecord]) -> None:
        """Set n_tok for every text response and drop the stored text."""
        for rec in records:
            for resp in rec.responses:
                if resp.text is not None:
                    resp.n_tok = self.count(resp.text)
                    resp.text = None


def token_count_source(records: list[RequestRecord]) -> str:
    sources = {r.token_source for r in records if r.responses}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
