"""Log-probabilities and context logits from the CPU engine (logprobs.py): "raw" values equal HF transformers'
log_softmax on the same tokens within 1e-4 (generated tokens, their top-k alternatives, prompt positions and the
context logits), alone and batched with other requests under chunked context; "sampled" values follow TensorRT-LLM's
C++ runtime (0.0 for greedy; the full softmax's at temperature 1 with top_p 1)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine_cpu_batcher import TIMEOUT, Collector
from test_engine_cpu_util import _one_thread, engine_dir, hf_logits, hf_model, load_engine  # noqa: F401

from toolchain.engine.cpu import CpuEngine, InflightBatcher, KvCacheConfig, SamplingParams, SchedulerConfig
from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.errors import ToolchainError

TOL = 1e-4
TPB = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama):
    return load_engine(tmp_path_factory, hf_llama, 1, 1)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 240 + 1 for i in range(n)]


def check_against_hf(hf, p: list[int], out: list[int], rec: TokenLogprobs, k: int) -> None:
    ref = torch.log_softmax(hf_logits(hf, p + out), -1)  # row i predicts token i + 1
    gen = ref[len(p) - 1:len(p) - 1 + len(out)]
    assert len(rec.tokens) == len(out)
    assert torch.allclose(torch.tensor(rec.tokens), gen[torch.arange(len(out)), torch.tensor(out)], atol=TOL)
    for row, top in zip(gen, rec.top, strict=True):
        values, ids = row.topk(k)
        assert [i for i, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values, atol=TOL)
    assert rec.cum == pytest.approx(float(gen[torch.arange(len(out)), torch.tensor(out)].sum()), abs=1e-3)


def check_prompt(hf, p: list[int], rec: TokenLogprobs, k: int) -> None:
    logits = hf_logits(hf, p)
    ref = torch.log_softmax(logits, -1)
    assert rec.prompt[0] is None and len(rec.prompt) == len(p)
    want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
    assert torch.allclose(torch.tensor(rec.prompt[1:]), want, atol=TOL)
    for row, top in zip(ref[:-1], rec.prompt_top[1:], strict=True):
        assert [i for i, _ in top] == row.topk(k).indices.tolist()
    assert rec.context_logits is not None and rec.context_logits.shape == logits.shape
    assert torch.allclose(rec.context_logits, logits, atol=TOL)


def test_raw_logprobs_equal_hf_log_softmax(engine, hf_llama):
    hf = hf_model(hf_llama)
    p = prompt(1, 11)
    rec = TokenLogprobs()
    out = engine.generate(p, SamplingParams(max_new_tokens=12, logprobs=3, prompt_logprobs=2,
                                            return_context_logits=True), logprobs=rec)
    check_against_hf(hf, p, out, rec, 3)
    check_prompt(hf, p, rec, 2)
    # sampled tokens too: the raw log-prob is the model's, whatever the sampler did
    rec = TokenLogprobs()
    out = engine.generate(p, SamplingParams(max_new_tokens=10, top_k=20, temperature=1.7, seed=3, logprobs=1,
                                            repetition_penalty=1.3), logprobs=rec)
    check_against_hf(hf, p, out, rec, 1)
    assert rec.prompt == [] and rec.context_logits is None


def test_sampled_mode_follows_the_cpp_runtime(engine, hf_llama):
    hf = hf_model(hf_llama)
    p = prompt(2, 9)
    rec = TokenLogprobs(mode="sampled")
    engine.generate(p, SamplingParams(max_new_tokens=6, logprobs=0), logprobs=rec)
    assert rec.tokens == [0.0] * 6 and rec.top == [[]] * 6  # greedy: all the mass on the pick
    rec, raw = TokenLogprobs(mode="sampled"), TokenLogprobs()
    params = SamplingParams(max_new_tokens=8, top_p=1.0, temperature=1.0, seed=5, logprobs=0)
    out = engine.generate(p, params, logprobs=rec)
    assert engine.generate(p, params, logprobs=raw) == out
    assert torch.allclose(torch.tensor(rec.tokens), torch.tensor(raw.tokens), atol=TOL)  # the full softmax
    check_against_hf(hf, p, out, raw, 0)
    rec = TokenLogprobs(mode="sampled")
    out = engine.generate(p, SamplingParams(max_new_tokens=8, top_k=5, temperature=1.0, seed=5, logprobs=0),
                          logprobs=rec)
    assert all(s > r - 1e-6 for s, r in zip(rec.tokens, raw.tokens, strict=False))  # renormalised over the top 5
    # "processed" (normalize_log_probs false): before the top-k cut, here (temperature 1, no penalty) the raw value
    top5 = SamplingParams(max_new_tokens=8, top_k=5, temperature=1.0, seed=5, logprobs=0)
    processed, raw = TokenLogprobs(mode="processed"), TokenLogprobs()
    assert engine.generate(p, top5, logprobs=processed) == engine.generate(p, top5, logprobs=raw)
    assert torch.allclose(torch.tensor(processed.tokens), torch.tensor(raw.tokens), atol=TOL)
    assert any(s > r + 1e-3 for s, r in zip(rec.tokens, raw.tokens, strict=True))
    with pytest.raises(ToolchainError, match="log-probability mode 'maybe'"):
        engine.start(p, SamplingParams(4, logprobs=0), logprobs=TokenLogprobs(mode="maybe"))


def test_batched_with_chunked_context_equals_hf(tmp_path_factory, hf_llama):
    hf = hf_model(hf_llama)
    engine = CpuEngine.load(engine_dir(tmp_path_factory, hf_llama, 1, 1, max_num_tokens=40, max_input_len=120,
                                       plugin_config={"tokens_per_block": TPB}),
                            kv_cache=KvCacheConfig(tokens_per_block=TPB))
    long_prompt, short_prompt, shared = prompt(7, 100), prompt(8, 6), prompt(9, 2 * TPB) + prompt(3, 5)
    engine.generate(shared, SamplingParams(4))  # its blocks sit in the cache: reuse would skip their logits
    col, gate = Collector(), threading.Event()
    recs = {name: TokenLogprobs() for name in ("long", "short", "shared")}
    with InflightBatcher(engine, SchedulerConfig(enable_chunked_context=True)) as b:
        b.submit("short", short_prompt, SamplingParams(30, logprobs=2), col.callback("short", gate),
                 logprobs=recs["short"])
        assert col.first_token["short"].wait(TIMEOUT)
        b.submit("long", long_prompt, SamplingParams(5, logprobs=2, prompt_logprobs=2, return_context_logits=True),
                 col.callback("long"), logprobs=recs["long"])
        b.submit("shared", shared, SamplingParams(5, logprobs=2, prompt_logprobs=2, return_context_logits=True),
                 col.callback("shared"), logprobs=recs["shared"])
        gate.set()
        col.wait()
        assert b.stats.chunked_steps > 0
    for name, p in (("long", long_prompt), ("short", short_prompt), ("shared", shared)):
        check_against_hf(hf, p, col.tokens(name), recs[name], 2)
    check_prompt(hf, long_prompt, recs["long"], 2)
    check_prompt(hf, shared, recs["shared"], 2)


def test_logprobs_are_recorded_before_the_callback(engine):
    seen = []
    rec = TokenLogprobs()
    done = threading.Event()

    def callback(tokens, finished, error):
        seen.append((len(tokens), len(rec.tokens)))
        if finished:
            done.set()

    with InflightBatcher(engine) as b:
        b.submit("a", prompt(4, 5), SamplingParams(6, logprobs=0), callback, logprobs=rec)
        assert done.wait(TIMEOUT)
    total = 0
    for n, recorded in seen:
        total += n
        assert recorded == total
