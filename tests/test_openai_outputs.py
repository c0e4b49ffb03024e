"""What clients send the OpenAI server beyond text (issue 37), against a live `python -m toolchain.openai`
serving the trained tiny Llama (byte-level BPE, so JSON and regexes can be spelled): log-probabilities and
echo equal HF's log-softmax on the same tokens, chat logprobs / top_logprobs, response_format through XGrammar
(the official `openai` client's structured-output parse included), logit_bias and penalties as the engine
applies them, and several prompts in one completions request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAINED, starts_server
from openai_helpers import build_engine, serving
from test_openai_server import request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama missing")]

MODEL = "tiny-llama"
LIMITS = {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 512}
PROMPT = "def fibonacci(n):"
TOL = 1e-4


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return build_engine(tmp_path_factory.mktemp("openai-outputs"), TINY_TRAINED, limits=LIMITS)


@pytest.fixture(scope="module")
@starts_server
def server(engine_dir, tmp_path_factory):
    with serving(engine_dir, TINY_TRAINED, MODEL, tmp_path_factory.mktemp("log"), guided=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_TRAINED, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(TINY_TRAINED))


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position of `ids` [len, V], float32."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def greedy(model, ids: list[int], n: int, penalty=None) -> list[int]:
    """HF's greedy continuation; `penalty(logits, seen)` adjusts each step's logits first."""
    out = list(ids)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([out])).logits[0, -1].float()
        if penalty is not None:
            logits = penalty(logits, out)
        out.append(int(torch.argmax(logits)))
    return out[len(ids):]


def close(a, b) -> bool:
    """Equal, floats within TOL (a request whose prompt blocks come from the cache sums in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < TOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def completion(prompt, max_tokens, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def chat(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def ok(server, path, body) -> dict:
    status, resp = request(server, "POST", path, body)
    assert status == 200, resp
    return resp


# -- log-probabilities -------------------------------------------------------------------------


def test_completion_logprobs_with_echo_equal_hfs_log_softmax(server, hf):
    model, tok = hf
    prompt_ids = tok.encode(PROMPT)
    out_ids = greedy(model, prompt_ids, 8)
    ids = prompt_ids + out_ids
    ref = log_softmax(model, ids)
    resp = ok(server, "/v1/completions", completion(PROMPT, 8, logprobs=3, echo=True))
    (choice,) = resp["choices"]
    assert choice["text"] == PROMPT + tok.decode(out_ids, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lp["tokens"]) == len(ids) == resp["usage"]["total_tokens"]
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        want = ref[j - 1]
        assert abs(lp["token_logprobs"][j] - float(want[ids[j]])) < TOL, j
        top = lp["top_logprobs"][j]
        values, top_ids = torch.topk(want, 3)
        for t, v in zip(top_ids.tolist(), values.tolist(), strict=True):
            assert abs(top[tok.decode([t])] - v) < TOL, (j, t)
        assert len(top) in (3, 4)  # the chosen token joins its top 3 when it is not among them
    # Each token's text starts at its offset in the choice's text (the BOS token's text is empty there).
    text = choice["text"]
    for off, piece, i in zip(lp["text_offset"], lp["tokens"], ids, strict=True):
        if i != tok.bos_token_id:
            assert text[off:].startswith(piece), (off, piece)
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_streamed_logprobs_are_the_whole_responses_chunk_by_chunk(server, echo):
    body = completion(PROMPT, 10, logprobs=2, echo=echo)
    whole = ok(server, "/v1/completions", body)["choices"][0]
    events = stream(server, "/v1/completions", body)
    chunks = [e["choices"][0] for e in events[:-1]]
    assert len([c for c in chunks if c["logprobs"]]) > 1
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in whole["logprobs"]}
    assert close(joined, whole["logprobs"])
    if echo:
        assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    # Each chunk carries its own tokens' log-probs: their text is the chunk's text.
    for c in chunks[1 if echo else 0:]:
        if c["logprobs"]:
            assert "".join(c["logprobs"]["tokens"]) == c["text"]


def test_chat_logprobs_and_top_logprobs(server, hf):
    model, tok = hf
    body = chat("def add(a, b):", 6, logprobs=True, top_logprobs=2)
    resp = ok(server, "/v1/chat/completions", body)
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"] == 6
    prompt_text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt_text, add_special_tokens=False)
    out_ids = greedy(model, prompt_ids, 6)
    ref = log_softmax(model, prompt_ids + out_ids)
    for k, (entry, t) in enumerate(zip(content, out_ids, strict=True)):
        row = ref[len(prompt_ids) - 1 + k]
        assert entry["token"] == tok.decode([t]) and entry["bytes"] == list(entry["token"].encode())
        assert abs(entry["logprob"] - float(row[t])) < TOL
        assert len(entry["top_logprobs"]) == 2
        values, ids = torch.topk(row, 2)
        assert [e["token"] for e in entry["top_logprobs"]] == [tok.decode([i]) for i in ids.tolist()]
        assert all(abs(e["logprob"] - v) < TOL for e, v in zip(entry["top_logprobs"], values.tolist(), strict=True))
    # Streamed: every chunk with content carries that content's log-probs.
    events = stream(server, "/v1/chat/completions", body)
    streamed = [e for c in events[:-1] if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert close(streamed, content)
    # Without logprobs, none.
    assert ok(server, "/v1/chat/completions", chat("hi", 2))["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/chat/completions", chat("hi", 2, top_logprobs=2), "logprobs must be true when using top_logprobs"),
    ("/v1/chat/completions", chat("hi", 2, logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/completions", completion(PROMPT, 2, logprobs=21), "logprobs"),
    ("/v1/completions", completion(PROMPT, 2, n=2), "Greedy decoding in the LLM API does not allow multiple returns"),
    ("/v1/completions", completion(PROMPT, 2, n=2, best_of=1, temperature=1.0), "best_of (1) cannot be less than n (2)"),
    ("/v1/completions", completion(PROMPT, 2, best_of=3), "Greedy decoding in the LLM API does not allow multiple"),
    # This engine is built with max_beam_width 1 (beam search itself: test_openai_beams.py).
    ("/v1/completions", completion(PROMPT, 2, use_beam_search=True, n=2), "exceeds the engine's max_beam_width 1"),
], ids=["top-without-logprobs", "top-over-limit", "logprobs-over-limit", "n-greedy", "best-of-below-n",
        "best-of-greedy", "beam-above-build"])
def test_what_is_not_served_is_refused_in_one_line(server, path, body, needle):
    status, resp = request(server, "POST", path, body)
    assert status == 400 and needle in resp["message"] and "\n" not in resp["message"], resp


# -- structured output ----------------------------------------------------------------------------


def test_the_openai_clients_structured_parse_returns_a_valid_object(server):
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        kind: Literal["list", "dict", "set"]

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    done = parse(model=MODEL, messages=[{"role": "user", "content": "Which container?"}], response_format=Verdict,
                 max_tokens=60, temperature=0)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Verdict), done.choices[0].message.content


@pytest.mark.parametrize("fmt, check", [
    ({"type": "regex", "regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"type": "ebnf", "ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"type": "json_schema", "json_schema": {"name": "pair", "schema": {
        "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"], "additionalProperties": False}}},
     lambda t: isinstance(json.loads(t)["a"], bool) and json.loads(t)["b"] in ("x", "y")),
    ({"type": "json", "schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     lambda t: all(isinstance(v, bool) for v in json.loads(t))),
    # json_object is XGrammar's built-in JSON grammar, as upstream compiles it: any JSON value.
    ({"type": "json_object"}, lambda t: json.loads(t) is not None or t == "null"),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "ok: "}, {"type": "json_schema", "json_schema": {"type": "boolean"}}]}},
     lambda t: t in ("ok: true", "ok: false")),
], ids=["regex", "ebnf", "json_schema", "json", "json_object", "structural_tag"])
def test_response_format_constrains_the_text(server, fmt, check):
    asks = [("/v1/chat/completions", chat("answer:", 80, response_format=fmt))]
    if fmt["type"] != "json_object":  # any whitespace is JSON: after code, the tiny model indents it forever
        asks.append(("/v1/completions", {**completion(PROMPT, 80, response_format=fmt), "ignore_eos": False}))
    for path, body in asks:
        resp = ok(server, path, body)
        choice = resp["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop", (path, text)
        assert check(text), (path, text)


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, 'Unsupported type "nonsense"'),
    ({"type": "regex", "regex": "(ab"}, "parenthesis is not closed"),
    ({"type": "json_schema"}, "response_format.json_schema is required for response_format.type == 'json_schema', "
                              "but got None."),
    ({"type": "regex"}, "response_format.regex is required"),
    ({"type": "structural_tag"}, "response_format.format is required"),
    ({"type": "yaml"}, "response_format.type"),
], ids=["schema", "regex", "missing-schema", "missing-regex", "missing-tag", "unknown-type"])
def test_a_guide_xgrammar_rejects_is_a_400_with_its_message(server, fmt, needle):
    status, resp = request(server, "POST", "/v1/chat/completions", chat("hi", 4, response_format=fmt))
    assert status == 400 and needle in resp["message"] and "\n" not in resp["message"], resp
    assert ok(server, "/v1/completions", completion(PROMPT, 2))["usage"]["completion_tokens"] == 2


