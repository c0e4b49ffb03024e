"""Disaggregated serving (issue 39 item 5): the prediction of a prefill/decode split (plan/perf/disagg.py) on
Llama-3-8B and Llama-3.1-70B configs, with properties that would fail if the model were wrong: the KV transfer
grows with the prompt and is slower over the NIC than over NVLink and sits inside TTFT, a decode-bound split
scales with its decode workers and a prefill-bound one does not, and a prompt the prefill workers cannot take is
refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from toolchain.checks.preflight import build_context
from toolchain.errors import ToolchainError
from toolchain.plan.perf.disagg import NIC, Split, kv_transfer_seconds, point, predict_disagg
from toolchain.spec import load_spec
from toolchain.dynamo.roles import role_of

REPO = Path(__file__).resolve().parents[1]
LLAMA_8B_LLMAPI = REPO / "build" / "llama3-8b-llmapi-h100.yaml"
# The shipped spec's beta llmapi.options key and n-gram speculation are not what these tests are about.
PLAIN = ["llmapi.options={}", "speculative.mode=none"]


def role(overrides: list[str], workers: int = 1):
    spec = load_spec(LLAMA_8B_LLMAPI, [*PLAIN, *overrides])
    ctx = build_context(spec, "plan")
    return role_of(spec, ctx.model, ctx.quant, ctx.device, ctx.memory, workers)


def split(isl: int, osl: int, *, prefill=None, decode=None, chunked: bool = True, same_node: bool = True) -> Split:
    return Split(prefill or role([]), decode or role(["limits.max_batch_size=256"]), isl, osl, chunked, 32, same_node)


def test_the_kv_transfer_grows_with_the_prompt_and_is_slower_over_the_nic():
    """ISL x KV bytes per token over the link: Llama-3-8B with an FP8 KV cache holds 2 x 32 layers x 8 KV heads x
    128 x 1 byte = 65,536 bytes per token on one GPU, so 4,096 tokens move 268 MB: the byte term is linear in ISL
    and nine times longer over a 50 GB/s NIC than over 450 GB/s of NVLink."""
    one = split(1024, 128)
    assert one.prefill.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1
    t = {isl: kv_transfer_seconds(dataclasses.replace(one, isl=isl)) for isl in (1024, 2048, 4096)}
    assert t[1024] < t[2048] < t[4096]
    assert t[4096] - t[1024] == pytest.approx(3 * (t[2048] - t[1024]), rel=1e-9)  # linear in ISL
    nic = {isl: kv_transfer_seconds(dataclasses.replace(one, isl=isl, same_node=False)) for isl in (1024, 4096)}
    assert nic[4096] - nic[1024] == pytest.approx((t[4096] - t[1024]) * one.prefill.dep.gpu.link.gb_s / NIC.gb_s)
    # the bytes of the larger shard per rank: a tp 2 decode worker receives half per GPU, a tp 1 prefill sends all
    wide = split(4096, 128, decode=role(["parallelism.tp=2", "limits.max_batch_size=256"]))
    assert wide.decode.kv_bytes_per_token == wide.prefill.kv_bytes_per_token // 2
    assert kv_transfer_seconds(wide) == pytest.approx(t[4096])


def test_ttft_carries_the_transfer():
    """At concurrency 1 nothing queues: TTFT moves by exactly the transfer's difference between the links, and
    holds the prompt's compute and the transfer both."""
    near, far = split(4096, 128), split(4096, 128, same_node=False)
    a, b = predict_disagg(near, 1), predict_disagg(far, 1)
    moved = b["disaggregated"]["kv_transfer_ms"] - a["disaggregated"]["kv_transfer_ms"]
    assert moved > 3.0  # 268 MB over 50 GB/s x the link efficiency
    assert b["ttft_ms"] - a["ttft_ms"] == pytest.approx(moved, abs=0.02)
    pre = a["disaggregated"]["prefill"]
    assert a["ttft_ms"] >= pre["compute_ms"] + a["disaggregated"]["kv_transfer_ms"]
    assert a["tpot_ms"] == b["tpot_ms"]  # the decode does not see the link


