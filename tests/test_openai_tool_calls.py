"""Tool calls and reasoning through the OpenAI server's chat endpoint, end to end, read by the official
`openai` client.

Why this model: a random tiny model never writes a tool call, and forcing one with guided decoding would
test the grammar, not the parsing. So the model here is a real Qwen3 checkpoint, converted and built like
any other and run by the CPU engine, whose weights make it a fixed chain: attention and MLP outputs are
zero, the embedding is one-hot and lm_head maps each word to the next word of a chain (every other word to
</s>), so greedy decoding writes, word by word, what a Qwen3 model writes when it calls a tool:
`<think> hmm </think> Checking. <tool_call>\\n {"name": ...} \\n</tool_call>`. Its chat template ends the
prompt with the first tool's name when the request has tools (so the chain starts only if `tools` reached
the template) and with `plain` otherwise. Nothing of the server is replaced: tokenizer, template, engine,
detokenizer, reasoning and tool parsers all run as they do in production."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from openai_helpers import build_engine

pytestmark = [pytest.mark.e2e]

MODEL = "tiny-tools"
LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 64}
CHAIN_WITH_TOOLS = ["get_weather", "<think>", "hmm", "</think>", "Checking.", "<tool_call>\n", '{"name":',
                    '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "\n</tool_call>"]
CHAIN_WITHOUT = ["plain", "Hello", "there."]
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}"
            "{% if tools %}{{ tools[0]['function']['name'] }}{% else %}plain{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
HIDDEN = 64


def _chain_model(out: Path) -> Path:
    """The Qwen3 checkpoint that writes the chains (module docstring), with its WordLevel tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = ["<unk>", "<s>", "</s>", "hi", *CHAIN_WITH_TOOLS, *CHAIN_WITHOUT]
    vocab = {w: i for i, w in enumerate(words)}
    config = Qwen3Config(vocab_size=HIDDEN, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(HIDDEN))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(HIDDEN, HIDDEN)
        head[vocab["</s>"], :] = 1.0  # the fallback: any word off the chains ends the answer
        for chain in (CHAIN_WITH_TOOLS, CHAIN_WITHOUT):
            for word, after in zip(chain, chain[1:]):
                head[vocab[after], vocab[word]] = 10.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """(engine dir, checkpoint dir holding the tokenizer)."""
    root = tmp_path_factory.mktemp("tool-calls")
    checkpoint = _chain_model(root / "hf")
    return build_engine(root, checkpoint, limits=LIMITS, build={"tokens_per_block": 16}), checkpoint


@pytest.fixture(scope="module")
def client(chain):
    """The official openai client on the in-process app, started as `--tool_parser qwen3 --reasoning_parser qwen3`."""
    import openai
    from fastapi.testclient import TestClient

    from toolchain.openai.__main__ import _args, build_app

    engine_dir, tokenizer = chain
    app = build_app(_args(["--engine-dir", str(engine_dir), "--tokenizer", str(tokenizer), "--served-model-name",
                           MODEL, "--engine-threads", "1", "--tool_parser", "qwen3", "--reasoning_parser", "qwen3"]))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_client_reads_the_tool_call_and_the_reasoning(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0)
    choice = resp.choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and len(choice.message.tool_calls) == 1
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == " hmm "
    assert choice.finish_reason == "tool_calls"
    # The next turn sends the call and its result back, as a client does; the template takes both.
    follow = [*MESSAGES, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, temperature=0)
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_the_stream_gives_the_same_call(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, stream=True)
    content, reasoning, calls, reasons = "", "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (content.strip(), reasoning) == ("Checking.", " hmm ")
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert reasons[-1] == "tool_calls"


def test_without_tools_the_template_takes_the_other_chain(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert resp.choices[0].message.content == "Hello there." and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"
    # tool_choice "none": the tools reach the template (the call chain runs), but no call is returned.
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          temperature=0)
    assert resp.choices[0].message.content == "Checking." and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


def test_refusals_are_one_line_400s(client):
    import openai

    for extra, needle in (({"tool_choice": "required"}, "required"),
                          ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "not among the request's tools")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **extra)
        message = err.value.body["message"]
        assert needle in message and "\n" not in message


def test_response_format_needs_guided_decoding_turned_on(client):
    """This server was started without guided_decoding_backend: as trtllm-serve then, a constraining
    response_format is a 400 in the words clients know, saying how to turn it on; "text" constrains nothing."""
    import openai

    for fmt in ({"type": "json_object"}, {"type": "regex", "regex": "a+"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}},
                {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=4)
        message = err.value.body["message"]
        assert message.startswith("Guided decoding is not enabled for this server; ") and "\n" not in message
        assert "guided_decoding_backend: xgrammar" in message and "serving.guided_decoding_backend" in message
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"},
                                          temperature=0)
    assert resp.choices[0].message.content == "Hello there."


def test_the_guided_decoding_option_belongs_to_the_engine_path(chain, tmp_path):
    from toolchain.errors import ToolchainError
    from toolchain.openai.__main__ import _args, build_app

    _engine_dir, tokenizer = chain
    with pytest.raises(ToolchainError) as err:
        build_app(_args([str(tokenizer), "--served-model-name", MODEL, "--guided-decoding-backend", "xgrammar"]))
    assert "set guided_decoding_backend: xgrammar in the --config file" in str(err.value)
    with pytest.raises(SystemExit):  # argparse: llguidance is upstream's other backend, not the CPU engine's
        _args(["--engine-dir", str(tmp_path), "--served-model-name", MODEL, "--guided-decoding-backend", "llguidance"])


def test_the_server_refuses_parsers_it_cannot_serve_at_start(chain, hf_llama_words, tmp_path):
    from toolchain.errors import ToolchainError
    from toolchain.openai.__main__ import _args, build_app

    engine_dir, tokenizer = chain
    base = ["--engine-dir", str(engine_dir), "--tokenizer", str(tokenizer), "--served-model-name", MODEL]
    for extra, needle in ((["--tool_parser", "kimi_k2"], "not implemented by this server; it implements qwen3, "
                                                          "deepseekv3"),
                          (["--tool_parser", "hermes"], "does not exist"),
                          (["--reasoning_parser", "r1"], "takes deepseek-r1, qwen3")):
        with pytest.raises(ToolchainError) as err:
            build_app(_args(base + extra))
        assert needle in str(err.value) and "\n" not in str(err.value)
    llama_engine = build_engine(tmp_path, hf_llama_words, limits=LIMITS, build={"tokens_per_block": 16})
    with pytest.raises(ToolchainError) as err:
        build_app(_args(["--engine-dir", str(llama_engine), "--tokenizer", str(hf_llama_words),
                         "--served-model-name", MODEL, "--tool_parser", "qwen3"]))
    assert "trtllm-serve has no tool parser for the llama family" in str(err.value)
