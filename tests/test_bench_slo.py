"""SLO strings, thresholds from the spec, and their verdicts (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchain import slo as S
from toolchain.cli import main as cli_main
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec, spec_from_dict


@pytest.mark.parametrize("text, name, value", [
    ("ttft_p99_ms<=500", "ttft_p99_ms", 500.0),
    ("itl p99.9 <= 80 ms", "itl_p99_9_ms", 80.0),
    ("tpot:p90<0.05s", "tpot_p90_ms", 50.0),
    ("TTFT_P50_MS <= 12.5", "ttft_p50_ms", 12.5),
    ("send_lag_mean_ms<=1", "send_lag_mean_ms", 1.0),
    ("itl_per_token_p99_ms<=20", "itl_per_token_p99_ms", 20.0),
    ("ttft_sched_p99_ms<=700", "ttft_sched_p99_ms", 700.0),
])
def test_latency_thresholds_parse(text, name, value):
    t = S.parse_slo(text)
    assert (t.name, t.value, t.upper) == (name, value, True)
    assert t.metric == name.rsplit("_", 2)[0] + "_ms" or t.metric.endswith("_ms")


def test_rate_thresholds_are_lower_bounds():
    t = S.parse_slo("goodput_fraction >= 0.9")
    assert (t.name, t.value, t.upper, t.stat) == ("goodput_fraction", 0.9, False, None)
    assert t.holds(0.95) and not t.holds(0.5) and not t.holds(None)


@pytest.mark.parametrize("text", ["ttft_p99", "ttft_p99_ms>=5", "ttft_p42_ms<=1", "latency_p99_ms<=5",
                                  "ttft_p99_ms<=fast", "requests_per_s<=3", ""])
def test_bad_slo_strings_raise_one_line(text):
    with pytest.raises(ValueError) as err:
        S.parse_slo(text)
    assert "\n" not in str(err.value)


def test_thresholds_merge_spec_fields_extra_and_cli():
    spec = spec_from_dict({"validation": {"slo": {"ttft_p99_ms": 500, "extra": ["itl_p99_ms<=40"]}}}, Path("."))
    ths = {t.name: t.value for t in S.thresholds(spec.validation.slo, ["ttft_p99_ms<=300", "e2e_p50_ms<=900"])}
    assert ths == {"ttft_p99_ms": 300.0, "itl_p99_ms": 40.0, "e2e_p50_ms": 900.0}


def test_spec_rejects_a_bad_extra_slo(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("validation:\n  slo:\n    extra: ['ttft_p99 < soon']\n")
    with pytest.raises(ToolchainError, match=r"invalid 'validation.slo'.*does not parse") as err:
        load_spec(path)
    assert "\n" not in str(err.value)


def test_cli_rejects_a_bad_slo_before_any_load(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\n")
    assert cli_main(["bench", str(path), "--url", "127.0.0.1:1", "--slo", "ttft<=5"]) == 2
    err = capsys.readouterr().err
    assert "SLO 'ttft<=5' does not parse" in err and len(err.strip().splitlines()) == 1


def test_evaluate_and_request_meets():
    metrics = {"ttft_ms": {"p99": 40.0}, "itl_ms": {"p99": 90.0}, "goodput_fraction": 0.8, "errors": 0,
               "num_requests": 10}
    ths = [S.parse_slo("ttft_p99_ms<=50"), S.parse_slo("itl_p99_ms<=80"), S.parse_slo("goodput_fraction>=0.5")]
    res = S.evaluate(metrics, ths)
    assert res["passed"] is False
    assert res["ttft_p99_ms"]["passed"] and not res["itl_p99_ms"]["passed"] and res["goodput_fraction"]["passed"]
    # goodput judges per-request latencies; ITL bounds the level only; missing TPOT cannot be missed
    assert S.request_meets({"ttft": 45.0, "tpot": None}, ths + [S.parse_slo("tpot_p99_ms<=5")])
    assert not S.request_meets({"ttft": 55.0}, ths)
