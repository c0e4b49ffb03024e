"""`toolchain plan`: the example specs plan (table, commands, checks), the JSON
contract, exit codes 0 / 1 / 2, and --skip-check."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from toolchain.cli import main
from toolchain.engine import trtllm

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ["llama3-8b-awq-h100", "llama3-70b-sq-tp4pp2", "mistral-7b-fp8-l40s"]
# Deploys but would not speculate yet: plan refuses it (see test below).
NOT_YET = ["--skip-check", "spec.mode-runnable"]


def plan(tmp_path, spec: Path | str, *args) -> int:
    return main(["--root", str(tmp_path), "plan", str(spec), *args])


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_plan_as_json(tmp_path, capsys, name):
    assert plan(tmp_path, REPO / "build" / f"{name}.yaml", "--json") == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is True and report["ok"] is True and report["failed_checks"] == []
    for rank in report["ranks"]:
        assert {"rank", "weights_bytes", "kv_bytes_per_token", "kv_tokens_capacity"} <= set(rank)
        assert rank["weights_bytes"] > 0 and rank["kv_tokens_capacity"] > 0
    assert len(report["ranks"]) == report["parallelism"]["world_size"]
    assert all({"id", "status", "message"} == set(c) for c in report["checks"])
    assert not [c for c in report["checks"] if c["status"] == "fail"]
    assert report["build_commands"]
    for line in report["build_commands"]:
        argv = shlex.split(line)
        if report["parallelism"]["world_size"] > 1:  # one MPI process per rank, whatever this PATH holds
            assert argv[:2] == ["mpirun", "--allow-run-as-root"]
            argv = argv[argv.index("trtllm-build"):]
        assert argv[0] == "trtllm-build"
        trtllm.validate(argv[1:])  # every flag and value from the 1.2 table
    assert report["launch_command"].split()[0] in ("mpirun", "TRTLLM_ORCHESTRATOR=1")
    assert report["eos"]["end_id"] is not None


def test_example_quantization_reaches_the_plan(tmp_path, capsys):
    expected = {"llama3-8b-awq-h100": ("W4A16_AWQ g128", "float16"),
                "llama3-70b-sq-tp4pp2": ("W8A8_SQ_PER_CHANNEL", "int8"),
                "mistral-7b-fp8-l40s": ("FP8", "fp8"),
                "qwen2.5-7b-draft-target": ("no weight quantization", "bfloat16")}
    for name, (fmt, kv) in expected.items():
        assert plan(tmp_path, REPO / "build" / f"{name}.yaml", "--json", *NOT_YET) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["weight_format"], report["kv_cache_dtype"]) == (fmt, kv), name
    assert report["draft_kv_tokens_capacity"] > 0
    assert len(report["build_commands"]) == 2 and "--speculative_decoding_mode draft_tokens_external" in \
        report["build_commands"][0] and "--speculative_decoding_mode" not in report["build_commands"][1]


def test_draft_target_example_plans_and_headless_modes_are_refused(tmp_path, capsys):
    """Draft-target runs through the BLS's draft -> target loop, so its example plans; Medusa
    without heads and EAGLE without a draft checkpoint have nothing to draft with: plan fails
    with one line naming what is missing. Lookahead runs on GPU engines only."""
    spec = REPO / "build" / "qwen2.5-7b-draft-target.yaml"
    assert plan(tmp_path, spec, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed_checks"] == []
    assert {c["id"]: c["status"] for c in report["checks"]}["spec.mode-runnable"] == "pass"
    for mode, check in (("medusa", "spec.medusa-heads"), ("eagle", "spec.eagle-draft")):
        assert plan(tmp_path, REPO / "build" / "llama3-8b-awq-h100.yaml", "--set", f"speculative.mode={mode}",
                    "--set", "speculative.max_draft_len=4", "--json") == 1
        failed = json.loads(capsys.readouterr().out)["failed_checks"]
        assert check in failed, (mode, failed)
    assert plan(tmp_path, REPO / "build" / "tiny-llama.yaml", "--set", "speculative.mode=lookahead",
                "--set", "speculative.max_draft_len=4", "--json") == 1
    assert "spec.mode-runnable" in json.loads(capsys.readouterr().out)["failed_checks"]
    assert plan(tmp_path, REPO / "build" / "llama3-8b-awq-h100.yaml", "--set", "speculative.mode=lookahead",
                "--set", "speculative.max_draft_len=4", "--json") in (0, 1)
    assert "spec.mode-runnable" not in json.loads(capsys.readouterr().out)["failed_checks"]


def test_text_output_has_table_commands_and_checks(tmp_path, capsys):
    assert plan(tmp_path, REPO / "build" / "llama3-70b-sq-tp4pp2.yaml") == 0
    out = capsys.readouterr().out
    assert "rank  tp  pp  layers" in out and "KV B/token" in out and "estimates" in out
    assert "\n  mpirun --allow-run-as-root -n 8 bash -c " in out and " trtllm-build --checkpoint_dir" in out
    assert "--use_paged_context_fmha disable" in out
    assert "\nlaunch:\n  mpirun --allow-run-as-root" in out and out.count(" : -n 1 ") == 7
    assert "PASS  kv.int8-disables-paged-fmha" in out and "verdict: fits" in out


def test_tiny_llama_plans_clean(tmp_path, capsys):
    assert plan(tmp_path, REPO / "build" / "tiny-llama.yaml") == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "target cpu" in out


def test_not_fitting_exits_1_with_the_change_that_fits(tmp_path, capsys):
    rc = plan(tmp_path, REPO / "build" / "llama3-8b-awq-h100.yaml", "--set", "model.checkpoint=configs/llama-3-70b",
              "--set", "quantization.method=none", "--json")
    captured = capsys.readouterr()
    assert rc == 1
    report = json.loads(captured.out)
    assert report["fits"] is False and "memory.fits" in report["failed_checks"]
    assert "parallelism.tp=2" in report["suggestions"]
    assert captured.err.startswith("error: plan:") and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("override, fragment", [
    ("gpu.name=R100", "unknown gpu.name 'R100'"),
    ("gpu.nmae=H100", "unknown key 'gpu.nmae'"),
    ("build.tokens_per_block=48", "power of 2"),
    ("speculative.mode=medusa2", "invalid 'speculative.mode'"),
])
def test_invalid_spec_exits_2(tmp_path, capsys, override, fragment):
    assert plan(tmp_path, REPO / "build" / "llama3-8b-awq-h100.yaml", "--set", override) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_plan_over_an_engine_built_at_another_tp_warns_it_will_be_rebuilt(tmp_path, capsys):
    """Issue 33: `plan --set parallelism.tp=4` in a workspace built at tp 2 plans the tp-4 deployment (build-engine
    rebuilds the engine for it) with a warning, instead of failing on the old engine; model-repo, which serves the
    engine as it is, still refuses it."""
    tiny = REPO / "build" / "tiny-llama.yaml"
    assert main(["--root", str(tmp_path), "build-engine", str(tiny)]) == 0
    capsys.readouterr()
    assert plan(tmp_path, tiny, "--set", "parallelism.tp=4", "--json") == 0, capsys.readouterr().err
    checks = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    engine = checks["triton.engine-dir"]
    assert engine["status"] == "warn", engine
    assert "(world size 2, the spec 4)" in engine["message"] and "will rebuild it" in engine["message"]
    assert checks["triton.world-size"]["status"] == "skip"
    assert plan(tmp_path, tiny) == 0  # the spec it was built for: checked against the engine, which passes
    assert "PASS  triton.world-size" in capsys.readouterr().out
    assert main(["--root", str(tmp_path), "model-repo", str(tiny), "--set", "parallelism.tp=4"]) == 2
    assert "preflight check triton.engine-dir failed" in capsys.readouterr().err


def test_skip_check_turns_a_failure_into_a_skip(tmp_path, capsys):
    spec = REPO / "build" / "llama3-8b-awq-h100.yaml"
    assert plan(tmp_path, spec, "--set", "build.host_memory_gib=1") == 1
    assert "FAIL  build.host-ram" in capsys.readouterr().out
    assert plan(tmp_path, spec, "--set", "build.host_memory_gib=1", "--skip-check", "build.host-ram") == 0
    assert "skipped by --skip-check" in capsys.readouterr().out
    assert plan(tmp_path, spec, "--skip-check", "no.such-check") == 2
    assert "unknown check id 'no.such-check'" in capsys.readouterr().err


def test_trtllm_spec_without_gpu_reports_weights_but_fails(tmp_path, capsys):
    rc = plan(tmp_path, REPO / "build" / "llama3-70b-sq-tp4pp2.yaml", "--set", "gpu.name=null", "--json")
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["failed_checks"] == ["gpu.known"]
    assert report["ranks"][0]["weights_bytes"] > 0 and report["ranks"][0]["kv_tokens_capacity"] is None


def test_a_draft_with_another_tokenizer_is_refused_before_conversion(tmp_path, capsys):
    """Same vocabulary size, two tokens swapped: the draft's ids would mean other text."""
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(REPO / "models" / "tiny-llama-draft", draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    spec = REPO / "build" / "tiny-llama-draft-target.yaml"
    assert plan(tmp_path, spec, "--json") == 0
    capsys.readouterr()
    assert plan(tmp_path, spec, "--set", f"speculative.draft_model={draft}", "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["failed_checks"] == ["spec.draft-model"]
    detail = next(c for c in report["checks"] if c["id"] == "spec.draft-model")
    assert "tokenizer differs" in detail["message"]
    assert f"{a!r} is {vocab[b]} in the target, {vocab[a]} in the draft" in detail["message"]


def test_llmapi_example_plans_with_its_launch_lines_and_no_build(tmp_path, capsys):
    from toolchain.upstream import facts

    assert plan(tmp_path, REPO / "build" / "llama3-8b-llmapi-h100.yaml", "--json") == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is True and report["ok"] is True and report["failed_checks"] == []
    assert (report["weight_format"], report["kv_cache_dtype"]) == ("FP8", "fp8")
    assert report["build_commands"] == [] and "LLM-API" in report["build_note"]
    # serving.host 0.0.0.0: upstream's launcher cannot pass the restriction, so the line is what it runs
    # (mpirun -n 1 tritonserver ...) with the addresses and the admin key's shell reference.
    launcher = shlex.split(report["launch_command"])
    flags = facts("llmapi")["launch_flags"]
    assert launcher[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]
    assert launcher[4] == flags["--tritonserver"]["default"] and "--http-address=0.0.0.0" in launcher
    assert any(a.startswith("--http-restricted-api=") and "${TRITON_ADMIN_KEY:?" in a for a in launcher)
    serve = shlex.split(report["openai_command"])
    assert serve[0] == "trtllm-serve" and serve[serve.index("--port") + 1] == "8080"
    ids = {c["id"] for c in report["checks"]}
    assert {"llmapi.options", "llmapi.quantization", "llmapi.speculative"} <= ids and "build.host-ram" not in ids


def test_a_percentile_slo_is_said_to_be_judged_on_the_predicted_mean(tmp_path, capsys):
    """Plan's model predicts mean TTFT/TPOT: the spec's p99 bounds are printed beside the mean they are judged on,
    saying so; a bound on the mean itself needs no such word, and a rate is said to be unpredicted."""
    spec = REPO / "build" / "llama3-70b-tp4pp2.yaml"  # slo: ttft_p99_ms 2000, tpot_p99_ms 60
    assert plan(tmp_path, spec, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    perf, slo = report["performance"], report["slo"]
    assert slo["thresholds"]["ttft_p99_ms"] == {"limit": 2000.0, "predicted_mean": perf["ttft_ms"],
                                                "met": perf["ttft_ms"] <= 2000}
    assert slo["thresholds"]["tpot_p99_ms"]["predicted_mean"] == perf["tpot_ms"]
    assert slo["judged_on"].startswith("ttft_p99_ms, tpot_p99_ms judged on the predicted mean")
    assert plan(tmp_path, spec) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  slo: "))
    assert f"ttft_p99_ms <= 2000 judged on the predicted mean {perf['ttft_ms']:,.2f} ms: met" in line
    assert "no percentiles" in line
    assert plan(tmp_path, spec, "--set", "validation.slo.ttft_p99_ms=null", "--set", "validation.slo.tpot_p99_ms=null",
                "--set", "validation.slo.extra=[ttft_mean_ms<=1,goodput_fraction>=0.9]") == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  slo: "))
    assert "ttft_mean_ms <= 1 judged on the predicted mean" in line and ": MISSED" in line
    assert "not predicted: goodput_fraction" in line and "percentiles" not in line
