"""Beam search on the LLM-API stand-in (`CpuLLM` built with max_beam_width 3, as LLM(max_beam_width=3) asks):
`use_beam_search` with n (and best_of as the beam width) answers transformers' beams in RequestOutput.outputs,
best first, with their cumulative log-probs; what the CPU engine cannot serve with beams is refused in one line."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TRAINED
from test_llmapi_outputs import PROMPT, generate, hf  # noqa: F401 - hf: the fixture
from test_openai_beams import hf_beams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama missing")]


@pytest.fixture(scope="module")
def llm():
    from toolchain.llmapi.cpu_llm import CpuLLM

    llm = CpuLLM(model=str(TINY_TRAINED), backend="pytorch", dtype="float32", max_batch_size=4, max_seq_len=256,
                 max_num_tokens=512, max_beam_width=3, kv_cache_config={"max_tokens": 2048})
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("sampling,width,early", [
    ({"n": 2, "early_stopping": 0}, 2, False),
    ({"n": 2, "best_of": 3}, 3, True),  # early_stopping None: the engine's 1
], ids=["width-n", "width-best_of"])
def test_beam_search_outputs_are_transformers_beams(llm, hf, sampling, width, early):  # noqa: F811
    model, tok = hf
    out = generate(llm, PROMPT, max_tokens=10, use_beam_search=True, logprobs=0, **sampling)
    beams = hf_beams(model, tok, PROMPT, width, 2, 10, early)
    assert [c.index for c in out.outputs] == [0, 1] and out.finished
    assert [c.token_ids for c in out.outputs] == beams
    assert [c.text for c in out.outputs] == [tok.decode(b, skip_special_tokens=True) for b in beams]
    ids = tok(PROMPT).input_ids
    for c in out.outputs:
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([ids + c.token_ids])).logits[0].float(), -1)
        values = [float(rows[len(ids) - 1 + k, t]) for k, t in enumerate(c.token_ids)]
        assert [next(iter(d.values())).logprob for d in c.logprobs] == pytest.approx(values, abs=1e-4)
        if c.finish_reason == "length":  # the end token's log-prob counts too when a beam ended on it
            assert c.cumulative_logprob == pytest.approx(sum(values), abs=1e-4)
    assert out.outputs[0].cumulative_logprob is not None


def test_what_beams_cannot_serve_is_refused_in_one_line(llm):
    from toolchain.llmapi.cpu_llm import LlmArgsError, SamplingParams

    cases = [({"use_beam_search": True, "n": 2, "best_of": 4}, {}, "exceeds the engine's max_beam_width 3"),
             ({"use_beam_search": True, "n": 2}, {"streaming": True}, "streaming with use_beam_search"),
             ({"n": 1, "best_of": 2, "temperature": 1.0, "top_p": 0.9}, {"streaming": True}, "best_of above n"),
             ({"use_beam_search": True, "n": 2, "presence_penalty": 0.5}, {}, "presence_penalty with beam search"),
             ({"use_beam_search": True, "n": 2, "stop": ["\n"]}, {}, "stop words with beam search")]
    for sampling, kwargs, needle in cases:
        with pytest.raises(LlmArgsError) as err:
            llm.generate_async(PROMPT, SamplingParams.from_kwargs(sampling), **kwargs)
        assert needle in str(err.value) and "\n" not in str(err.value), (sampling, err.value)
