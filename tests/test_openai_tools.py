"""Tool-call and reasoning parsing of the OpenAI server's chat endpoint, on literal answers: trtllm-serve's
qwen3 and deepseekv3 tool parsers (tensorrt_llm/serve/tool_parser/), its deepseek-r1 and qwen3 reasoning
parsers (tensorrt_llm/llmapi/reasoning_parser.py), the request rules, and streams cut at every character
boundary giving what the whole-text parse gives."""

from __future__ import annotations

import json

import pytest

from toolchain.openai.chat_output import ChatAnswer
from toolchain.openai.protocol import ChatCompletionRequest
from toolchain.openai.reasoning import Split, ThinkParser, reasoning_parser_problem
from toolchain.openai.tools import (TOOL_CHOICE_WITHOUT_TOOLS, Call, DeepSeekV3Format, Qwen3Format, ToolCallStream,
                                    parsers_problem, request_problem, tool_parser_problem)

NAMES = {"get_weather", "get_time"}
QWEN3 = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "parameters": {"tz": "CET"}, "arguments": {"ignored": 1}}\n</tool_call>\n'
         '<tool_call>\n{not json}\n</tool_call>')
DEEPSEEK = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
            '```json\n{"tz": "JST"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def _splits(text: str):
    """The text in two pieces at every boundary, then one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


# -- tool parsers ---------------------------------------------------------------------------------------------


def test_qwen3_calls_content_and_dropped_blocks():
    content, calls = Qwen3Format().parse(QWEN3, NAMES)
    assert content == "Let me check."
    # The undefined function and the block that is not JSON are dropped; "parameters" wins over "arguments";
    # arguments keep non-ASCII text as it is (json.dumps ensure_ascii=False).
    assert calls == [Call("get_weather", '{"city": "Zürich"}'), Call("get_time", '{"tz": "CET"}')]
    assert Qwen3Format().parse("no calls here  ", NAMES) == ("no calls here  ", [])
    # The opening tag is "<tool_call>\n": without the newline nothing is a call.
    assert Qwen3Format().parse('<tool_call>{"name": "get_time"}</tool_call>', NAMES)[1] == []


def test_deepseekv3_calls_and_a_broken_call_makes_all_content():
    content, calls = DeepSeekV3Format().parse(DEEPSEEK, NAMES)
    assert content == "Sure."
    assert calls == [Call("get_weather", '{"city": "Tokyo"}'), Call("get_time", '{"tz": "JST"}')]
    broken = DEEPSEEK.replace('{"tz": "JST"}', '{"tz": JST}')
    assert DeepSeekV3Format().parse(broken, NAMES) == (broken, [])


@pytest.mark.parametrize("fmt, text", [(Qwen3Format, QWEN3), (DeepSeekV3Format, DEEPSEEK),
                                       (Qwen3Format, "plain answer, no call <tool"),
                                       (Qwen3Format, "a\n \n<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>"),
                                       (DeepSeekV3Format, DEEPSEEK.replace('{"tz": "JST"}', "{bad"))])
def test_tool_call_stream_equals_the_whole_text_parse_at_every_split(fmt, text):
    whole = fmt().parse(text, NAMES)
    for pieces in _splits(text):
        stream = ToolCallStream(fmt(), NAMES)
        sent, calls = "", []
        for piece in pieces:
            content, more = stream.feed(piece)
            sent, calls = sent + content, calls + more
        rest, more = stream.finish()
        assert (sent + rest, calls + more) == whole, pieces


def test_tool_call_stream_holds_back_what_may_open_a_call_and_sends_calls_when_final():
    stream = ToolCallStream(Qwen3Format(), NAMES)
    assert stream.feed("Hello <tool") == ("Hello", [])  # the space may precede a call (stripped), "<tool" may open one
    assert stream.feed("kit") == (" <toolkit", [])
    assert stream.feed(' \n<tool_call>\n{"name": "get_time"}\n</tool_') == ("", [])
    assert stream.feed("call>\n<tool_call>\n") == ("", [Call("get_time", "{}")])  # its block closed: final
    assert stream.finish() == ("", [])
    # DeepSeek's calls wait for the end: a later call that does not parse makes the whole answer content.
    stream = ToolCallStream(DeepSeekV3Format(), NAMES)
    assert stream.feed(DEEPSEEK) == ("Sure.", []) and stream.finish()[1] == DeepSeekV3Format().parse(DEEPSEEK, NAMES)[1]


def test_parser_names_and_families():
    assert tool_parser_problem("qwen3") is None and tool_parser_problem(None) is None
    assert "not implemented by this server; it implements qwen3, deepseekv3" in tool_parser_problem("kimi_k2")
    assert tool_parser_problem("kimi_k2", on_cpu=False) is None  # trtllm-serve has it
    assert "does not exist; trtllm-serve's --tool_parser takes qwen3, qwen3_coder, kimi_k2, deepseekv3" in \
        tool_parser_problem("hermes", on_cpu=False)
    assert reasoning_parser_problem("deepseek-r1") is None
    assert reasoning_parser_problem("r1") == ("reasoning parser 'r1' does not exist; trtllm-serve's "
                                              "--reasoning_parser takes deepseek-r1, qwen3")
    assert parsers_problem("qwen3", "qwen3", "Qwen3ForCausalLM") is None
    assert parsers_problem("deepseekv3", "deepseek-r1", "DeepseekV3ForCausalLM") is None
    for arch, family in (("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral")):
        problem = parsers_problem("qwen3", None, arch)
        assert problem.startswith(f"trtllm-serve has no tool parser for the {family} family's tool-call format")
        assert problem.endswith("start the server without --tool_parser qwen3") and "\n" not in problem
    assert parsers_problem(None, "deepseek-r1", "LlamaForCausalLM") is None  # R1's Llama distills think too


def test_request_rules():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert request_problem(None, "none", None) is None
    assert request_problem(None, "auto", "qwen3") == TOOL_CHOICE_WITHOUT_TOOLS
    assert "trtllm-serve 1.2 has no \"required\"" in request_problem(tools, "required", "qwen3")
    assert request_problem(tools, "auto", "qwen3") is None
    no_parser = request_problem(tools, "auto", None)
    assert "--tool_parser" in no_parser and "llmapi.tool_parser" in no_parser
    named = {"type": "function", "function": {"name": "get_time"}}
    assert request_problem(tools, named, None) is None  # upstream answers a named tool without a parser
    assert "not among the request's tools" in request_problem(tools, {"type": "function", "function": {"name": "x"}},
                                                               "qwen3")
    assert request_problem([{"type": "function"}], "auto", "qwen3").startswith("tools[0] must be")


# -- reasoning parsers ------------------------------------------------------------------------------------------


def test_reasoning_whole_text():
    assert ThinkParser("deepseek-r1").parse("plan it\n</think>\n\nAnswer") == Split("\n\nAnswer", "plan it\n")
    assert ThinkParser("deepseek-r1").parse("still thinking") == Split("", "still thinking")
    assert ThinkParser("qwen3").parse("dropped<think>why</think>Answer") == Split("Answer", "why")
    assert ThinkParser("qwen3").parse("no tags at all") == Split("no tags at all", "")


@pytest.mark.parametrize("name, text", [("deepseek-r1", "a < b, so </th is no tag</think>Answer: <b>"),
                                        ("deepseek-r1", "cut mid-tag </thi"), ("deepseek-r1", "only </think>"),
                                        ("qwen3", "<think>x<y</think>done"), ("qwen3", "<b>no reasoning</b>"),
                                        ("qwen3", "<think>unfinished")])
def test_reasoning_stream_equals_the_whole_text_at_every_split(name, text):
    whole = ThinkParser(name).parse(text)
    for pieces in _splits(text):
        parser = ThinkParser(name)
        got = Split()
        for piece in pieces:
            got = got + parser.parse_delta(piece)
        assert got + parser.finish() == whole, pieces


def test_reasoning_stream_keeps_upstreams_rules_where_they_differ_from_the_whole_text():
    # qwen3: text before <think> that arrived in an earlier piece has gone out as content (upstream's parse_delta),
    # although the whole-text parse drops it.
    parser = ThinkParser("qwen3")
    assert parser.parse_delta("pre") == Split(content="pre")
    assert parser.parse_delta("<think>r</think>c") == Split("c", "r")
    # A complete tag left in the hold-back at the end is a delimiter, not text.
    parser = ThinkParser("deepseek-r1")
    assert parser.parse_delta("</think>") == Split() and parser.finish() == Split()


# -- the chat answer: reasoning, then tool calls -------------------------------------------------------------


def _request(**fields) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(NAMES)]
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, **fields)


def _streamed(answer: ChatAnswer, pieces: list[str]) -> dict:
    """The deltas of a stream folded the way the openai client folds them."""
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for i, piece in enumerate(pieces):
        delta = answer.delta(piece, i == len(pieces) - 1)
        out["content"] += delta.get("content", "")
        out["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            slot = out["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            slot["name"] += call["function"].get("name", "")
            slot["arguments"] += call["function"]["arguments"]
    return out


def test_message_and_stream_with_reasoning_and_calls():
    text = "<think>cold?</think>\n" + QWEN3
    answer = ChatAnswer(_request(), "qwen3", "qwen3")
    msg = answer.message(text)
    assert msg["reasoning_content"] == "cold?" and msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    ids = [c["id"] for c in msg["tool_calls"]]
    assert all(i.startswith("chatcmpl-tool-") and len(i) == len("chatcmpl-tool-") + 32 for i in ids)
    assert len(set(ids)) == 2 and {c["type"] for c in msg["tool_calls"]} == {"function"}
    assert answer.finish_reason("stop") == "tool_calls" and answer.finish_reason("length") == "length"
    for pieces in _splits(text):
        got = _streamed(ChatAnswer(_request(), "qwen3", "qwen3"), pieces + [""])
        # The "\n" after </think> went out before the calls showed; the whole-text parse strips it.
        assert got["reasoning_content"] == "cold?" and got["content"] == "\nLet me check."
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]], pieces


def test_content_is_none_beside_calls_and_tool_choice_none_hides_them():
    only_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert ChatAnswer(_request(), "qwen3", None).message(only_call)["content"] is None
    hidden = ChatAnswer(_request(tool_choice="none"), "qwen3", None)
    assert hidden.message(QWEN3) == {"role": "assistant", "content": "Let me check."}
    assert hidden.finish_reason("stop") == "stop"
    assert ChatAnswer.wanted(_request(tool_choice="none"), None, None) is None  # plain content, as before


def test_named_tool_choice_takes_the_whole_answer_as_arguments():
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = ChatAnswer(_request(tool_choice=named), None, None)
    msg = answer.message('{"tz": "UTC"}')
    assert msg["content"] == "" and msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    got = _streamed(ChatAnswer(_request(tool_choice=named), None, None), ['{"tz"', ': "UTC"}', ""])
    assert got["tool_calls"] == {0: {"name": "get_time", "arguments": '{"tz": "UTC"}'}} and got["content"] == ""
    assert json.loads(got["tool_calls"][0]["arguments"]) == {"tz": "UTC"}
