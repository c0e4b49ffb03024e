"""benchmarks/prediction_parts/published.py: the issue's published set (release 0.17 on the engine path and release
1.0's Hopper points on the PyTorch path, together), per table and per path, the TP order of each group, and the
Blackwell FP4 points of release/1.2 and 1.0 reported apart; and release 1.0's Blackwell FP4 file itself."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.prediction_parts import published as pub
from toolchain import gpus
from toolchain.plan import calibration as cal

MIXES = {(128, 128), (128, 2048), (128, 4096), (500, 2000), (1000, 1000), (1000, 2000), (2048, 128),
         (2048, 2048), (5000, 500), (20000, 2000)}


def test_v1_0_blackwell_fp4_file_holds_the_forty_totals_as_published():
    doc = json.loads(cal.PUBLISHED_V1_0_BLACKWELL_FP4.read_text())
    assert doc["release"] == "1.0" and doc["path"] == "pytorch" and doc["per_gpu"] is False
    assert doc["commit"] == json.loads(cal.PUBLISHED_V1_0.read_text())["commit"]
    assert "Total Output Throughput (tokens/sec)" in doc["source"] and "NEVER fitted" in doc["use"]
    assert "nvidia/Llama-3.1-405B-Instruct-FP4" in doc["how_measured"] and "no row left out" in doc["kept"]
    points = cal.published_points(cal.PUBLISHED_V1_0_BLACKWELL_FP4)
    columns = {(pt.model, pt.gpu, pt.tp) for pt in points}
    assert columns == {("llama-3.1-70b", "B200 180GB", 1), ("llama-3.1-70b", "GB200 186GB", 1),
                       ("llama-3.1-405b", "B200 180GB", 4), ("llama-3.1-405b", "GB200 186GB", 4)}
    for column in columns:
        assert {(pt.isl, pt.osl) for pt in points if (pt.model, pt.gpu, pt.tp) == column} == MIXES, column
    assert all(pt.method == "nvfp4" and gpus.lookup(pt.gpu) for pt in points)
    by = {(pt.model, pt.gpu, pt.isl, pt.osl): pt.output_tokens_per_s for pt in points}
    assert by["llama-3.1-70b", "B200 180GB", 128, 128] == 11147  # the table's first and last cells
    assert by["llama-3.1-405b", "GB200 186GB", 20000, 2000] == 739


@pytest.fixture(scope="module")
def keys():
    return pub.published_keys()


def test_the_issues_set_is_both_hopper_tables_together(keys):
    assert keys["published_point_count"] == 131 + 60
    v017, v1_0 = pub.checked(cal.PUBLISHED), pub.checked(cal.PUBLISHED_V1_0)
    assert keys["published_median_abs_error_pct"] == pub.summary(v017 + v1_0)["median_abs_error_pct"]
    assert keys["published_v017_within_15pct_fraction"] == pub.summary(v017)["within_15pct_fraction"]
    assert keys["published_by_path"]["engine"] == pub.summary(v017)
    assert keys["published_by_path"]["pytorch"] == pub.summary(v1_0)
    share = sum(abs(c.error_pct) <= 15 for c in v017 + v1_0) / 191
    assert keys["published_within_15pct_fraction"] == round(share, 3)
    assert len(keys["published_v1_0_points"]) == 60


def test_blackwell_fp4_is_reported_apart_over_both_files(keys):
    assert keys["blackwell_fp4_published_by_table"]["release_1_2_per_gpu"]["points"] == 12
    assert keys["blackwell_fp4_published_by_table"]["release_1_0_totals"]["points"] == 40
    assert len(keys["blackwell_fp4_published_points"]) == 52
    assert not any(p["gpu"].startswith(("B", "GB")) for p in keys["published_v1_0_points"])


def test_tp_order_counts_the_groups_and_lists_a_broken_one(keys):
    order = keys["published_tp_order_kept"]
    assert order["groups"] == 27 and order["fraction"] == keys["published_tp_order_kept_fraction"]
    # swap two TPs' predictions in one group: that group, and only it, is broken
    rows = pub.checked(cal.PUBLISHED)
    group = [c for c in rows if (c.point.model, c.point.gpu, c.point.isl, c.point.osl)
             == ("llama-3.1-70b", "H100 80GB", 1000, 1000)]
    assert len({c.point.tp for c in group}) >= 2
    low, high = sorted(group, key=lambda c: c.point.output_tokens_per_s)[:2]
    swapped = [dataclasses.replace(c, predicted=high.predicted * 2) if c is low else c for c in rows]
    after = pub.tp_order(swapped)
    broken = [b for b in after["broken"] if b not in order["broken"]]
    assert after["groups"] == 27 and after["kept"] == order["kept"] - 1
    assert len(broken) == 1 and broken[0]["gpu"] == "H100 80GB" and broken[0]["path"] == "engine"
    assert broken[0]["tp_by_published"][0] == low.point.tp != broken[0]["tp_by_predicted"][0]