def test_a_decode_bound_split_scales_with_its_decode_workers():
    """Short prompts and long answers: one prefill worker outruns the decode workers, so a second decode worker
    doubles the throughput (the same batch per worker, twice the workers) and the GPUs it costs; with long prompts
    and short answers the prefill binds and more decode workers add nothing but GPUs."""
    pre4 = role([], workers=1)
    one = split(128, 1024, prefill=pre4, decode=role(["limits.max_batch_size=64"], workers=1))
    two = dataclasses.replace(one, decode=dataclasses.replace(one.decode, workers=2))
    a, b = predict_disagg(one, 64), predict_disagg(two, 64)
    assert a["disaggregated"]["bottleneck"] == b["disaggregated"]["bottleneck"] == "decode"
    assert b["max_output_tokens_per_s"] == pytest.approx(2 * a["max_output_tokens_per_s"], rel=1e-3)
    assert b["batch_size_at_max"] == 2 * a["batch_size_at_max"]
    long_prompts = dataclasses.replace(one, isl=8000, osl=16)
    more = dataclasses.replace(long_prompts, decode=dataclasses.replace(one.decode, workers=3))
    c, d = predict_disagg(long_prompts, 64), predict_disagg(more, 64)
    assert c["disaggregated"]["bottleneck"] == d["disaggregated"]["bottleneck"] == "prefill"
    assert d["max_output_tokens_per_s"] == pytest.approx(c["max_output_tokens_per_s"], rel=1e-6)
    assert d["per_gpu_output_tokens_per_s"] < c["per_gpu_output_tokens_per_s"]


def test_load_queues_at_the_prefill_workers():
    """The M/D/1 wait at the offered rate: TTFT rises with the concurrency once the prefill workers fill, while a
    second prefill worker takes half the rate and shortens the wait."""
    s = split(4096, 64, decode=role(["limits.max_batch_size=256"], workers=2))
    light, heavy = point(s, 1), point(s, 64)
    assert light.queue_s == 0.0  # one request in a closed loop finds none ahead of it
    assert heavy.ttft_s > 2 * light.ttft_s and heavy.queue_s > 0
    doubled = dataclasses.replace(s, prefill=dataclasses.replace(s.prefill, workers=2))
    assert point(doubled, 64).ttft_s < heavy.ttft_s


def test_a_prompt_the_prefill_workers_cannot_take_is_refused():
    """Without chunked prefill a prompt longer than the prefill workers' max_num_tokens is refused in one line;
    with it the prompt runs in chunks, one prompt per worker at a time."""
    short = role(["limits.max_num_tokens=2048", "limits.max_input_len=2048"])
    with pytest.raises(ToolchainError) as err:
        predict_disagg(split(4096, 128, prefill=short, chunked=False), 1)
    assert "max_num_tokens 2048" in err.value.message and "\n" not in str(err.value)
    chunked = predict_disagg(split(4096, 128, prefill=short), 1)["disaggregated"]["prefill"]
    whole = predict_disagg(split(4096, 128), 1)["disaggregated"]["prefill"]
    assert chunked["prompts_per_iteration"] == 1 and whole["prompts_per_iteration"] == 2
    assert chunked["compute_ms"] > whole["compute_ms"] * 0.99  # its chunks re-read the cache before them


def test_the_decode_batch_is_held_to_what_its_kv_cache_holds():
    """The decode limit is min(max_batch_size, the full sequences of its KV pool): a small KV share binds it."""
    small = role(["limits.max_batch_size=512", "serving.kv_cache_free_gpu_mem_fraction=0.05"])
    out = predict_disagg(split(4096, 1024, decode=small), 16)
    assert out["batch_limited_by"] == "kv_cache"
    assert out["batch_limit"] == small.kv_tokens // (4096 + 1024)