# -- sampling controls -----------------------------------------------------------------------------


def test_logit_bias_moves_greedy_output(server, hf):
    model, tok = hf
    ids = tok.encode(PROMPT)
    first = greedy(model, ids, 1)[0]

    def ban(logits, _seen):
        logits = logits.clone()
        logits[first] -= 100
        return logits

    banned = ok(server, "/v1/completions", completion(PROMPT, 6, logit_bias={str(first): -100}))["choices"][0]
    assert banned["text"] == tok.decode(greedy(model, ids, 6, ban))
    assert not ok(server, "/v1/completions", completion(PROMPT, 6))["choices"][0]["text"].startswith(banned["text"])
    forced = tok.encode(" yes", add_special_tokens=False)[-1]
    pushed = ok(server, "/v1/completions", completion(PROMPT, 4, logit_bias={str(forced): 100}))["choices"][0]
    assert pushed["text"] == tok.decode([forced] * 4)


@pytest.mark.parametrize("bias, needle", [
    ({"abc": 1}, "Invalid logit_bias key 'abc': must be a valid integer token ID"),
    ({"4096": 1}, "Token ID 4096 out of vocabulary range [0, 4096)"),
    ({"5": 101}, "logit_bias value for token ID 5 must be in [-100, 100]"),
], ids=["key", "range", "value"])
def test_bad_logit_bias_is_refused_in_upstreams_words(server, bias, needle):
    status, resp = request(server, "POST", "/v1/completions", completion(PROMPT, 2, logit_bias=bias))
    assert status == 400 and needle in resp["message"], resp


