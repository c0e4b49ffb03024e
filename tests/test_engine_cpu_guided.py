"""Guided decoding with XGrammar in the CPU engine (guided.py): a JSON object, a JSON schema, a regex and an EBNF
grammar each give text that parses or matches, even from the random test model (the mask forces validity), the
request ends when the grammar does, a guide XGrammar rejects is refused with XGrammar's message, and an engine
without a decoder refuses guides. The tokenizer-info file the Triton backend reads gives the same decoder."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from test_engine_cpu_batcher import TIMEOUT
from test_engine_cpu_util import _one_thread, engine_dir  # noqa: F401

from toolchain.engine.cpu import CpuEngine, InflightBatcher, SamplingParams
from toolchain.engine.cpu.guided import Guide, GuidedDecoder, tokenizer_info_dict
from toolchain.errors import ToolchainError

END = 2  # "</s>", the character tokenizer's eos and XGrammar's stop token
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def tokenizer(hf_llama_chars):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_llama_chars)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama_chars):
    engine = CpuEngine.load(engine_dir(tmp_path_factory, hf_llama_chars))
    engine.guided = GuidedDecoder.from_tokenizer_dir(hf_llama_chars, engine.vocab_size)
    return engine


def guided(engine, tokenizer, guide: Guide, n: int = 120, **kw) -> tuple[str, str | None]:
    seq = engine.start(tokenizer.encode("Answer: "), SamplingParams(n, end_id=END, guide=guide, **kw))
    engine.add(seq)
    try:
        while not seq.finished:
            engine.step([(seq, seq.pending)])
    finally:
        engine.release(seq)
    assert seq.error is None
    return tokenizer.decode(seq.output), seq.reason


def test_json_schema(engine, tokenizer):
    text, reason = guided(engine, tokenizer, Guide("json_schema", json.dumps(SCHEMA)), top_k=20, seed=1)
    assert reason == "end_id"
    value = json.loads(text)
    import jsonschema

    jsonschema.validate(value, SCHEMA)


def test_json_object(engine, tokenizer):
    # The bias makes "}" the likeliest character everywhere; the grammar still forces a "{" first.
    bias = torch.zeros(engine.vocab_size)
    bias[tokenizer.convert_tokens_to_ids("}")] = 50.0
    text, reason = guided(engine, tokenizer, Guide("json"), embedding_bias=bias)
    assert reason == "end_id" and isinstance(json.loads(text), dict)
    unguided = engine.generate(tokenizer.encode("Answer: "), SamplingParams(5, end_id=END, embedding_bias=bias))
    assert tokenizer.decode(unguided) == "}" * 5


@pytest.mark.parametrize("pattern", [r"[a-c]{2,4}-[0-9]{3}", r"(yes|no)!"])
def test_regex(engine, tokenizer, pattern):
    for kw in ({}, {"top_k": 20, "seed": 4}):
        text, reason = guided(engine, tokenizer, Guide("regex", pattern), **kw)
        assert reason == "end_id" and re.fullmatch(pattern, text), text


def test_ebnf_grammar(engine, tokenizer):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [xyz] | "[" [0-9] "]"'
    text, reason = guided(engine, tokenizer, Guide("ebnf_grammar", grammar), top_k=30, seed=2)
    assert reason == "end_id" and re.fullmatch(r"\((?:[xyz]|\[\d\])(?:,(?:[xyz]|\[\d\]))*\)", text), text


def test_structural_tags_in_xgrammars_form_and_the_llm_apis(engine, tokenizer):
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi!"}}
    assert guided(engine, tokenizer, Guide("structural_tag", json.dumps(tag))) == ("hi!", "end_id")
    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    assert engine.request_problem([5, 6], SamplingParams(4, guide=Guide("structural_tag", json.dumps(legacy)))) is None
    broken = {"structures": [{"begin": "<f>"}], "triggers": ["<f>"]}
    assert engine.request_problem([5, 6], SamplingParams(4, guide=Guide("structural_tag", json.dumps(broken)))) == (
        "the structural_tag guide is rejected by XGrammar: each of a structural tag's structures needs begin, "
        "schema and end")


def test_the_guide_bounds_nothing_else(engine, tokenizer):
    # max_new_tokens still ends a request whose grammar is not complete yet
    text, reason = guided(engine, tokenizer, Guide("json"), n=1)
    assert (text, reason) == ("{", "length")


@pytest.mark.parametrize("guide, message", [
    (Guide("json_schema", '{"type": "objekt"}'), r'the json_schema guide is rejected by XGrammar: Unsupported type "objekt"'),
    (Guide("regex", "[a-"), r"the regex guide is rejected by XGrammar: Regex parsing error at position 4"),
    (Guide("ebnf_grammar", "root ::= foo"), r'the ebnf_grammar guide is rejected by XGrammar: .*Rule "foo" is not defined'),
    (Guide("xml", "<a/>"), r"guide type 'xml' is not one of json, json_schema, regex, ebnf_grammar, structural_tag"),
    (Guide("regex", ""), "the regex guide is empty"),
])
def test_rejected_guides_get_xgrammars_message(engine, tokenizer, guide, message):
    problem = engine.request_problem([5, 6], SamplingParams(4, guide=guide))
    assert problem is not None and re.fullmatch(message + ".*", problem) and "\n" not in problem
    assert not problem.startswith("[") and ".cc:" not in problem
    # the batcher refuses it before admission, with the same words
    done, got = threading.Event(), []
    with InflightBatcher(engine) as b:
        b.submit("bad", [5, 6], SamplingParams(4, guide=guide), lambda t, f, e: (got.append(e), done.set()))
        assert done.wait(TIMEOUT)
    assert got == [problem]


def test_an_engine_without_a_decoder_refuses_guides(tmp_path_factory, hf_llama_chars):
    plain = CpuEngine.load(engine_dir(tmp_path_factory, hf_llama_chars))
    with pytest.raises(ToolchainError, match="guided decoding is not enabled for this engine"):
        plain.start([5, 6], SamplingParams(4, guide=Guide("json")))


def test_the_backends_tokenizer_info_file_gives_the_same_decoder(engine, tokenizer, hf_llama_chars, tmp_path):
    info = tokenizer_info_dict(hf_llama_chars, engine.vocab_size)
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    assert info["stop_token_ids"] == [END] and len(info["encoded_vocab"]) == engine.vocab_size
    path = tmp_path / "xgrammar_tokenizer_info.json"
    path.write_text(json.dumps(info))
    from_file = GuidedDecoder.from_info_file(path)
    guide = Guide("json_schema", json.dumps(SCHEMA))
    engine_dir_decoder, engine.guided = engine.guided, from_file
    try:
        text, _ = guided(engine, tokenizer, guide, top_k=20, seed=1)
    finally:
        engine.guided = engine_dir_decoder
    assert text == guided(engine, tokenizer, guide, top_k=20, seed=1)[0]
