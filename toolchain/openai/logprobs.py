"""Log-probabilities in trtllm-serve's response shapes (tensorrt_llm/serve/openai_protocol.py and
postprocess_handlers.py), from the engine's `TokenLogprobs` record (engine/cpu/logprobs.py, "raw" mode:
the log-softmax of the model's own float32 logits, what HF's log_softmax gives on the same tokens).

Completions (`logprobs: k`):
    {"text_offset": [int], "token_logprobs": [float | None], "tokens": [str], "top_logprobs": [{str: float} | None]}
  `top_logprobs` holds the k most likely tokens of each position plus the chosen one (the LLM API returns the
  sampled token's log-prob beside its top-k, as vLLM does; UNVERIFIED for trtllm-serve's exact dict).
  With `echo`, the prompt's tokens come first; its first token has no context, so None and None.
  `text_offset` is where each token's text starts in the choice's `text`, from the decoded text.
Chat (`logprobs: true`, `top_logprobs: k`):
    {"content": [{"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"token", "logprob", "bytes"}]}]}
Each token's string is its own decode (special tokens kept). Log-probs are floored at -9999.0 as upstream
floors them (a masked token's -inf is no JSON number).
"""

from __future__ import annotations

from toolchain.openai.text import Detokenizer

LOGPROB_FLOOR = -9999.0


def _value(v: float | None) -> float | None:
    return None if v is None else max(float(v), LOGPROB_FLOOR)


class TokenText:
    """Each token id's own text, decoded once."""

    def __init__(self, codec):
        self.codec, self._cache = codec, {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.codec.decode([int(token)], skip_special_tokens=False)
        return text


def _top_dict(text: TokenText, top, chosen: tuple[int, float] | None, k: int) -> dict[str, float]:
    out = {text(t): _value(v) for t, v in list(top)[:k]}
    if chosen is not None:
        out.setdefault(text(chosen[0]), _value(chosen[1]))
    return out  # type: ignore[return-value]


def _chat_entry(text: TokenText, token: int, value: float, top, k: int) -> dict:
    s = text(token)
    return {"token": s, "logprob": _value(value), "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": text(t), "logprob": _value(v), "bytes": list(text(t).encode("utf-8"))}
                             for t, v in list(top)[:k]]}


def empty(chat: bool) -> dict:
    if chat:
        return {"content": []}
    return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}


def extend(into: dict, more: dict | None) -> dict:
    """`more`'s entries appended to `into` (both of one shape)."""
    for key, values in (more or {}).items():
        into[key].extend(values)
    return into


class LogprobShaper:
    """One choice's log-probabilities, token by token. `add` notes each generated token with the offset
    its text starts at in the generated text; `release(upto)` hands out the noted tokens whose text starts
    before `upto` characters (all of them with None), so a stream's chunk carries the log-probs of the
    tokens whose text it carries, and tokens cut off by a stop string are never sent."""

    def __init__(self, codec, record, chat: bool, k: int, text_start: int = 0):
        self.text = TokenText(codec)
        self.record, self.chat, self.k, self.text_start = record, chat, k, text_start
        self.held: list[tuple[int, int, int]] = []  # (output index, token id, offset in the generated text)
        self.count = 0

    def add(self, token: int, offset: int) -> None:
        self.held.append((self.count, int(token), offset))
        self.count += 1

    def release(self, upto: int | None) -> dict | None:
        n = len(self.held) if upto is None else sum(1 for h in self.held if h[2] < upto)
        take, self.held = self.held[:n], self.held[n:]
        if not take:
            return None
        rec = self.record
        if self.chat:
            return {"content": [_chat_entry(self.text, t, rec.tokens[i], rec.top[i], self.k) for i, t, _ in take]}
        return {"text_offset": [self.text_start + off for _, _, off in take],
                "token_logprobs": [_value(rec.tokens[i]) for i, _, _ in take],
                "tokens": [self.text(t) for _, t, _ in take],
                "top_logprobs": [_top_dict(self.text, rec.top[i], (t, rec.tokens[i]), self.k) for i, t, _ in take]}


def prompt_logprobs(codec, ids: list[int], record, k: int, skip_special_tokens: bool = True) -> dict:
    """Completions' echoed prompt: each prompt token with its log-prob given the tokens before it (the
    first has none), offsets from the prompt's decoded text."""
    text = TokenText(codec)
    detok = Detokenizer(codec, skip_special_tokens)
    offsets = []
    for t in ids:
        offsets.append(len(detok.text))
        detok.push([t])
    values = list(record.prompt)
    tops = list(record.prompt_top)
    shift = len(ids) - len(tops)  # the record may or may not hold an (empty) entry for position 0
    top_dicts: list[dict | None] = [None]
    for j in range(1, len(ids)):
        top = tops[j - shift] if 0 <= j - shift < len(tops) else []
        top_dicts.append(_top_dict(text, top, (ids[j], values[j]), k))
    return {"text_offset": offsets, "token_logprobs": [None] + [_value(v) for v in values[1:len(ids)]],
            "tokens": [text(t) for t in ids], "top_logprobs": top_dicts}