def _presence(p):
    def apply(logits, seen):
        logits = logits.clone()
        logits[sorted(set(seen))] -= p
        return logits
    return apply


def _frequency(p):
    def apply(logits, seen):
        counts = torch.bincount(torch.tensor(seen), minlength=logits.shape[0]).float()
        return logits - p * counts
    return apply


def _repetition(p):
    def apply(logits, seen):
        logits = logits.clone()
        idx = torch.tensor(sorted(set(seen)))
        vals = logits[idx]
        logits[idx] = torch.where(vals > 0, vals / p, vals * p)
        return logits
    return apply


@pytest.mark.parametrize("field, value, penalty", [
    ("presence_penalty", 1.5, _presence(1.5)),
    ("frequency_penalty", 0.8, _frequency(0.8)),
    ("repetition_penalty", 1.6, _repetition(1.6)),
], ids=["presence", "frequency", "repetition"])
def test_penalties_change_greedy_output_as_trtllm_applies_them(server, hf, field, value, penalty):
    """Over prompt and output tokens, as TRT-LLM's penalty kernels count them."""
    model, tok = hf
    ids = tok.encode(PROMPT)
    plain = ok(server, "/v1/completions", completion(PROMPT, 16))["choices"][0]["text"]
    got = ok(server, "/v1/completions", completion(PROMPT, 16, **{field: value}))["choices"][0]["text"]
    want = tok.decode(greedy(model, ids, 16, penalty), skip_special_tokens=True)
    assert got == want and got != plain


