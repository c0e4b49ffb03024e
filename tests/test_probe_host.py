"""`toolchain probe-host` and the CPU predictions made from its profile (toolchain/hostprofile.py,
toolchain/engine/probe.py, plan/perf/host.py's HostRow, bench/prediction.py).

The cache: a profile is read back only under the key it was measured for, `--force` measures again. The model's
CPU terms are checked on a hand-made profile against sums done by hand. `toolchain plan` on a CPU spec with and
without a profile, and the bench report's `prediction` object with its >25% warning on a constructed level."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from toolchain import hostprofile as hp
from toolchain.bench import prediction as bp
from toolchain.cli import main
from toolchain.plan import perf
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY_SPEC = REPO / "build" / "tiny-llama.yaml"

# A hand-made host: round numbers, so every term below is a sum done by hand.
CURVES = {"fp32": {"1": 10.0, "100": 100.0}, "int8_wo": {"1": 20.0, "100": 50.0}}  # GFLOP/s by rows


def hand_profile(threads: int = 1, **changes) -> hp.HostProfile:
    profile = hp.HostProfile(hp.current_key(threads), "2026-01-02T03:04:05+00:00", 1.0, stream_gb_s=10.0,
                             cache_gb_s=40.0, cache_bytes=2_000_000, gemm_gflops=CURVES, attention_gb_s=2.0,
                             attention_gflops=20.0, step_us=1000.0, layer_us=100.0, sequence_us=50.0)
    return dataclasses.replace(profile, **changes)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache directory of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "trtllm-toolchain" / "host-profile"


# ------------------------------------------------------------------------------------------- the cache


def test_a_saved_profile_is_read_back_under_its_own_key(cache):
    assert hp.load_profile(1) is None
    path = hp.save_profile(hand_profile())
    assert path.parent == cache and path.name.startswith("threads1-")
    assert hp.load_profile(1) == hand_profile()
    assert hp.load_profile(2) is None  # another thread count is another profile


@pytest.mark.parametrize("what, value", [("engine_hash", "0123456789ab"), ("torch_version", "9.9.9"),
                                         ("cpu_model", "Another CPU"), ("usable_cores", 64)])
def test_a_changed_key_makes_the_profile_stale(cache, monkeypatch, what, value):
    hp.save_profile(hand_profile())
    monkeypatch.setattr(hp, what, lambda: value)
    assert hp.load_profile(1) is None


def test_a_profile_whose_recorded_key_differs_is_not_read(cache):
    path = hp.save_profile(hand_profile())
    data = json.loads(path.read_text())
    data["key"]["engine"] = "edited"  # the file sits under the current key's name but was measured for another
    path.write_text(json.dumps(data))
    assert hp.load_profile(1) is None
    path.write_text("{not json")
    assert hp.load_profile(1) is None


def test_engine_hash_follows_the_engine_code(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(hp, "ENGINE_DIR", tmp_path)
    first = hp.engine_hash()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert hp.engine_hash() != first


def test_probe_host_prints_a_cached_profile_without_measuring(cache, capsys, monkeypatch):
    hp.save_profile(hand_profile())
    import toolchain.engine.probe as probe

    monkeypatch.setattr(probe, "measure", None)  # calling it would fail: a cached profile is not measured again
    assert main(["probe-host"]) == 0
    out = capsys.readouterr().out
    assert "host profile (cached, 2026-01-02T03:04:05+00:00" in out
    assert "fixed costs: 1000 us per step, 100 us per layer per rank shard, 50 us per sequence" in out


def test_force_measures_again_and_caches(cache, capsys):
    hp.save_profile(hand_profile())
    assert main(["probe-host", "--force", "--json", "--no-serving"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["measured_now"] is True
    profile = hp.load_profile(1)
    assert profile is not None and profile.measured_at == shown["measured_at"] != hand_profile().measured_at
    assert profile.stream_gb_s > 0 and profile.cache_gb_s > 0 and profile.attention_gb_s > 0
    assert set(profile.gemm_gflops) == {"fp32", "bf16", "int8_wo", "int4_wo", "int8"}
    assert all(v > 0 for curve in profile.gemm_gflops.values() for v in curve.values())
    assert min(profile.step_us, profile.layer_us, profile.sequence_us) >= 0
    assert profile.step_us + profile.layer_us > 0  # a step costs something beyond its kernels
    # two gloo rank processes exchanged as the engine's ranks do: a fixed cost and a rate
    assert profile.gloo is not None and profile.gloo["gb_s"] > 0 and profile.gloo["latency_us"] >= 0
    assert Path(shown["path"]) == hp.profile_path(profile.key)


# ------------------------------------------------------------------------------------ the model's CPU terms


def test_gemm_rate_interpolates_in_log_rows():
    row = perf.host_row(hand_profile())
    assert row.gemm_tflops("fp32", 1) == pytest.approx(0.010)
    assert row.gemm_tflops("fp32", 10) == pytest.approx(0.055)  # halfway between 1 and 100 in log(rows)
    assert row.gemm_tflops("fp32", 1000) == pytest.approx(0.100)  # clamped past the last point
    assert row.gemm_tflops("bf16", 1) == pytest.approx(0.010)  # a precision not measured reads fp32's


def test_weights_that_fit_the_cache_are_read_at_its_rate():
    row = perf.host_row(hand_profile())
    assert row.weight_gb_s(1_000_000) == 40.0
    assert row.weight_gb_s(3_000_000) == 10.0


def test_host_step_time_by_hand():
    cost = perf.StageCost(layers=2, hidden=8, weight_bytes=1_000_000 + 8000, expert_bytes=0.0, experts=0,
                          expert_share=0.0, gemm_flops=2_000_000, lm_head_flops=4000, kv_bytes_per_token=1000,
                          attention_flops=400)
    row = perf.host_row(hand_profile())
    eff = perf.host_efficiency(hand_profile(), layers=2, shards=2)
    assert eff.fixed_us == 1000 + 100 * 2 * 2 and eff.seq_us == 50
    # A decode step of 1 sequence with 100 cached tokens, two shards in one process: the weights (2 x 1.008 MB)
    # fit the 2 MB cache? No: 2.016 MB > 2 MB, so memory's 10 GB/s.
    t = perf.host_step_time(cost, row, perf.generation_work(1, 100), math_precision="fp32", tp=2, eff=eff, shards=2)
    linears = 2_000_000 / 10e9     # compute: 200 us at 10 GFLOP/s for 1 row, over the weights' 100 us at 10 GB/s
    head = 8000 / 10e9             # memory: the lm_head's 4000 flops / 2 params x 4 bytes = 8000 bytes (0.4 us of FLOPs)
    attention = 101 * 1000 / 2e9   # memory: 100 cached + 1 new token's K/V at 2 GB/s (pairs: 2 us at 20 GFLOP/s)
    assert t.compute_s == pytest.approx(2 * linears)
    assert t.memory_s == pytest.approx(2 * (head + attention))
    assert t.fixed_s == pytest.approx((1400 + 50) * 1e-6)
    assert t.seconds == pytest.approx(2 * (linears + head + attention) + 1450e-6)  # one after another, not max()
    assert t.comm_s == 0.0  # shards in one process exchange nothing
    # 16 rows of int8 weight-only: the GEMM runs at 20 + (50 - 20) x log(16)/log(100) GFLOP/s
    t16 = perf.host_step_time(cost, row, perf.generation_work(16, 0), math_precision="int8_wo", tp=1, eff=eff,
                              shards=1)
    rate = (20 + 30 * math.log(16) / math.log(100)) * 1e9
    gemm = 16 * 2_000_000 / rate
    head16 = 16 * 4000 / ((10 + 90 * math.log(16) / math.log(100)) * 1e9)
    assert t16.compute_s == pytest.approx(gemm + head16)
    assert t16.memory_s == pytest.approx(16 * 1000 / 2e9)  # the new tokens' K/V written


def test_the_served_paths_costs_stand_in_for_the_engines_and_add_one_per_request(cache):
    spec = load_spec(TINY_SPEC)
    engine = perf.predict_spec(spec, concurrency=1, profile=hand_profile())
    serving = {"protocol": "triton-grpc", "step_us": 500.0, "sequence_us": 250.0, "request_us": 3000.0}
    served = perf.predict_spec(spec, concurrency=1, profile=hand_profile(serving=serving))
    assert served["basis"] == "host profile 2026-01-02 (serving: triton-grpc)"
    eff = perf.host_efficiency(hand_profile(serving=serving), layers=4, shards=2)
    # The served path's step and sequence costs stand in for the engine's (1000 and 50 us); the layers' stay.
    assert eff.fixed_us == 500 + 100 * 4 * 2 and eff.seq_us == 250
    # Alone, every step carries one sequence: 1.05 ms engine-only against 0.75 ms served, a token; the first token
    # also 3 ms for the request's way.
    assert served["tpot_ms"] == pytest.approx(engine["tpot_ms"] - 0.3, abs=2e-3)
    assert served["ttft_ms"] == pytest.approx(engine["ttft_ms"] - 0.3 + 3.0, abs=2e-2)


def test_requests_above_the_batch_limit_wait_by_littles_law(cache):
    hp.save_profile(hand_profile())
    spec = load_spec(TINY_SPEC)
    at8 = perf.predict_spec(spec, concurrency=8)
    at16 = perf.predict_spec(spec, concurrency=16)
    cycle_s = 32 / (at8["output_tokens_per_s"])  # one request's share of the batch's output rate, per token
    service_ms = at8["ttft_ms"] + 31 * at8["tpot_ms"]
    assert at16["tpot_ms"] == at8["tpot_ms"] and at16["output_tokens_per_s"] == at8["output_tokens_per_s"]
    assert at16["ttft_ms"] == pytest.approx(at8["ttft_ms"] + 16 * cycle_s * 1e3 - service_ms, rel=1e-3)  # of rounded figures
    assert any("wait for a slot" in n for n in at16["notes"])


def test_prompts_started_together_share_their_context_step(cache):
    # The closed loop's C requests start together: one iteration runs all C prompts, which each one's TTFT waits.
    hp.save_profile(hand_profile())
    spec = load_spec(TINY_SPEC)
    one, four = perf.predict_spec(spec, concurrency=1), perf.predict_spec(spec, concurrency=4)
    assert four["ttft_ms"] > one["ttft_ms"] * 1.5


# ------------------------------------------------------------------------------------------- plan


def test_plan_on_a_cpu_spec_without_a_profile_says_how_to_make_one(cache, tmp_path, capsys):
    main(["--root", str(tmp_path), "plan", str(TINY_SPEC)])
    out = capsys.readouterr().out
    assert "performance: no profile of this host for 1 engine thread(s): run `toolchain probe-host`" in out
    assert not cache.exists()  # plan never probes


def test_plan_on_a_cpu_spec_with_a_profile_predicts_from_it(cache, tmp_path, capsys):
    hp.save_profile(hand_profile())
    main(["--root", str(tmp_path), "plan", str(TINY_SPEC), "--json"])
    p = json.loads(capsys.readouterr().out)["performance"]
    assert p["predicted"] is True and p["basis"] == "host profile 2026-01-02 (engine only)"
    assert p["ttft_ms"] > 0 and p["tpot_ms"] > 0 and p["output_tokens_per_s"] > 0
    # TPOT at concurrency 4 is at least the fixed costs: 1000 + 100 x 4 layers x 2 shards + 4 x 50 us per step
    assert p["tpot_ms"] > 1.0 + 0.8 + 0.2
    main(["--root", str(tmp_path), "plan", str(TINY_SPEC)])
    assert "performance (host profile 2026-01-02 (engine only)):" in capsys.readouterr().out


def test_rank_processes_are_predicted_with_the_measured_exchange(cache, tmp_path, capsys):
    """serving.launch mpirun: the ranks are processes, each running its own shard, exchanging over gloo; without
    the exchange's figures plan says how to measure them."""
    ranks = REPO / "build" / "tiny-llama-ranks.yaml"
    hp.save_profile(dataclasses.replace(hand_profile(), gloo=None))
    main(["--root", str(tmp_path), "plan", str(ranks), "--json"])
    p = json.loads(capsys.readouterr().out)["performance"]
    assert p["predicted"] is False and "probe-host --force" in p["note"]
    # the served exchange's fixed cost (probe_ranks) is the one a served rank pays, not two bare processes'
    slow, fast = ({"latency_us": 1.0, "gb_s": 100.0, "served_latency_us": 5000.0}, {"latency_us": 1.0, "gb_s": 100.0})
    tpot = {}
    for name, link in (("slow", slow), ("fast", fast)):
        hp.save_profile(dataclasses.replace(hand_profile(), gloo=link))
        main(["--root", str(tmp_path), "plan", str(ranks), "--json"])
        tpot[name] = json.loads(capsys.readouterr().out)["performance"]["tpot_ms"]
    # two all-reduces per layer, each paying the link's fixed cost: 5 ms x 2 x 4 layers more per step at least
    assert tpot["slow"] - tpot["fast"] >= 2 * 4 * 5.0 * 0.99


