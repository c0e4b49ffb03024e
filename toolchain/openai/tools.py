"""Tool calls in the chat endpoint, as trtllm-serve's `--tool_parser` serves them
(NVIDIA/TensorRT-LLM tensorrt_llm/serve/tool_parser/, ported there from SGLang's function-call detectors;
the request rules from tensorrt_llm/serve/openai_protocol.py and postprocess_handlers.py).

The request's `tools` go to the chat template (`tools=` of apply_chat_template); the answer is then
parsed by the parser the server was started with:

- qwen3 (Qwen3ToolParser, Qwen 2.5 and 3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  several in a row; content is the text before the first `<tool_call>\\n`, stripped.
- deepseekv3 (DeepSeekV3Parser): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  ARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; a call that does not parse makes the whole text content.

In both, a call naming a function the request did not send is dropped (parse_base_json: "Model attempted to
call undefined function"), and `arguments` is json.dumps of the object, ensure_ascii=False.
Upstream's other parsers (qwen3_coder, kimi_k2, deepseekv3.1, deepseek_v32) are refused when the server
starts, as are families no upstream parser reads (Llama 3.x, Mistral and the rest: trtllm-serve has none).

Streaming: text before the calls streams as it comes (held back only while it could be the start of the
calls' opening tag, or is whitespace the whole-text parse would strip); from the opening tag on, the answer
is buffered and each call is sent whole, in one delta, once it is final (ToolCallStream). That is simpler
than upstream's argument-by-argument deltas and gives exactly the calls the whole-text parse gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from toolchain.archs import family_for_checkpoint
from toolchain.errors import ToolchainError
from toolchain.openai.protocol import new_id
from toolchain.openai.reasoning import reasoning_parser_problem

UPSTREAM_TOOL_PARSERS = ("qwen3", "qwen3_coder", "kimi_k2", "deepseekv3", "deepseekv3.1", "deepseek_v32")
TOOL_CHOICE_WITHOUT_TOOLS = "When using `tool_choice`, `tools` must be set."  # openai_protocol.py, upstream's words
# The families whose chat templates write each implemented format (archs family names): Qwen 2.5 and 3 write
# Hermes-style <tool_call> blocks, DeepSeek-V3/R1 its own tokens.
FORMAT_FAMILIES = {"qwen3": ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"), "deepseekv3": ("deepseek_v3",)}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON text

    def message_entry(self) -> dict:
        """The call in a message's `tool_calls` (ToolCall: id chatcmpl-tool-<32 hex>, make_tool_call_id "random")."""
        return {"id": new_id("chatcmpl-tool"), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _calls_from_json(action: Any, names: set[str]) -> list[Call]:
    """parse_base_json: one object or a list of them; "parameters" or else "arguments"; unknown names dropped."""
    out = []
    for act in action if isinstance(action, list) else [action]:
        name = act.get("name") if isinstance(act, dict) else None
        if name and name in names:
            out.append(Call(name, json.dumps(act.get("parameters") or act.get("arguments", {}), ensure_ascii=False)))
    return out


class Qwen3Format:
    bot, eot = "<tool_call>\n", "\n</tool_call>"
    final_when_closed = True  # a closed block's calls never change (each block is parsed alone)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[Call]]:
        at = text.find(self.bot)
        if at == -1:
            return text, []
        calls = []
        for body in re.findall(f"{re.escape(self.bot)}(.*?){re.escape(self.eot)}", text, re.DOTALL):
            try:
                calls += _calls_from_json(json.loads(body.strip()), names)
            except json.JSONDecodeError:
                continue  # upstream logs it and goes on with the next block
        return text[:at].strip(), calls


class DeepSeekV3Format:
    bot, eot = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁end｜>"
    final_when_closed = False  # a later call that does not parse turns the whole answer into content
    call = re.compile(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", re.DOTALL)
    detail = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)\n```json\n(.*)\n```<｜tool▁call▁end｜>", re.DOTALL)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[Call]]:
        at = text.find(self.bot)
        if at == -1:
            return text, []
        calls = []
        try:
            for block in self.call.findall(text):
                found = self.detail.search(block)
                if found is None:
                    raise ValueError("no function<｜tool▁sep｜>NAME and ```json block")
                calls += _calls_from_json({"name": found.group(2), "parameters": json.loads(found.group(3))}, names)
        except ValueError:  # json.JSONDecodeError is one; upstream then answers the whole text as content
            return text, []
        return text[:at].strip(), calls


FORMATS: dict[str, Callable[[], Qwen3Format | DeepSeekV3Format]] = {"qwen3": Qwen3Format,
                                                                     "deepseekv3": DeepSeekV3Format}


def tool_parser_problem(name: str | None, on_cpu: bool = True) -> str | None:
    """Why `name` cannot be this server's tool parser (`on_cpu`) or trtllm-serve's, as one line (None: it can,
    or none is asked)."""
    if name is None or name in FORMATS or (not on_cpu and name in UPSTREAM_TOOL_PARSERS):
        return None
    implemented = ", ".join(FORMATS)
    if name in UPSTREAM_TOOL_PARSERS:
        return f"tool parser {name!r} (upstream's) is not implemented by this server; it implements {implemented}"
    return (f"tool parser {name!r} does not exist; trtllm-serve's --tool_parser takes "
            f"{', '.join(UPSTREAM_TOOL_PARSERS)} (this server implements {implemented})")


def family_problem(parser: str, family: str) -> str | None:
    """Why the tool parser cannot read what a model of `family` writes (None: a format it writes)."""
    if any(family in families for families in FORMAT_FAMILIES.values()):
        return None
    return (f"trtllm-serve has no tool parser for the {family} family's tool-call format (its parsers: "
            f"{', '.join(UPSTREAM_TOOL_PARSERS)}, for Qwen3/Qwen3-Coder, Kimi K2 and DeepSeek); start the server "
            f"without --tool_parser {parser}")


def parsers_problem(tool_parser: str | None, reasoning_parser: str | None, architecture: str | None,
                    on_cpu: bool = True) -> str | None:
    """Why this server (`on_cpu`) or trtllm-serve cannot run with these parser names for a model of
    `architecture` (a checkpoint `architecture`; None: not known here), as one line, or None."""
    problem = tool_parser_problem(tool_parser, on_cpu) or reasoning_parser_problem(reasoning_parser)
    if problem or tool_parser is None or architecture is None:
        return problem
    try:
        family = family_for_checkpoint(architecture).name
    except ToolchainError:
        family = architecture
    return family_problem(tool_parser, family)


def request_problem(tools: list | None, tool_choice: Any, parser: str | None) -> str | None:
    """Why a chat request's tools / tool_choice cannot be served, as one line, or None. `tool_choice` is the
    effective one (protocol: "auto" when tools come without it)."""
    if tool_choice not in ("none", "auto") and not isinstance(tool_choice, dict):
        # ChatCompletionRequest.tool_choice in the 1.2 protocol: Literal["none", "auto"] | a named tool.
        return (f"tool_choice {tool_choice!r} is not supported: send \"none\", \"auto\" or "
                "{\"type\": \"function\", \"function\": {\"name\": NAME}} (trtllm-serve 1.2 has no \"required\")")
    if tool_choice != "none" and not tools:
        return TOOL_CHOICE_WITHOUT_TOOLS
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            return "tool_choice must be \"none\", \"auto\" or {\"type\": \"function\", \"function\": {\"name\": NAME}}"
        if name not in tool_names(tools):
            return f"tool_choice names function {name!r}, which is not among the request's tools"
    elif tool_choice == "auto" and parser is None:
        return ("tools need a tool parser: this server was started without one; start it with --tool_parser "
                f"({', '.join(FORMATS)}; spec field llmapi.tool_parser) or send tool_choice \"none\"")
    return None


def tool_names(tools: list | None) -> set[str]:
    return {t["function"]["name"] for t in tools or []}


class ToolCallStream:
    """The tool calls of one streamed answer. `feed` returns the content safe to send now and the calls
    that are final (qwen3: each once its block closes; deepseekv3: none before the end, since a later
    broken call makes the whole answer content); `finish` the rest. Together they give exactly what `parse`
    gives for the whole text, except whitespace at the very start of an answer that turns out to hold
    calls: it was sent before the calls showed, and the whole-text parse strips it."""

    def __init__(self, fmt: Qwen3Format | DeepSeekV3Format, names: set[str]):
        self.fmt, self.names = fmt, names
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.calls_sent = 0

    def feed(self, piece: str) -> tuple[str, list[Call]]:
        self.text += piece
        at = self.text.find(self.fmt.bot)
        if at != -1:
            safe = self.text[:at].rstrip()
        else:
            keep = max((n for n in range(1, len(self.fmt.bot)) if self.text.endswith(self.fmt.bot[:n])), default=0)
            safe = self.text[:len(self.text) - keep].rstrip()  # whitespace before a call is stripped
        out = safe[self.sent:] if len(safe) > self.sent else ""
        self.sent += len(out)
        calls: list[Call] = []
        # Parsed again only when a block may have closed in this piece.
        if at != -1 and self.fmt.final_when_closed and self.fmt.eot in self.text[-(len(piece) + len(self.fmt.eot)):]:
            calls = self.fmt.parse(self.text, self.names)[1][self.calls_sent:]
            self.calls_sent += len(calls)
        return out, calls

    def finish(self) -> tuple[str, list[Call]]:
        content, calls = self.fmt.parse(self.text, self.names)
        calls = calls[self.calls_sent:]
        sent = self.text[:self.sent]
        for prefix in (sent, sent.lstrip()):  # the whole-text parse strips what precedes the calls
            if content.startswith(prefix):
                return content[len(prefix):], calls
        return "", calls
