"""Reasoning text split out of a chat answer into `reasoning_content`, as trtllm-serve's
`--reasoning_parser` does (NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/reasoning_parser.py,
`DeepSeekR1Parser`, registered as "deepseek-r1" with reasoning_at_start=True and as "qwen3").

- deepseek-r1: DeepSeek-R1's chat template already ends the prompt with `<think>\\n`, so the answer
  starts inside the reasoning: everything before `</think>` is reasoning, everything after it content.
- qwen3: reasoning only when the answer itself opens `<think>`; text before it is dropped, text
  between `<think>` and `</think>` is reasoning, the rest content. Without `<think>` all is content.

`parse` splits a whole answer; `parse_delta` / `finish` split a stream piece by piece with upstream's
own rules, hold-back included: a piece that could still grow into `<think>` / `</think>` waits for
the next one, and `finish` releases what is left (a complete tag alone is dropped, as it would have
been). Upstream's streaming rules are not the whole-text rules in every case (a qwen3 stream sends
text before `<think>` as content when it arrived in an earlier piece), and neither is changed here.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
# trtllm-serve --reasoning_parser NAME -> reasoning_at_start (ReasoningParserFactory registrations).
REASONING_PARSERS: dict[str, bool] = {"deepseek-r1": True, "qwen3": False}


def reasoning_parser_problem(name: str | None) -> str | None:
    """Why `name` is no reasoning parser this server has, as one line (None: it is one, or none is asked)."""
    if name is None or name in REASONING_PARSERS:
        return None
    return f"reasoning parser {name!r} does not exist; trtllm-serve's --reasoning_parser takes {', '.join(REASONING_PARSERS)}"


@dataclass
class Split:
    content: str = ""
    reasoning: str = ""

    def __add__(self, other: "Split") -> "Split":
        return Split(self.content + other.content, self.reasoning + other.reasoning)


class ThinkParser:
    """One answer's reasoning split (one instance per choice: `parse_delta` keeps state)."""

    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(reasoning_parser_problem(name))
        self.reasoning_at_start = REASONING_PARSERS[name]
        self.in_reasoning = self.reasoning_at_start
        self._buffer = ""

    def parse(self, text: str) -> Split:
        if not self.reasoning_at_start:
            before, tag, after = text.partition(THINK_START)
            if not tag:
                return Split(content=text)
            text = after  # what came before <think> is dropped
        reasoning, _, content = text.partition(THINK_END)
        return Split(content=content, reasoning=reasoning)

    def parse_delta(self, delta: str) -> Split:
        self._buffer += delta
        text = self._buffer
        if THINK_START.startswith(text) or THINK_END.startswith(text):
            return Split()  # may still become a tag: wait for more
        reasoning = None
        if not self.in_reasoning:
            begin = text.find(THINK_START)
            if begin == -1:
                self._buffer = ""
                return Split(content=text)
            self.in_reasoning = True
            reasoning = text[begin + len(THINK_START):]
        text = reasoning if reasoning is not None else text
        end = text.find(THINK_END)
        if end == -1:
            last = text.rfind(THINK_END[0])
            if last != -1 and THINK_END.startswith(text[last:]):
                self._buffer = text[last:]  # a `</thi` that may complete next time
                return Split(reasoning=text[:last])
            self._buffer = ""
            return Split(reasoning=text)
        self.in_reasoning = False
        self._buffer = ""
        return Split(content=text[end + len(THINK_END):], reasoning=text[:end])

    def finish(self) -> Split:
        remaining, self._buffer = self._buffer, ""
        if not remaining or remaining in (THINK_START, THINK_END):
            return Split()
        return Split(reasoning=remaining) if self.in_reasoning else Split(content=remaining)
