"""`toolchain tune`'s search on constructed cases: the batch cap refined between grid points where the SLO binds,
and the LLM-API candidates dropped when they would refuse prompts the spec allows."""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.cli import main
from toolchain.slo import thresholds
from toolchain.spec import load_spec
from toolchain.tune.candidates import BATCH_GRID, Candidate, derive
from toolchain.tune.search import evaluate, search

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = REPO / "build" / "llama3-70b-tp4pp2.yaml"
LLAMA_8B_LLMAPI = REPO / "build" / "llama3-8b-llmapi-h100.yaml"


def tune(tmp_path: Path, spec: Path, *args: str) -> dict:
    assert main(["--root", str(tmp_path), "tune", str(spec), "--out", str(tmp_path / "out"), *args]) == 0
    return json.loads((tmp_path / "out" / "tune.json").read_text())


def refuses_long_prompts(c: dict, max_input_len: int) -> bool:
    return c["max_num_tokens"] < max_input_len and not c["chunked_context"]


def test_llmapi_candidates_that_would_refuse_allowed_prompts_are_dropped(tmp_path):
    """The PyTorch backend refuses a prompt longer than max_num_tokens without chunked prefill: the knob grid's
    2048-token budget under max_input_len 4096 is kept only chunked, as on the engine path."""
    doc = tune(tmp_path, LLAMA_8B_LLMAPI, "--gpus", "1")
    assert doc["candidates"]
    assert not [c["label"] for c in doc["candidates"] if refuses_long_prompts(c, 4096)]
    dropped = [c for c in doc["dropped_candidates"] if refuses_long_prompts(c, 4096)]
    assert dropped and all("llmapi.num-tokens-vs-input" in c["failed_checks"] for c in dropped)
    assert any(c["max_num_tokens"] == 2048 and c["chunked_context"] for c in doc["candidates"])


def test_the_batch_cap_is_refined_to_the_largest_that_meets_a_binding_slo():
    """Llama-3-70B on 8 H200s under the spec's TPOT bound of 60 ms: one GPU per replica meets it at batch 64 and
    misses it at 128, so the best cap lies between them; the search finds it, and one more sequence misses."""
    spec = load_spec(LLAMA_70B, ["gpu.name=H200 141GB", "gpu.memory_gib=null", "gpu.sm=null"])
    slo = thresholds(spec.validation.slo, [])
    result = search(spec, [spec], 8, slo, by_cost=False)
    best = result.ranked[0]
    batch = best.candidate.spec.limits.max_batch_size
    assert batch not in BATCH_GRID and 64 < batch < 128, best.candidate.label
    # full load is the best throughput's concurrency, at or just under the cap (the curve is flat near its top)
    assert best.kept and batch - 4 <= best.full_load["concurrency"] <= batch
    c = best.candidate
    one_more = evaluate(Candidate(derive(c.spec, {"limits.max_batch_size": batch + 1}), c.replicas, c.gpu_count), slo)
    assert not one_more.failed and "tpot_p99_ms" in one_more.slo_misses
    grid = next(e for e in result.ranked if e.candidate.knobs == {**c.knobs, "max_batch_size": 64})
    assert best.per_gpu() > 1.1 * grid.per_gpu()


QWEN3_MOE_LLMAPI = REPO / "build" / "qwen3-30b-a3b-ep2-h200.yaml"


