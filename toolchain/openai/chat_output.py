"""What one chat answer becomes in the response: its reasoning split off first, then its tool calls parsed
out of the rest, whole (`message`) or piece by piece (`delta`), in the order and shapes of trtllm-serve's
chat post-processing (NVIDIA/TensorRT-LLM tensorrt_llm/serve/postprocess_handlers.py,
chat_response_post_processor / chat_stream_post_processor, apply_reasoning_parser, apply_tool_parser).

- A named tool_choice is not parsed: the whole answer (after reasoning) is the named function's arguments
  and content is "" (upstream's named branch). trtllm-serve 1.2 adds no grammar for a named tool
  (UNVERIFIED), so nothing constrains that answer to be JSON here either; a client that needs valid JSON
  sends response_format as well.
- tool_choice "none" with tools: the parser still runs, so its markup stays out of content, but no call is
  returned (upstream's apply_tool_parser; UNVERIFIED that 1.2 already does this, later upstream does).
- finish_reason becomes "tool_calls" only when calls were parsed and the engine stopped by itself ("stop");
  an answer cut at max_tokens stays "length".
- content is None when calls were parsed and no text precedes them (the OpenAI API's shape).
"""

from __future__ import annotations

from typing import Any

from toolchain.openai.reasoning import Split, ThinkParser
from toolchain.openai.tools import FORMATS, Call, ToolCallStream, tool_names


def effective_tool_choice(req) -> Any:
    """openai_protocol.py check_tool_choice: "auto" when tools come without a tool_choice, else "none"."""
    if "tool_choice" in req.model_fields_set and req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


class ChatAnswer:
    """One chat request's answer post-processing (one choice)."""

    def __init__(self, req, tool_parser: str | None, reasoning_parser: str | None):
        self.think = ThinkParser(reasoning_parser) if reasoning_parser else None
        choice = effective_tool_choice(req)
        self.named = choice["function"]["name"] if isinstance(choice, dict) else None
        self.hide_calls = choice == "none"
        fmt = FORMATS[tool_parser]() if tool_parser and req.tools and self.named is None else None
        self.fmt = fmt
        self.names = tool_names(req.tools)
        self.stream = ToolCallStream(fmt, self.names) if fmt is not None else None
        self.named_id: str | None = None
        self.called = False
        self.streamed_calls = 0

    @classmethod
    def wanted(cls, req, tool_parser: str | None, reasoning_parser: str | None) -> "ChatAnswer | None":
        """The post-processing `req` needs, or None where its answer is plain content."""
        if reasoning_parser is None and not (req.tools and (tool_parser or effective_tool_choice(req) != "none")):
            return None
        return cls(req, tool_parser, reasoning_parser)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.called and engine_reason == "stop" else engine_reason

    def _calls(self, calls: list[Call]) -> list[Call]:
        calls = [] if self.hide_calls else calls
        self.called = self.called or bool(calls)
        return calls

    def message(self, text: str) -> dict:
        """The non-streamed message for the whole answer `text`."""
        split = self.think.parse(text) if self.think is not None else Split(content=text)
        msg: dict[str, Any] = {"role": "assistant", "content": split.content}
        if self.think is not None:
            msg["reasoning_content"] = split.reasoning
        if self.named is not None:
            msg["content"] = ""
            msg["tool_calls"] = [Call(self.named, split.content).message_entry()]
        elif self.fmt is not None:
            content, calls = self.fmt.parse(split.content, self.names)
            calls = self._calls(calls)
            msg["content"] = content if content or not calls else None
            if calls:
                msg["tool_calls"] = [c.message_entry() for c in calls]
        return msg

    def delta(self, piece: str, finished: bool) -> dict:
        """The stream delta for the next detokenized `piece` ({} when nothing is ready to send)."""
        split = Split(content=piece)
        if self.think is not None:
            split = self.think.parse_delta(piece)
            if finished:
                split = split + self.think.finish()
        out: dict[str, Any] = {}
        if split.reasoning:
            out["reasoning_content"] = split.reasoning
        content = split.content
        if self.named is not None:
            if content or (finished and self.named_id is None):
                out["tool_calls"] = [self._named_delta(content)]
            content = ""
        elif self.stream is not None:
            content, calls = self.stream.feed(content)
            if finished:
                rest, more = self.stream.finish()
                content, calls = content + rest, calls + more
            if calls and not self.hide_calls:
                first = self.streamed_calls
                self.streamed_calls += len(calls)
                self.called = True
                out["tool_calls"] = [{"index": first + i, **c.message_entry()} for i, c in enumerate(calls)]
        if content:
            out["content"] = content
        return out

    def _named_delta(self, arguments: str) -> dict:
        if self.named_id is None:  # the first delta names the call; the rest carry its arguments
            self.named_id = Call(self.named or "", "").message_entry()["id"]
            return {"index": 0, "id": self.named_id, "type": "function",
                    "function": {"name": self.named, "arguments": arguments}}
        return {"index": 0, "function": {"arguments": arguments}}
