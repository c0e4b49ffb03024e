"""Release 1.0's published Hopper FP8 Llama points (toolchain/plan/data/published_v1_0.json), the PyTorch path.

NVIDIA's perf-overview.md of v1.0 measured every point on trtllm-bench's PyTorch backend, with no engine built and
max_batch_size / max_num_tokens left to trtllm-bench's heuristic, so the check plans them on the LLM-API target
with the limits trtllm-bench sets there (plan/calibration.py `pytorch_bench_limits`). The 0.17 table stays on the
engine path, planned exactly as before its rows were tagged. Never fitted to."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from toolchain import gpus
from toolchain.errors import ToolchainError
from toolchain.plan import calibration as cal

MIXES = {(128, 128), (128, 2048), (128, 4096), (500, 2000), (1000, 1000), (1000, 2000), (2048, 128),
         (2048, 2048), (5000, 500), (20000, 2000)}


@pytest.fixture(scope="module")
def v1_0():
    """(point, predicted max output tokens/s of the replica, signed error in %) for every v1.0 point."""
    return [(pt, pred, (pred - pt.output_tokens_per_s) / pt.output_tokens_per_s * 100)
            for pt, pred in cal.published_check(cal.PUBLISHED_V1_0)]


def test_the_file_says_where_the_numbers_come_from_and_in_what_unit():
    doc = json.loads(cal.PUBLISHED_V1_0.read_text())
    assert doc["release"] == "1.0" and doc["path"] == "pytorch" and doc["per_gpu"] is False
    assert doc["commit"] == "00f37686aa854010d68bcbd0f4ab000221541ca6"
    assert doc["doc_path"] == "docs/source/performance/perf-overview.md"
    assert "Total Output Throughput (tokens/sec)" in doc["source"] and "not per GPU" in doc["unit"]
    assert "--backend pytorch" in doc["how_measured"] and "--kv_cache_free_gpu_mem_fraction 0.95" in doc["how_measured"]
    assert "NEVER fitted" in doc["use"]


def test_sixty_hopper_fp8_points_six_columns_of_ten_mixes():
    points = cal.published_points(cal.PUBLISHED_V1_0)
    assert len(points) == 60
    columns = {(pt.model, pt.gpu, pt.tp) for pt in points}
    assert columns == {("llama-3.1-8b", "H200 141GB", 1), ("llama-3.1-8b", "H100 80GB", 1),
                       ("llama-3.1-70b", "H200 141GB", 1), ("llama-3.1-70b", "H100 80GB", 2),
                       ("llama-3.1-405b", "H200 141GB", 8), ("llama-3.1-405b", "H100 80GB", 8)}
    for column in columns:
        assert {(pt.isl, pt.osl) for pt in points if (pt.model, pt.gpu, pt.tp) == column} == MIXES, column
    assert {pt.method for pt in points} == {"fp8"}
    assert all(pt.path == "pytorch" and pt.release == "1.0" and not pt.per_gpu for pt in points)
    assert all(gpus.lookup(pt.gpu) for pt in points)
    # two cells as the table prints them: 3.3 70B H100 TP2 1000/1000 and 3.1 405B H100 TP8 20000/2000
    by = {(pt.model, pt.gpu, pt.isl, pt.osl): pt.output_tokens_per_s for pt in points}
    assert by["llama-3.1-70b", "H100 80GB", 1000, 1000] == 4205
    assert by["llama-3.1-405b", "H100 80GB", 20000, 2000] == 345


def test_every_table_names_its_path_and_release_or_keeps_the_old_choice():
    assert all(pt.path == "engine" and pt.release == "0.17" for pt in cal.published_points(cal.PUBLISHED))
    # not tagged yet: their target stays chosen by format and family (the LLM API for all of them)
    for path in (cal.PUBLISHED_BLACKWELL_FP4, cal.PUBLISHED_MOE_FAMILIES):
        assert all(pt.path is None and cal.bench_target(pt) == "llmapi" for pt in cal.published_points(path))


def test_the_engine_tag_plans_the_0_17_points_exactly_as_before():
    for pt in cal.published_points(cal.PUBLISHED):
        untagged = dataclasses.replace(pt, path=None)
        assert cal.bench_target(pt) == cal.bench_target(untagged) == "trtllm"
        assert cal.published_limits(pt) == cal.published_limits(untagged) == cal.bench_build_limits(pt)


def test_pytorch_limits_follow_trtllm_bench_without_chunked_prefill():
    for pt in cal.published_points(cal.PUBLISHED_V1_0):
        batch, tokens = cal.bench_build_limits(pt)
        assert cal.published_limits(pt) == cal.pytorch_bench_limits(pt) == (batch, max(tokens, pt.isl + batch))
    # By hand, 8B FP8 on one H100 at 5000/500: (79.647 GiB - 8.03 GB of weights) x 0.95 over 65536 bytes of FP8
    # KV per token over 5500 tokens is 202.7 requests -> batch 32 x ceil(202.7 / 32) = 224, tokens 202.7 x 11 =
    # 2230 -> 2304; without chunked prefill forced up to max_isl + max_batch_size = 5000 + 224.
    point = cal.Published("llama-3.1-8b", "H100 80GB", "fp8", 1, 5000, 500, 3459.0, path="pytorch")
    assert cal.bench_build_limits(point) == (224, 2304)
    assert cal.pytorch_bench_limits(point) == (224, 5224)


def test_every_v1_0_point_plans_on_the_llmapi_target_and_fits_its_prompt(v1_0):
    for pt, pred, _ in v1_0:
        assert cal.bench_target(pt) == "llmapi"
        perf = cal.predict_published(pt)
        assert perf.max_output_tokens_per_s == pred > 0
        # the whole prompt fits a step (the engine path's 2048-token budget would not hold 20000 tokens)
        assert not [n for n in perf.notes if "max_num_tokens" in n or "refuse" in n], (pt, perf.notes)


def test_v1_0_prediction_error(v1_0):
    """Measured 2026-12-07 (before the kernel layer of issue 39): median |error| 18.1%, 24 of 60 points within
    +-15% and 35 within +-20%; 8B is under-predicted (-13% to -34% but for the long prompts), 405B on H100
    over-predicted most (+48.5% at 128/4096). A regression past these bounds fails."""
    errors = [e for _, _, e in v1_0]
    assert statistics.median(abs(e) for e in errors) <= 20
    assert sum(abs(e) <= 20 for e in errors) >= 33
    assert max(abs(e) for e in errors) <= 55


def test_a_table_with_an_unknown_path_is_refused_in_one_line(tmp_path):
    doc = json.loads(cal.PUBLISHED_V1_0.read_text())
    bad = tmp_path / "published_bad.json"
    bad.write_text(json.dumps({**doc, "path": "tensorrt"}))
    with pytest.raises(ToolchainError, match="path 'tensorrt' is not one of engine, pytorch"):
        cal.published_points(bad)