def test_attention_dp_is_searched_on_and_off_for_a_moe_model_on_the_llmapi_path():
    """Qwen3-30B-A3B on two H200s: every tp 2 structure is searched with attention DP off and on, a single GPU
    only off (the spec refuses it at tp 1); a dense model and the engine path never get it."""
    from toolchain.tune.candidates import structures

    spec = load_spec(QWEN3_MOE_LLMAPI)
    found, refused = structures(spec, 2, None, False, moe=True)
    assert not [r for r in refused if "attention_dp" in r]
    by_tp = {tp: {c.spec.parallelism.attention_dp for c in found if c.spec.parallelism.tp == tp} for tp in (1, 2)}
    assert by_tp == {1: {False}, 2: {False, True}}
    on = [c for c in found if c.spec.parallelism.attention_dp]
    assert all("adp" in c.label and c.knobs["attention_dp"] for c in on)
    assert len({c.label for c in found}) == len(found)  # the label tells them apart (pass two's `seen`)
    assert not any(c.spec.parallelism.attention_dp for c in structures(spec, 2, None, False, moe=False)[0])
    engine = load_spec(QWEN3_MOE_LLMAPI, ["target=trtllm"])
    assert not any(c.spec.parallelism.attention_dp for c in structures(engine, 2, None, False, moe=True)[0])
    # The search reads `moe` from the model: both reach the plan, and an attention-DP candidate plans its own memory.
    slo = thresholds(spec.validation.slo, [])
    result = search(spec, [spec], 2, slo, by_cost=False)
    planned = [e for e in [*result.ranked, *result.dropped] if e.candidate.spec.parallelism.tp == 2]
    assert {e.candidate.spec.parallelism.attention_dp for e in planned} == {False, True}


def test_llama4_scout_example_plans_and_its_search_holds_attention_dp_both_ways():
    """The config-only Llama 4 Scout example on four H100s: every tp 4 structure is searched with attention DP off
    and on, and none of the structures is refused by the spec's validators."""
    from toolchain.tune.candidates import structures

    spec = load_spec(REPO / "build" / "llama4-scout-4xh100.yaml")
    found, refused = structures(spec, 4, None, False, moe=True)
    assert not refused
    tp4 = {c.spec.parallelism.attention_dp for c in found if c.spec.parallelism.tp == 4}
    assert tp4 == {False, True}


DEEPSEEK_R1 = REPO / "build" / "deepseek-r1-fp8-8xh200.yaml"


def test_deepseek_r1_plans_and_tune_searches_expert_parallelism_attention_dp_and_mtp(tmp_path, capsys):
    """The DeepSeek-R1 example (FP8 block scales as stored, attention DP, moe_ep 8, MTP on 8 H200) plans and predicts;
    tune searches each tp's expert parallelism (every moe_ep dividing it), attention DP off and on, and MTP off and on,
    and keeps the checkpoint's stored format (no candidate asks to quantize it again)."""
    from toolchain.tune.candidates import speculative_modes

    assert main(["--root", str(tmp_path / "ws"), "plan", str(DEEPSEEK_R1), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["failed_checks"] and report["performance"]["output_tokens_per_s"] > 0
    doc = tune(tmp_path, DEEPSEEK_R1, "--gpus", "8")
    every = doc["candidates"] + doc["dropped_candidates"]
    tp8 = [c for c in every if c["tp"] == 8]
    assert {(c["moe_ep"], c["attention_dp"], c["speculative"]) for c in tp8} == {
        (ep, adp, mode) for ep in (1, 2, 4, 8) for adp in (False, True) for mode in ("mtp", "none")}
    assert {c["quantization"] for c in every} == {"none"}
    kept = {(c["moe_ep"], c["attention_dp"], c["speculative"]) for c in doc["candidates"] if c["tp"] == 8}
    assert {mode for _, _, mode in kept} == {"mtp", "none"}
    # attention DP multiplies the sequences a replica holds (max_batch_size per rank): a layout tune does not keep
    # is dropped for what it predicts at that full load, never silently
    for c in doc["dropped_candidates"]:
        if c["tp"] == 8 and (c["moe_ep"], c["attention_dp"], c["speculative"]) not in kept:
            assert c["slo_misses"] or c["failed_checks"], c["label"]
    # MTP is offered for a model with MTP layers even where the spec has no mode, on the targets that run it
    plain = load_spec(DEEPSEEK_R1, ["speculative.mode=none"])
    assert speculative_modes(plain, mtp=True) == ["none", "mtp"] and speculative_modes(plain) == ["none"]
    engine = load_spec(LLAMA_70B)
    assert speculative_modes(engine, mtp=True) == ["none"]  # the engine path has no MTP