# ------------------------------------------------------------------------------------------- bench


def _level(concurrency: int, ttft: float, tpot: float, tokens_per_s: float) -> dict:
    return {"level": 0, "load": {"mode": "concurrency", "value": concurrency},
            "ttft_ms": {"mean": ttft, "p50": ttft}, "tpot_ms": {"mean": tpot, "p50": tpot},
            "output_tokens_per_s": tokens_per_s}


def test_bench_prediction_beside_the_measurement_and_its_warning(cache):
    hp.save_profile(hand_profile())
    spec = load_spec(TINY_SPEC)
    want = perf.predict_spec(spec, concurrency=4)
    close = bp.prediction(spec, [_level(4, want["ttft_ms"] * 1.2, want["tpot_ms"] * 0.9,
                                        want["output_tokens_per_s"])])
    assert close["predicted"] is True and close["basis"] == "host profile 2026-01-02 (engine only)" and close["concurrency"] == 4
    assert close["ttft_ms"] == want["ttft_ms"] and close["tpot_ms"] == want["tpot_ms"]
    assert close["ratio"]["ttft_ms"] == pytest.approx(1 / 1.2, abs=1e-3)
    assert close["ratio"]["tpot_ms"] == pytest.approx(1 / 0.9, abs=1e-3)
    assert close["ratio"]["output_tokens_per_s"] == pytest.approx(1.0, abs=1e-3)
    assert close["warnings"] == []

    far = bp.prediction(spec, [_level(4, want["ttft_ms"] * 2, want["tpot_ms"], want["output_tokens_per_s"])])
    assert len(far["warnings"]) == 1
    assert far["warnings"][0].startswith("prediction differs by more than 25%: TTFT predicted")
    assert "TPOT" not in far["warnings"][0]
    lines = bp.summary_lines(far)
    assert lines[0].startswith("predicted at concurrency 4 (host profile 2026-01-02 (engine only)): TTFT")
    assert lines[-1] == f"warning: {far['warnings'][0]}"


def test_bench_without_a_profile_says_so_once(cache):
    spec = load_spec(TINY_SPEC)
    pred = bp.prediction(spec, [_level(1, 10, 5, 100), {**_level(4, 10, 5, 100), "level": 1}])
    assert pred == {"predicted": False, "note": hp.missing_note(1)}
    assert bp.summary_lines(pred) == [f"prediction: none ({hp.missing_note(1)})"]


def test_rate_levels_are_not_predicted(cache):
    hp.save_profile(hand_profile())
    spec = load_spec(TINY_SPEC)
    level = {**_level(1, 10, 5, 100), "load": {"mode": "rate", "value": 2.0}}
    assert bp.prediction(spec, [level])["predicted"] is False


def test_help_says_how_long_a_probe_takes_and_what_it_measures():
    from click.testing import CliRunner

    from toolchain.cli.probe_host import command

    text = " ".join(CliRunner().invoke(command, ["--help"]).output.split())
    assert "it takes minutes (measured on a 2-core EPYC" in text and " s with --no-serving" in text
    for measured in ("memory bandwidth", "linear kernels per precision", "attention", "fixed costs",
                     "gloo exchange", "tritonserver", "tp-2 ranks under mpirun"):
        assert measured in text, measured
