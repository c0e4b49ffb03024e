"""The LLM-API stand-in (`CpuLLM`, for tensorrt_llm.LLM) serves what issue 37 asks of it: log-probabilities of
the generated and prompt tokens equal HF's log-softmax on the same tokens, penalties apply as TRT-LLM applies them,
and `guided_decoding` (GuidedDecodingParams) constrains the text through XGrammar. On the trained tiny Llama."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from conftest import TINY_TRAINED
from test_openai_outputs import TOL, _presence, greedy, log_softmax

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama missing")]

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm():
    from toolchain.llmapi.cpu_llm import CpuLLM

    llm = CpuLLM(model=str(TINY_TRAINED), backend="pytorch", dtype="float32", max_batch_size=4, max_seq_len=256,
                 max_num_tokens=512, kv_cache_config={"max_tokens": 2048}, guided_decoding_backend="xgrammar")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(TINY_TRAINED, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(str(TINY_TRAINED)))


def generate(llm, prompt, **sampling):
    from toolchain.llmapi.cpu_llm import SamplingParams

    done, outs = threading.Event(), []

    def on_output(out):
        if out.finished:
            outs.append(out)
            done.set()

    llm.generate_async(prompt, SamplingParams.from_kwargs(sampling), on_output=on_output)
    assert done.wait(120)
    assert outs[0].error is None, outs[0].error
    return outs[0]


def test_logprobs_and_prompt_logprobs_equal_hfs_log_softmax(llm, hf):
    model, tok = hf
    out = generate(llm, PROMPT, max_tokens=6, top_k=1, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    c = out.outputs[0]
    prompt = out.prompt_token_ids
    ids = prompt + c.token_ids
    assert c.token_ids == greedy(model, prompt, 6)
    ref = log_softmax(model, ids)
    assert len(c.logprobs) == 6
    for k, (t, pos) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + k]
        assert abs(pos[t].logprob - float(row[t])) < TOL
        top_ids = torch.topk(row, 2).indices.tolist()
        assert [i for i, lp in pos.items() if lp.rank is not None] == top_ids
    assert abs(c.cumulative_logprob - sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True))) < 1e-5
    assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(c.prompt_logprobs[j][prompt[j]].logprob - float(ref[j - 1][prompt[j]])) < TOL
    # Without logprobs, none (and no cumulative log-prob).
    plain = generate(llm, PROMPT, max_tokens=2, top_k=1).outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_presence_penalty_applies_as_trtllm_applies_it(llm, hf):
    model, tok = hf
    ids = tok.encode(PROMPT)
    got = generate(llm, PROMPT, max_tokens=12, top_k=1, ignore_eos=True, presence_penalty=1.5).outputs[0]
    assert got.token_ids == greedy(model, ids, 12, _presence(1.5))
    assert got.token_ids != greedy(model, ids, 12)


def test_guided_decoding_constrains_the_text(llm):
    from pydantic import BaseModel

    from toolchain.llmapi.cpu_llm import GuidedDecodingParams

    class Flag(BaseModel):
        on: bool

    out = generate(llm, PROMPT, max_tokens=40, temperature=0.0,
                   guided_decoding=GuidedDecodingParams(regex="[a-z]{2,4}_[0-9]"))
    assert re.fullmatch("[a-z]{2,4}_[0-9]", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    out = generate(llm, PROMPT, max_tokens=40, temperature=0.0, guided_decoding=GuidedDecodingParams(json=Flag))
    assert isinstance(Flag.model_validate_json(out.outputs[0].text).on, bool)


def test_a_grammar_xgrammar_rejects_is_refused_with_its_message(llm):
    from toolchain.llmapi.cpu_llm import GuidedDecodingParams, LlmArgsError, SamplingParams

    with pytest.raises(LlmArgsError, match="parenthesis is not closed"):
        llm.generate_async(PROMPT, SamplingParams(max_tokens=2, guided_decoding=GuidedDecodingParams(regex="(ab")))
    assert json.dumps(generate(llm, PROMPT, max_tokens=2).outputs[0].text)


def test_n_sampled_sequences_are_child_requests_seeded_seed_plus_j(llm):
    """RequestOutput.outputs[j] is sequence j, sampled as a request of its own with seed + j would be."""
    sampling = dict(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=0.95)
    out = generate(llm, PROMPT, n=3, seed=5, **sampling)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    alone = [generate(llm, PROMPT, seed=5 + j, **sampling).outputs[0].token_ids for j in range(3)]
    assert [c.token_ids for c in out.outputs] == alone and len({tuple(a) for a in alone}) > 1
    # best_of 3 above n 2: the two of those three with the highest cumulative log-prob, best first.
    scored = [generate(llm, PROMPT, seed=5 + j, logprobs=0, **sampling).outputs[0] for j in range(3)]
    best = sorted(scored, key=lambda c: -c.cumulative_logprob)[:2]
    out = generate(llm, PROMPT, n=2, best_of=3, seed=5, **sampling)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best] and [c.index for c in out.outputs] == [0, 1]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([c.cumulative_logprob for c in best], abs=1e-4)
    assert out.outputs[0].logprobs is None  # ranked by a record of their own, not shown
