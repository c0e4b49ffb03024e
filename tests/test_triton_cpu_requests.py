"""The CPU tensorrt_llm model's request extras (toolchain/triton/cpu_requests.py), without a server: guides read
from the guided-decoding inputs and refused where the model's guided_decoding_backend is off, the embedding bias,
the gather checks' one-line refusals, and how log-probs and context logits are split over streamed responses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.triton import cpu_requests


class Inputs:
    """What the model's _Inputs offers: get(name) -> numpy or None, and the batch size."""

    def __init__(self, batch=1, **tensors):
        self.batch, self.tensors = batch, tensors

    def get(self, name):
        return self.tensors.get(name)


def test_guides_are_read_per_row_and_refused_when_guided_decoding_is_off():
    inputs = Inputs(2, guided_decoding_guide_type=np.array([[b"regex"], [b"json"]], dtype=object),
                    guided_decoding_guide=np.array([[b"[ab]+"], [b""]], dtype=object))
    decoder = object()  # any decoder: these only read the inputs
    assert cpu_requests.guide(inputs, 0, decoder).kind == "regex"
    assert cpu_requests.guide(inputs, 0, decoder).text == "[ab]+"
    assert cpu_requests.guide(inputs, 1, decoder).kind == "json"
    assert cpu_requests.guide(Inputs(), 0, None) is None
    with pytest.raises(ValueError, match="guided decoding is not enabled for this model .* "
                                         "set serving.guided_decoding_backend: xgrammar"):
        cpu_requests.guide(inputs, 0, None)
    with pytest.raises(ValueError, match="guided_decoding_guide given without guided_decoding_guide_type"):
        cpu_requests.guide(Inputs(guided_decoding_guide=np.array([[b"x"]], dtype=object)), 0, decoder)


def test_guided_decoding_off_builds_no_decoder_and_on_needs_the_info_file():
    assert cpu_requests.guided_decoder({"guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}, 250) is None
    with pytest.raises(ValueError, match="needs xgrammar_tokenizer_info_path"):
        cpu_requests.guided_decoder({"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": ""}, 250)


def test_embedding_bias_rows_and_zeros():
    bias = np.zeros((2, 5), np.float32)
    bias[1, 3] = 2.5
    inputs = Inputs(2, embedding_bias=bias)
    assert cpu_requests.embedding_bias(inputs, 0) is None  # all zeros: no bias, as the preprocessing's default
    assert torch.equal(cpu_requests.embedding_bias(inputs, 1), torch.tensor([0, 0, 0, 2.5, 0]))


@pytest.mark.parametrize("what", ["generation", "context"])
def test_logits_need_the_engine_built_to_gather_them(what):
    cpu_requests.check_gathered({f"gather_{what}_logits": True}, what)
    with pytest.raises(ValueError, match=f"To return {what} logits, gather_{what}_logits must be enabled") as err:
        cpu_requests.check_gathered({}, what)
    assert "\n" not in str(err.value)


def test_streamed_log_probs_go_with_their_tokens_and_context_logits_with_the_first():
    rec = cpu_requests.logprob_record(True, True, normalize=True)
    assert rec.mode == "sampled" and cpu_requests.logprob_record(True, False, normalize=False).mode == "processed"
    assert cpu_requests.logprob_record(False, False, normalize=True) is None
    out = cpu_requests.LogprobOutputs(rec, log_probs=True, context_logits=True)
    rec.tokens += [-0.5, -1.0]
    rec.context_logits = torch.ones(3, 4)
    first = dict(out.outputs(2, streaming=True))
    assert first["output_log_probs"].tolist() == [[[-0.5, -1.0]]] and first["cum_log_probs"].tolist() == [[-1.5]]
    assert first["context_logits"].shape == (1, 3, 4)
    rec.tokens.append(-2.0)
    second = dict(out.outputs(1, streaming=True))
    assert second["output_log_probs"].tolist() == [[[-2.0]]] and second["cum_log_probs"].tolist() == [[-3.5]]
    assert "context_logits" not in second
    whole = dict(cpu_requests.LogprobOutputs(rec, True, False).outputs(9, streaming=False))
    assert whole["output_log_probs"].tolist() == [[[-0.5, -1.0, -2.0]]] and "context_logits" not in whole
    assert isinstance(rec, TokenLogprobs)
