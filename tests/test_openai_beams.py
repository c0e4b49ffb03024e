"""Several answers per prompt through a live OpenAI server (issue 37 item 2), on the trained tiny Llama built with
max_beam_width 3: `use_beam_search` returns transformers' beams (`generate(num_beams=W, num_return_sequences=n)`),
sampled `best_of` > n returns the n children with the highest cumulative log-prob, and what the CPU engine cannot
serve with beams is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAINED
from openai_helpers import build_engine
from test_openai_outputs import server  # noqa: F401 - the server fixture, on this module's engine_dir
from test_openai_server import request

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama missing")]

MODEL = "tiny-llama"
LIMITS = {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 512}
PROMPTS = ["def fibonacci(n):", "import os\n"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return build_engine(tmp_path_factory.mktemp("openai-beams"), TINY_TRAINED, limits=LIMITS, build={"max_beam_width": 3})


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_TRAINED, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(TINY_TRAINED))


def completion(prompt, max_tokens, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


def ok(server, body, path="/v1/completions") -> dict:
    status, resp = request(server, "POST", path, body)
    assert status == 200, resp
    return resp


def hf_beams(model, tok, prompt: str, width: int, n: int, new: int, early_stopping: bool) -> list[list[int]]:
    """transformers' beam search: each returned sequence's generated tokens, up to (not with) the end token."""
    ids = tok(prompt, return_tensors="pt").input_ids
    end = tok.eos_token_id
    out = model.generate(ids, num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=new,
                         length_penalty=1.0, early_stopping=early_stopping, eos_token_id=end, pad_token_id=end)
    rows = [row[ids.shape[1]:] for row in out.tolist()]
    return [row[:row.index(end)] if end in row else row for row in rows]


@pytest.mark.parametrize("extra,width,early", [
    ({"n": 2}, 2, False),
    ({"n": 2, "best_of": 3, "early_stopping": True}, 3, True),
], ids=["width-n", "width-best_of"])
def test_beam_search_returns_transformers_beams(server, hf, extra, width, early):
    """Prompt i's beam j is choice i * n + j, best first, equal to transformers' returned sequences; each
    beam's token log-probs are HF's log-softmax of its chosen tokens."""
    model, tok = hf
    resp = ok(server, completion(PROMPTS, 10, use_beam_search=True, logprobs=0, **extra))
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(PROMPTS):
        beams = hf_beams(model, tok, prompt, width, 2, 10, early)
        got = resp["choices"][2 * i:2 * i + 2]
        assert [c["text"] for c in got] == [tok.decode(b, skip_special_tokens=True) for b in beams]
        ids = tok(prompt).input_ids
        for c, beam in zip(got, beams, strict=True):
            with torch.no_grad():
                rows = torch.log_softmax(model(torch.tensor([ids + beam])).logits[0].float(), -1)
            expected = [float(rows[len(ids) - 1 + k, t]) for k, t in enumerate(beam)]
            assert c["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert resp["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in resp["choices"])


def test_chat_beam_search_answers_n_messages(server, hf):
    model, tok = hf
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def f():"}], "max_tokens": 6,
            "use_beam_search": True, "n": 2}
    resp = ok(server, body, "/v1/chat/completions")
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    texts = [c["message"]["content"] for c in resp["choices"]]
    assert all(isinstance(t, str) for t in texts) and texts[0] != texts[1]


def test_sampled_best_of_returns_the_children_with_the_highest_cumulative_logprob(server):
    """best_of 3 samples children seeded seed, seed+1, seed+2 (as three requests of their own) and answers the
    n whose generated tokens' log-probs sum highest, best first; without logprobs none are shown."""
    seed, body = 11, dict(temperature=1.0, ignore_eos=True)
    alone = [ok(server, completion(PROMPTS[0], 6, seed=seed + j, logprobs=0, **body))["choices"][0] for j in range(3)]
    cums = [sum(c["logprobs"]["token_logprobs"]) for c in alone]
    order = sorted(range(3), key=lambda j: -cums[j])
    assert len({round(c, 4) for c in cums}) == 3, cums  # distinct, so the ranking is meaningful
    one = ok(server, completion(PROMPTS[0], 6, seed=seed, best_of=3, **body))
    assert [c["text"] for c in one["choices"]] == [alone[order[0]]["text"]]
    assert one["choices"][0]["logprobs"] is None and one["choices"][0]["index"] == 0
    two = ok(server, completion(PROMPTS, 6, seed=seed, n=2, best_of=3, logprobs=0, **body))
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two["choices"][:2]] == [alone[j]["text"] for j in order[:2]]
    assert two["usage"]["completion_tokens"] == 24
    prompt_tokens = sum(ok(server, completion(p, 1))["usage"]["prompt_tokens"] for p in PROMPTS)
    assert two["usage"]["prompt_tokens"] == prompt_tokens  # each prompt counted once


@pytest.mark.parametrize("body,needle", [
    (completion(PROMPTS[0], 4, use_beam_search=True, n=2, best_of=4), "exceeds the engine's max_beam_width 3"),
    (completion(PROMPTS[0], 4, use_beam_search=True, n=2, stream=True), "stream=true with use_beam_search"),
    (completion(PROMPTS[0], 4, n=1, best_of=2, temperature=1.0, stream=True), "stream=true with best_of (2)"),
    (completion(PROMPTS[0], 4, use_beam_search=True, n=2, logprobs=2), "logprobs 2 with use_beam_search"),
    (completion(PROMPTS[0], 4, use_beam_search=True, n=2, logprobs=0, echo=True), "echo with logprobs"),
    (completion(PROMPTS[0], 4, use_beam_search=True, n=2, stop=["\n"]), "stop strings with use_beam_search"),
    (completion(PROMPTS[0], 4, use_beam_search=True, n=2, presence_penalty=0.5), "presence_penalty with beam"),
    (completion(PROMPTS[0], 4, n=3, best_of=2, temperature=1.0), "best_of (2) cannot be less than n (3)"),
], ids=["above-build", "stream-beams", "stream-best_of", "top-logprobs", "echo", "stop", "penalty", "best_of<n"])
def test_what_beams_cannot_serve_is_refused_in_one_line(server, body, needle):
    status, resp = request(server, "POST", "/v1/completions", body)
    assert status == 400 and needle in resp["message"] and "\n" not in resp["message"], resp