def test_min_p_one_keeps_only_the_likeliest_token(server):
    """min_p 1.0 drops every token less likely than the likeliest: sampling at temperature 1 is greedy then."""
    greedy_text = ok(server, "/v1/completions", completion(PROMPT, 10))["choices"][0]["text"]
    sampled = [ok(server, "/v1/completions", completion(PROMPT, 10, temperature=1.0, min_p=1.0, seed=s))
               ["choices"][0]["text"] for s in (1, 2)]
    assert sampled == [greedy_text, greedy_text]
    free = {ok(server, "/v1/completions", completion(PROMPT, 10, temperature=1.0, seed=s))["choices"][0]["text"]
            for s in (1, 2, 3)}
    assert free != {greedy_text}


def test_stop_token_ids_end_the_text_and_include_stop_str_in_output_keeps_the_stop(server, hf):
    model, tok = hf
    out = greedy(model, tok.encode(PROMPT), 6)
    stop = out[3]
    cut = out[:out.index(stop)]
    choice = ok(server, "/v1/completions", completion(PROMPT, 6, stop_token_ids=[stop]))["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (tok.decode(cut), "stop", stop)
    kept = ok(server, "/v1/completions", completion(PROMPT, 6, stop_token_ids=[stop], include_stop_str_in_output=True))
    assert kept["choices"][0]["text"] == tok.decode(cut + [stop])
    word = tok.decode(out[2:4])
    full = tok.decode(out)
    at = full.index(word)
    with_stop = ok(server, "/v1/completions", completion(PROMPT, 6, stop=[word], include_stop_str_in_output=True))
    assert with_stop["choices"][0]["text"] == full[:at + len(word)]


# -- several prompts ------------------------------------------------------------------------------


def test_batched_prompts_answer_one_choice_each_as_separate_requests(server, hf):
    _, tok = hf
    prompts = [PROMPT, "import os\n", "class Stack:"]
    separate = [ok(server, "/v1/completions", completion(p, 8))["choices"][0] for p in prompts]
    resp = ok(server, "/v1/completions", completion(prompts, 8))
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert [c["text"] for c in resp["choices"]] == [c["text"] for c in separate]
    prompt_tokens = sum(len(tok.encode(p)) for p in prompts)
    assert resp["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24, "total_tokens": prompt_tokens + 24}
    as_ids = ok(server, "/v1/completions", completion([tok.encode(p) for p in prompts], 8))
    assert [c["text"] for c in as_ids["choices"]] == [c["text"] for c in separate]
    events = stream(server, "/v1/completions", completion(prompts, 8, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for e in events[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in separate] and events[-2]["usage"] == resp["usage"]
    # One bad prompt refuses the whole request before any runs.
    status, bad = request(server, "POST", "/v1/completions", completion([[5, 6], [5, 99999]], 2))
    assert status == 400 and "vocabulary" in bad["message"]


def test_n_sampled_answers_are_child_requests_seeded_seed_plus_j(server):
    """Prompt i's sequence j is choice i * n + j, and equals a request of its own with seed + j."""
    prompts = [PROMPT, "import os\n"]
    body = completion(prompts, 6, n=2, temperature=1.0, seed=7)
    resp = ok(server, "/v1/completions", body)
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    alone = [ok(server, "/v1/completions", completion(p, 6, temperature=1.0, seed=7 + j))["choices"][0]["text"]
             for p in prompts for j in range(2)]
    assert [c["text"] for c in resp["choices"]] == alone
    assert alone[0] != alone[1]
    assert resp["usage"]["completion_tokens"] == 24
    prompt_tokens = sum(ok(server, "/v1/completions", completion(p, 1))["usage"]["prompt_tokens"] for p in prompts)
    assert resp["usage"]["prompt_tokens"] == prompt_tokens  # each prompt counted once
    events = stream(server, "/v1/completions", body)
    texts = [""] * 4
    for e in events[:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert texts == alone
    chat_resp = ok(server, "/v1/chat/completions", chat("def f():", 4, n=3, temperature=1.0, seed=3))
    assert [c["index"] for c in chat_resp["choices"]] == [0, 1, 2]
