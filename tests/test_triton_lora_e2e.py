"""Multi-LoRA through the real tritonserver with the CPU engine, as tensorrtllm_backend docs/lora.md serves it: a
float16 Llama built with the LoRA plugin, adapter 1 converted by `convert` into the lora_prefetch_dir (task id 1,
served by id from the first request), adapter 2 sent by a client as converted weights + config under its own task
id and then by id alone, base requests beside them, and an unknown id refused in the executor's words. Every answer
must be the CPU engine's own for the same adapter, through tensorrt_llm, the ensemble and the BLS."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import starts_server
from lora_helpers import make_peft_adapter
from triton_helpers import deploy, stream, text_request, token_request

pytest.importorskip("toolchain.engine.cpu.lora")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EOS = 2
PROMPT = [10, 20, 30, 40, 50]
N = 8
LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 128, "max_num_tokens": 256}
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SENT = 7  # adapter 2's task id, chosen by the client (not in the prefetch dir)
MISSING = "LoRA task 99 not found in cache. Please send LoRA weights with request"


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory, hf_llama_words):
    from toolchain.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE, convert_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    first = make_peft_adapter(hf_llama_words, root / "attn", ["q_proj", "v_proj"], seed=1, r=4)
    second = make_peft_adapter(hf_llama_words, root / "every", EVERY, seed=2, r=8, alpha=16)
    converted = convert_adapter(second, root / "every-converted", "float16")  # hf_lora_convert.py's default
    sent = (np.load(converted / WEIGHTS_FILE), np.load(converted / CONFIG_FILE))
    lora = {"adapters": {"attn": str(first)}, "max_lora_rank": 8,
            "target_modules": ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]}
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=LIMITS, lora=lora,
                              model={"checkpoint": str(hf_llama_words), "dtype": "float16"},
                              serving={"streaming": True})
    with server:
        yield spec, ws, server, sent


@pytest.fixture(scope="module")
def expected(served):
    """The CPU engine's own greedy tokens: base, the prefetched adapter (task 1) and the sent one (task SENT)."""
    from toolchain.engine.cpu import CpuEngine, SamplingParams

    spec, ws, _, (weights, config) = served
    engine = CpuEngine.load(ws.engine_dir(spec), lora_prefetch_dir=ws.lora_dir(spec))
    engine.lora.put(SENT, weights, config)
    out = {task: engine.generate(PROMPT, SamplingParams(max_new_tokens=N, end_id=-1, lora_task_id=task))
           for task in (None, 1, SENT)}
    assert len({tuple(v) for v in out.values()}) == 3, out  # each adapter changes the answer
    return out


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def _llm(server, task=None, weights=None, config=None, request_id="1"):
    extra = {"end_id": ([-1], "INT32")}
    if task is not None:
        extra["lora_task_id"] = ([task], "UINT64")
    if weights is not None:
        extra |= {"lora_weights": (weights[0], "FP16"), "lora_config": (config[0], "INT32")}
    return stream(server.grpc_url, "tensorrt_llm", token_request(PROMPT, N, stream=True, **extra),
                  request_id=request_id)


def test_adapters_by_id_by_weights_and_unknown(served, expected):
    _, _, server, (weights, config) = served
    base = _llm(server)
    assert not base.errors and base.tokens() == expected[None]
    # Weights and config without a task id are ignored, as utils.cc getLoraConfigFromTensors ignores them.
    ignored = _llm(server, weights=weights, config=config)
    assert not ignored.errors and ignored.tokens() == expected[None]
    # Adapter 1 was prefetched from the converted adapters: its id alone works from the first request.
    by_id = _llm(server, task=1)
    assert not by_id.errors and by_id.tokens() == expected[1]
    # Adapter 2: not cached yet; sent with its weights, then by id alone.
    missing = _llm(server, task=SENT)
    assert len(missing.errors) == 1 and missing.errors[0].message().endswith(
        f"LoRA task {SENT} not found in cache. Please send LoRA weights with request")
    sent = _llm(server, task=SENT, weights=weights, config=config)
    assert not sent.errors and sent.tokens() == expected[SENT]
    again = _llm(server, task=SENT)
    assert not again.errors and again.tokens() == expected[SENT]
    # An unknown id: the request alone fails, in the executor's words as the backend sends them.
    unknown = _llm(server, task=99)
    [error] = unknown.errors
    assert re.fullmatch(r"Executor failed process requestId \d+ due to the following error: " + re.escape(MISSING),
                        error.message()), error.message()
    # The others go on; a wrong adapter for the base is refused in one line.
    assert _llm(server, task=1).tokens() == expected[1]
    bad = _llm(server, task=8, weights=weights[:, :, :10], config=config)
    assert len(bad.errors) == 1 and "lora_weights has to few values" in bad.errors[0].message()
    assert "\n" not in bad.errors[0].message()


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_models_pass_the_adapter_through(served, expected, model):
    _, _, server, (weights, config) = served

    def text(task=None, **extra):
        if task is not None:
            extra["lora_task_id"] = ([task], "UINT64")
        return stream(server.grpc_url, model, text_request(_words(PROMPT), N, stream=False, end_id=([-1], "INT32"),
                                                           **extra))

    for task in (None, 1):
        got = text(task)
        assert not got.errors and got.texts() == [_words(expected[task])], task
    # A task id of its own per model: the first request of each puts the adapter, the second finds it cached.
    own = SENT + (10 if model == "ensemble" else 20)
    sent = text(own, lora_weights=(weights[0], "FP16"), lora_config=(config[0], "INT32"))
    assert not sent.errors and sent.texts() == [_words(expected[SENT])]
    assert text(own).texts() == [_words(expected[SENT])]
    unknown = text(99)
    assert len(unknown.errors) == 1 and MISSING in unknown.errors[0].message()
