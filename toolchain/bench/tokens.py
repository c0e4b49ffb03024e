"""Per-response output token counts, filled in after the run.

Text-only streams are counted by client re-tokenisation (an estimate; the
report says so via token_count_source). Each chunk is encoded behind a fixed
prefix and the prefix's own tokens are subtracted: encoding a chunk alone
would let SentencePiece add a word-start marker to it and over-count (the
genai-perf technique). A non-empty chunk is at least one token, since the
server only sends text for generated tokens; an empty chunk is none (e.g.
Triton's empty first response).

Where the server counted (output ids, num_output_tokens, OpenAI usage), its
figure stands and the tokenizer's estimate is kept next to it (client_osl) so
a mismatch is visible. Counting happens after the run so it cannot delay the
next arrival stamp.
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
        """Set n_tok for every text response (unless the server counted), the client estimate, and drop the text."""
        for rec in records:
            texts = [r.text for r in rec.responses if r.text is not None]
            if not texts and rec.token_source == "server":
                continue
            estimate = 0
            for resp in rec.responses:
                if resp.text is not None:
                    n = self.count(resp.text)
                    estimate += n
                    if rec.token_source != "server":
                        resp.n_tok = n
                    resp.text = None
            if texts:
                rec.client_osl = estimate


def token_count_source(records: list[RequestRecord]) -> str:
    sources = {r.token_source for r in records if r.responses}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
