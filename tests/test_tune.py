"""`toolchain tune`: the search's choices on constructed cases (fit, SLO, price), its one-line errors and SLO-miss
line, written specs that `toolchain plan` passes (paths, draft, replicas), the CPU ranking with and without a host
profile, the AIConfigurator cross-check columns from recorded reports, and one `--measure` run on the tiny model.

tests/tune/host-profile-epyc-2core.json is `toolchain probe-host` as measured on the 2-core development host
(its key is rewritten to this host's, so the test reads it whatever the host); tests/aiconfigurator/ holds
aiconfigurator 0.12.0's output (see tests/test_crosscheck.py), replayed through crosscheck.py's real parser."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from toolchain.cli import main
from toolchain.cli.tune import parse_slo_option
from toolchain import gpus
from toolchain import hostprofile as hp
from toolchain.errors import ToolchainError
from toolchain.plan import crosscheck
from toolchain.spec import load_spec
from toolchain.checks.preflight import build_context, run_checks
from toolchain.checks.render import report_dict
from toolchain.slo import thresholds
from toolchain.tune.candidates import layouts, structures
from toolchain.tune.report import render, spec_yaml, write
from toolchain.tune.search import cross_check, search

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = REPO / "build" / "llama3-70b-tp4pp2.yaml"
TINY = REPO / "build" / "tiny-llama.yaml"
PROFILE = REPO / "tests" / "tune" / "host-profile-epyc-2core.json"
AIC = REPO / "tests" / "aiconfigurator"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A user cache directory of its own, without a host profile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def save_recorded_profile(threads: int = 1) -> None:
    """The recorded profile (measured at one engine thread), keyed to this host and `threads` so load_profile
    reads it for them."""
    recorded = hp.HostProfile.from_dict(json.loads(PROFILE.read_text()))
    hp.save_profile(dataclasses.replace(recorded, key=hp.current_key(threads)))


def tune(tmp_path: Path, spec: Path, *args: str) -> int:
    return main(["--root", str(tmp_path), "tune", str(spec), "--out", str(tmp_path / "out"), *args])


def tune_json(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "tune.json").read_text())


def big_model_spec(tmp_path: Path) -> Path:
    """A Llama-shaped model of about 255B parameters (config only): its int4 weights (~128 GB) fit no 80 GB GPU
    alone, half of them fit one, and no larger format fits two."""
    ckpt = tmp_path / "big"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
        "intermediate_size": 53248, "num_hidden_layers": 80, "num_attention_heads": 128, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": 128001}))
    spec = tmp_path / "big.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "big", "target": "trtllm", "model": {"checkpoint": str(ckpt)},
        "gpu": {"name": "H100 80GB"},
        "limits": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 2048},
        "validation": {"workload": {"concurrency": 4, "input_tokens": 512, "output_tokens": 128}}}))
    return spec


def test_layouts_fill_the_gpus():
    assert sorted(layouts(4, on_cpu=False)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert all(tp * pp * r == 8 for tp, pp, r in layouts(8, on_cpu=False))
    assert all(r == 1 and tp * pp <= 2 for tp, pp, r in layouts(2, on_cpu=True))


def test_a_model_that_fits_only_at_two_gpus_is_never_proposed_on_one(tmp_path, capsys):
    spec = big_model_spec(tmp_path)
    assert tune(tmp_path, spec, "--gpus", "2") == 0, capsys.readouterr().err
    doc = tune_json(tmp_path)
    assert doc["candidates"], "some layout of two GPUs fits"
    assert all(c["tp"] * c["pp"] == 2 and c["replicas"] == 1 for c in doc["candidates"])
    assert {c["quantization"] for c in doc["candidates"]} <= {"int4_wo", "awq"}
    one_gpu = [c for c in doc["dropped_candidates"] if c["tp"] * c["pp"] == 1]
    assert one_gpu and all("memory.fits" in c["failed_checks"] for c in one_gpu)
    assert doc["dropped"]["memory.fits"] >= len(one_gpu)
    out = capsys.readouterr().out
    assert "do not fit (memory.fits)" in out.splitlines()[0]


def test_a_gpu_count_nothing_fits_is_one_line(tmp_path, capsys):
    assert tune(tmp_path, big_model_spec(tmp_path), "--gpus", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no tp x pp x replicas of 1 GPUs (H100 80GB) fits big")
    assert "memory.fits" in err[0]


def _search(spec, slo: list[str], gpus: int = 4, prices: tuple[float, ...] = ()):
    return search(spec, [spec], gpus, thresholds(spec.validation.slo, slo), by_cost=bool(prices))


def test_an_slo_only_one_layout_meets_picks_that_layout():
    """Whichever tp x pp the model predicts fastest to the first token, an SLO between it and the runner-up keeps
    that layout only, and every candidate dropped for the SLO misses it by its prediction."""
    spec = load_spec(LLAMA_70B, ["validation.slo.tpot_p99_ms=null", "validation.slo.ttft_p99_ms=null",
                                 "parallelism.gpus=4", "parallelism.tp=4", "parallelism.pp=1"])
    free = _search(spec, [])

    def worst_ttft(e) -> float:  # the SLO holds at the workload's share and at the batch of the maximum
        return max(e.performance["ttft_ms"], e.full_load["ttft_ms"])

    def layout(e) -> tuple[int, int]:
        return e.candidate.spec.parallelism.tp, e.candidate.spec.parallelism.pp

    best: dict[tuple[int, int], float] = {}
    for e in free.ranked:
        best[layout(e)] = min(best.get(layout(e), 1e9), worst_ttft(e))
    assert len(best) > 1, best
    (winner, first), (_, second) = sorted(best.items(), key=lambda kv: kv[1])[:2]
    assert first < second, best
    bound = (first + second) / 2
    result = _search(spec, [f"ttft_p99_ms<={bound}"])
    assert result.ranked and all(layout(e) == winner for e in result.ranked)
    assert all(worst_ttft(e) <= bound for e in result.ranked)
    assert result.drop_counts()["slo"] > 0
    missed = [e for e in result.dropped if e.slo_misses]
    assert missed and all(m["predicted"] > bound for e in missed for m in e.slo_misses.values())


def test_cost_ranking_flips_with_price(tmp_path, capsys):
    def best_gpu(h100: str, h200: str) -> str:
        assert tune(tmp_path, LLAMA_70B, "--gpus", "4", "--gpu", "H100", "--gpu", "H200",
                    "--gpu-hour-usd", h100, "--gpu-hour-usd", h200) == 0, capsys.readouterr().err
        doc = tune_json(tmp_path)
        assert doc["ranking"] == "usd_per_million_output_tokens"
        usd = [c["performance"]["usd_per_million_output_tokens"] for c in doc["candidates"]]
        assert usd == sorted(usd)
        return doc["candidates"][0]["gpu"]

    assert best_gpu("3", "3") == "H200 141GB"  # same price: the faster card is the cheaper per token
    assert best_gpu("3", "30") == "H100 80GB"


def test_nothing_meets_the_slo_names_the_closest(tmp_path, capsys):
    assert tune(tmp_path, LLAMA_70B, "--gpus", "8", "--gpu", "H200", "--slo", "tpot_p99_ms=0.5") == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("no candidate meets the SLO"))
    assert "closest: H200 " in line and "tpot_p99_ms " in line and "> 0.5 (+" in line
    doc = tune_json(tmp_path)
    assert doc["candidates"] == [] and doc["slo_miss"] == line and doc["specs"] == []


def test_written_specs_pass_plan(tmp_path, capsys):
    assert tune(tmp_path, LLAMA_70B, "--gpus", "8", "--gpu", "H200", "--top", "3") == 0, capsys.readouterr().err
    doc = tune_json(tmp_path)
    assert len(doc["specs"]) == 3 and (tmp_path / "out" / "pareto.png").stat().st_size > 0
    labels = doc["top"]
    by_label = {c["label"]: c["performance"] for c in doc["candidates"]}
    points = {(p["per_gpu_output_tokens_per_s"], p["ttft_ms"], p["tpot_ms"]) for p in map(by_label.get, labels)}
    assert len(points) == 3, "the top lists one candidate per prediction"
    assert labels[0] == doc["candidates"][0]["label"]
    for path, label in zip(doc["specs"], labels, strict=True):
        text = Path(path).read_text()
        assert label in text.splitlines()[0]
        capsys.readouterr()
        assert main(["--root", str(tmp_path), "plan", path, "--json"]) == 0, capsys.readouterr().out[-2000:]
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["device"]["name"] == "H200 141GB"
        written = load_spec(path)
        assert f"tp{written.parallelism.tp}pp{written.parallelism.pp}" in label
        assert f"w:{written.quantization.method} kv:{written.quantization.kv_cache}" in label


@pytest.mark.parametrize("text", ["ttft_p99_ms", "ttft_p99_ms=abc", "bogus_p99_ms=5", ","])
def test_malformed_slo_is_one_line(tmp_path, capsys, text):
    with pytest.raises(ToolchainError):
        parse_slo_option(text)
    assert tune(tmp_path, LLAMA_70B, "--slo", text) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_measure_on_a_gpu_target_is_one_line(tmp_path, capsys):
    assert tune(tmp_path, LLAMA_70B, "--measure") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--measure deploys on this host" in err


def test_unknown_gpu_and_gpu_on_cpu_are_one_line(tmp_path, capsys):
    assert tune(tmp_path, LLAMA_70B, "--gpu", "H300") == 2
    assert "unknown gpu.name 'H300'" in capsys.readouterr().err
    assert tune(tmp_path, REPO / "build" / "tiny-llama.yaml", "--gpu", "H200") == 2
    assert "runs on this host's CPU" in capsys.readouterr().err


def test_cpu_target_without_a_profile_orders_by_the_stated_rule(cache, tmp_path, capsys):
    assert tune(tmp_path, TINY, "--top", "2") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "run `toolchain probe-host` to rank by prediction; until then ordered by the weight bytes" in out
    doc = tune_json(tmp_path)
    assert len(doc["notes"]) == 1 and "to rank by prediction" in doc["notes"][0]
    first = doc["candidates"][0]
    assert (first["tp"], first["pp"]) == (1, 1) and first["quantization"] in ("int4_wo", "awq")
    # the spec's own limits stay when nothing predicts the knobs apart
    assert {(c["max_batch_size"], c["max_num_tokens"]) for c in doc["candidates"]} == {(8, 2048)}


def test_cpu_target_with_a_profile_ranks_by_the_prediction(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # one core: one thread count
    save_recorded_profile()
    assert tune(tmp_path, TINY, "--top", "3") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "probe-host" not in out and "tok/s/GPU" in out
    doc = tune_json(tmp_path)
    assert doc["notes"] == [] and doc["ranking"] == "per_gpu_output_tokens_per_s"
    ranked = doc["candidates"]
    assert ranked and all(c["performance"]["predicted"] for c in ranked)
    assert all(c["performance"]["basis"].startswith("host profile 2026-12-03") for c in ranked)
    per_gpu = [c["performance"]["per_gpu_output_tokens_per_s"] for c in ranked]
    assert per_gpu == sorted(per_gpu, reverse=True)
    # the knobs pass ran: a predicted CPU candidate is searched beyond the spec's own limits
    assert {c["max_batch_size"] for c in ranked} > {8}
    # and what the spec holds (tp 2, unquantized) ranks below the best, which the rule could not say
    given = [c["performance"]["per_gpu_output_tokens_per_s"] for c in ranked
             if (c["tp"], c["quantization"], c["kv_cache"], c["max_batch_size"]) == (2, "none", "none", 8)]
    assert given and given[0] < per_gpu[0]
    assert {c["engine_threads"] for c in ranked} == {1}


def test_cpu_engine_threads_are_searched_where_a_profile_has_them(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # a 2-core host
    save_recorded_profile()
    assert tune(tmp_path, TINY) == 0, capsys.readouterr().err
    assert tune_json(tmp_path)["notes"] == ["engine_threads 2 not searched: no profile of this host for 2 engine "
                                            "threads (run `toolchain probe-host --threads 2` to search it)"]
    save_recorded_profile(threads=2)
    assert tune(tmp_path, TINY) == 0, capsys.readouterr().err
    doc = tune_json(tmp_path)
    assert doc["notes"] == []
    two = [c for c in doc["candidates"] + doc["dropped_candidates"] if c["engine_threads"] == 2]
    assert two and all(c["tp"] * c["pp"] == 1 and c["label"].endswith(" threads2") for c in two)
    assert all(c["performance"]["predicted"] for c in two if not c["failed_checks"])


@pytest.mark.e2e
def test_measure_deploys_the_top_two_and_picks_by_goodput(tmp_path, capsys):
    """The tiny model on this CPU: each of the top two passes eval's perplexity bound before it is deployed and
    benched for real; the choice is the highest measured goodput, and tune.json records it all."""
    ports = ["--set", "serving.http_port=0", "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]
    assert tune(tmp_path, REPO / "build" / "tiny-llama.yaml", *ports, "--measure", "--top", "2",
                "--no-baseline") == 0, capsys.readouterr().err[-3000:]
    doc = tune_json(tmp_path)
    deployed = [m for m in doc["measured"] if m["goodput_req_per_s"] is not None]
    assert len(deployed) == 2 and all(m["error"] is None for m in doc["measured"])
    for m in deployed:
        assert Path(m["report"]).is_file()
        if "w:none kv:none" not in m["label"]:  # quantized: evaluated first, within the bound
            assert m["ppl_increase_pct"] is not None and m["ppl_increase_pct"] <= 1.0
    for m in doc["measured"]:
        if not m["quality_ok"]:
            assert m["goodput_req_per_s"] is None  # never deployed
    choice = doc["choice"]
    assert choice["goodput_req_per_s"] == max(m["goodput_req_per_s"] for m in deployed)
    assert (tmp_path / "out" / "specs" / f"{choice['spec_name']}.yaml").is_file()
    assert f"chosen: {choice['label']}" in capsys.readouterr().out


def test_speculative_decoding_is_searched_on_and_off_only_where_the_spec_has_a_draft(tmp_path, capsys):
    assert tune(tmp_path, REPO / "build" / "tiny-llama-draft-target.yaml") == 0, capsys.readouterr().err
    assert {c["speculative"] for c in tune_json(tmp_path)["candidates"]} == {"draft_target", "none"}
    assert tune(tmp_path, REPO / "build" / "tiny-llama.yaml") == 0, capsys.readouterr().err
    assert {c["speculative"] for c in tune_json(tmp_path)["candidates"]} == {"none"}


# ------------------------------------------------------------------------------------- AIConfigurator cross-check


def replay(cmd: list[str]) -> subprocess.CompletedProcess:
    """aiconfigurator 0.12.0's recorded output for the command: its report for an fp8 GEMM, its error for sq
    (smoothquant: no H200 data in 0.12.0)."""
    gemm = cmd[cmd.index("--gemm-quant-mode") + 1]
    if gemm == "sq":
        return subprocess.CompletedProcess(cmd, 1, (AIC / "estimate-llama-3-70b-h200-sq.stdout").read_text(),
                                           (AIC / "estimate-llama-3-70b-h200-sq.stderr").read_text())
    return subprocess.CompletedProcess(cmd, 0, (AIC / "estimate-llama-3.1-70b-h200-tp4.txt").read_text(), "")


def test_cross_check_columns_in_the_table_and_tune_json(tmp_path):
    spec = load_spec(LLAMA_70B, ["gpu.name=H200", "parallelism.gpus=4", "parallelism.pp=1"])
    result = search(spec, [spec], 4, thresholds(spec.validation.slo, []), by_cost=False)
    fp8 = next(e for e in result.ranked if e.candidate.spec.quantization.method == "fp8")
    sq = next(e for e in result.ranked if e.candidate.spec.quantization.method == "smoothquant")
    spec_kind = next(e for e in result.ranked if e.candidate.spec.quantization.method not in ("fp8", "smoothquant"))
    result.ranked = [fp8, sq, spec_kind]
    batches = []

    def runner(cmd):
        batches.append(int(cmd[cmd.index("--batch-size") + 1]))
        return replay(cmd)

    cross_check(result.ranked, 2, lambda s, device, batch: crosscheck.estimate(
        s, device, batch, executable="aiconfigurator", runner=runner))
    assert batches == [fp8.performance["batch_size_at_max"], sq.performance["batch_size_at_max"]]
    assert fp8.cross_check["per_gpu_output_tokens_per_s"] == 923.62 and fp8.cross_check["tensorrt_llm"] == "1.3.0rc20"
    assert sq.cross_check["error"].startswith("no h200_sxm data for sq (has [")
    assert spec_kind.cross_check == {}
    text = render(result, 3)
    lines = text.splitlines()
    head = next(x for x in lines if x.startswith("#  candidate"))
    assert head.split()[-6:] == ["AIC", "tok/s/GPU", "AIC", "TPOT@max", "AIC", "note"]
    fp8_row = next(x for x in lines if fp8.candidate.label in x)
    assert "924" in fp8_row.split() and "17.18" in fp8_row.split()
    assert next(x for x in lines if sq.candidate.label in x).rstrip().endswith(
        "no h200_sxm data for sq (has [\"bfloat16\", \"fp8\", \"fp8_block\"])")
    assert next(x for x in lines if spec_kind.candidate.label in x).rstrip().endswith("not cross-checked")
    assert "AIC: aiconfigurator 0.12.0 (data: TensorRT-LLM 1.3.0rc20), each candidate at our batch@max" in text
    write(tmp_path / "out", result, 3, text)
    doc = tune_json(tmp_path)
    assert doc["cross_check"].startswith("AIC: aiconfigurator 0.12.0 (data: TensorRT-LLM 1.3.0rc20)")
    first, second, third = doc["candidates"]
    assert first["cross_check"]["basis"] == "aiconfigurator 0.12.0 (data: TensorRT-LLM 1.3.0rc20)"
    assert first["cross_check"]["tpot_ms"] == 17.178 and first["cross_check"]["batch_size"] == batches[0]
    assert "GEMM" not in second["cross_check"]["error"] and "cross_check" not in third


def test_cross_check_refuses_speculative_decoding():
    spec = load_spec(REPO / "build" / "qwen2.5-7b-draft-target.yaml", ["gpu.name=H200"])
    with pytest.raises(ToolchainError, match="does not model speculative decoding"):
        crosscheck.command(spec, gpus.lookup("H200"), 8)


def test_cross_check_on_a_cpu_target_and_a_venv_that_cannot_be_made_are_one_line(tmp_path, capsys, monkeypatch):
    assert tune(tmp_path, TINY, "--cross-check", "aiconfigurator") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "estimates GPUs" in err
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip offline: the install fails as it does without a network
    venv = tmp_path / "aic"
    with pytest.raises(ToolchainError) as caught:
        crosscheck.ensure_venv(venv)
    message = str(caught.value)
    assert "\n" not in message and f"could not install aiconfigurator 0.12.0 into {venv}" in message
    assert f"make it by hand: python3 -m venv {venv} && {venv}/bin/pip install aiconfigurator==0.12.0" in message
    assert not (venv / ".aiconfigurator-0.12.0").exists()


# ---------------------------------------------------------------------------------------------- written specs


def test_written_spec_keeps_relative_paths_relative_to_where_it_is_written(tmp_path):
    project = tmp_path / "project"
    (project / "cfg").mkdir(parents=True)
    (project / "cfg" / "config.json").write_text((REPO / "build" / "configs" / "llama-3-70b" / "config.json").read_text())
    original = yaml.safe_load(LLAMA_70B.read_text())
    original["model"]["checkpoint"] = "cfg"
    (project / "spec.yaml").write_text(yaml.safe_dump(original))
    spec = load_spec(project / "spec.yaml")
    dest = project / "tune" / "specs"
    dest.mkdir(parents=True)
    data = yaml.safe_load(spec_yaml(spec, ["header"], dest))
    assert data["model"]["checkpoint"] == "../../cfg"
    (dest / "w.yaml").write_text(yaml.safe_dump(data))
    assert load_spec(dest / "w.yaml").model.checkpoint == spec.model.checkpoint == project / "cfg"
    # written outside the tree holding the original spec and its model (here the repository): absolute, whatever
    # parents the two share (a clone under /tmp shares /tmp with pytest's tmp_path)
    elsewhere = yaml.safe_load(spec_yaml(load_spec(TINY), [], dest))
    assert elsewhere["model"]["checkpoint"] == str(REPO / "models" / "tiny-llama")
    # a spec that gave the path absolute keeps it absolute
    original["model"]["checkpoint"] = str(project / "cfg")
    (project / "abs.yaml").write_text(yaml.safe_dump(original))
    assert yaml.safe_load(spec_yaml(load_spec(project / "abs.yaml"), [], dest))["model"]["checkpoint"] == \
        str(project / "cfg")


def test_mode_none_candidates_drop_the_draft(tmp_path):
    spec = load_spec(REPO / "build" / "tiny-llama-draft-target.yaml")
    assert spec.speculative.draft_model is not None
    found, _ = structures(spec, 1, None, False)
    off = [c for c in found if c.spec.speculative.mode == "none"]
    on = [c for c in found if c.spec.speculative.mode == "draft_target"]
    assert off and on
    assert all(c.spec.speculative.draft_model is None for c in off)
    assert all(c.spec.speculative.draft_model == spec.speculative.draft_model for c in on)
    assert "speculative" not in yaml.safe_load(spec_yaml(off[0].spec, [], tmp_path))  # the default: none
    data = yaml.safe_load(spec_yaml(on[0].spec, [], REPO / "tune" / "specs"))
    assert data["speculative"]["draft_model"] == "../../models/tiny-llama-draft"  # the original gave it relative


def test_replicas_go_into_the_targets_replica_field(tmp_path):
    llmapi = load_spec(REPO / "build" / "llama3-8b-llmapi-h100.yaml")
    data = yaml.safe_load(spec_yaml(llmapi, [], tmp_path, replicas=4))
    assert data["dynamo"]["workers"] == 4 and data["serving"]["replicas"] == 4
    trtllm = load_spec(LLAMA_70B)
    data = yaml.safe_load(spec_yaml(trtllm, [], tmp_path, replicas=4))
    assert "dynamo" not in data and data["serving"]["replicas"] == 4
    assert "replicas" not in yaml.safe_load(spec_yaml(trtllm, [], tmp_path)).get("serving", {})


# ------------------------------------------------------------------- what a written spec deploys (issue 33)


def test_written_specs_hold_the_slo_and_their_replicas_share_and_plan_to_their_row(tmp_path, capsys):
    """Each written spec carries --slo and one replica's share of the workload (256 over 8 one-GPU replicas is
    32 each: left at 256, plan of the file predicted a TTFT many times the table's), so `toolchain plan` of the
    file (its library call) predicts exactly tune's row for it and finds the SLO met."""
    assert tune(tmp_path, LLAMA_70B, "--gpus", "8", "--gpu", "H200", "--top", "3",
                "--set", "validation.workload.concurrency=256",
                "--slo", "ttft_p99_ms=500,tpot_p99_ms=50,goodput_fraction=0.9") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ("slo: ttft_p99_ms <= 500, tpot_p99_ms <= 50, goodput_fraction >= 0.9; ttft_p99_ms, tpot_p99_ms judged "
            "on the predicted mean") in out.splitlines()[1]
    doc = tune_json(tmp_path)
    rows = {c["label"]: c for c in doc["candidates"]}
    replicas = set()
    for path, label in zip(doc["specs"], doc["top"], strict=True):
        row = rows[label]
        replicas.add(row["replicas"])
        written = load_spec(path)
        slo = written.validation.slo
        assert (slo.ttft_p99_ms, slo.tpot_p99_ms, slo.extra) == (500, 50, ["goodput_fraction>=0.9"])
        assert written.validation.workload.concurrency == -(-256 // row["replicas"])
        assert written.validation.workload.num_requests == 200  # how long a level runs stays
        ctx = build_context(written, "plan")
        report = report_dict(ctx, run_checks(ctx))
        assert report["ok"], report["failed_checks"]
        got, want = report["performance"], row["performance"]
        for key in ("concurrency", "ttft_ms", "tpot_ms", "max_output_tokens_per_s", "per_gpu_output_tokens_per_s",
                    "batch_size_at_max", "usd_per_million_output_tokens"):
            assert got[key] == want[key], (label, key, got[key], want[key])
        assert report["slo"]["not_predicted"] == ["goodput_fraction"]
        assert {k: v["met"] for k, v in report["slo"]["thresholds"].items()} == {"ttft_p99_ms": True,
                                                                                 "tpot_p99_ms": True}
        if row["replicas"] > 1:
            assert "validation.workload is one replica's share" in Path(path).read_text()
    assert max(replicas) > 1, "the top holds a multi-replica layout, whose share this test is about"


def test_a_mean_slo_is_not_said_to_stand_for_a_percentile(tmp_path, capsys):
    assert tune(tmp_path, LLAMA_70B, "--gpus", "4", "--gpu", "H200", "--top", "1",
                "--slo", "ttft_mean_ms=2000,tpot_p90_ms=60") == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("slo: ttft_mean_ms <= 2000, tpot_p90_ms <= 60; tpot_p90_ms judged on the predicted mean: the "
                      "model predicts means, no percentiles")
    header = (tmp_path / "out" / "specs" / "llama3-70b-tp4pp2-tuned-1.yaml").read_text().splitlines()
    assert any(h.startswith("# validation.slo: tpot_p90_ms judged on the predicted mean") for h in header)


def test_slo_option_goes_into_the_spec_a_rate_as_a_floor():
    from toolchain.cli.tune import with_slo

    spec = load_spec(LLAMA_70B, ["validation.slo.extra=[ttft_p90_ms<=300,e2e_p50_ms<=9000]"])
    slo = with_slo(spec, parse_slo_option("tpot_p99_ms=40,ttft_p90_ms=200,goodput_fraction=0.95")).validation.slo
    assert slo.ttft_p99_ms is None and slo.tpot_p99_ms == 40  # --slo replaces the named bounds
    assert slo.extra == ["e2e_p50_ms<=9000", "ttft_p90_ms<=200", "goodput_fraction>=0.95"]
    goodput = next(t for t in thresholds(slo) if t.name == "goodput_fraction")
    assert not goodput.upper and goodput.value == 0.95


def test_a_replicas_share_of_rate_and_sweep_workloads():
    from toolchain.tune.search import replica_spec

    rate = load_spec(LLAMA_70B, ["validation.workload.mode=rate", "validation.workload.rate=12",
                                 "validation.workload.sweep=[4,8,12]", "validation.workload.concurrency=256"])
    mine = replica_spec(rate, 8).validation.workload
    assert (mine.rate, mine.sweep, mine.concurrency) == (1.5, [0.5, 1.0, 1.5], 32)
    closed = load_spec(LLAMA_70B, ["validation.workload.sweep=[1,8,16,64]"])
    assert replica_spec(closed, 8).validation.workload.sweep == [1, 2, 8]  # 1 and 8 both share to 1
    assert replica_spec(closed, 1) is closed


def test_pareto_labels_do_not_overlap():
    """At 4 GPUs the front of the 70B example has neighbours a few tokens/s apart at nearly the same height: their
    labels, at one fixed offset, overwrote each other. Each label is measured with matplotlib's renderer."""
    import itertools

    from toolchain.tune.report import pareto_figure

    spec = load_spec(LLAMA_70B)
    result = _search(spec, [], gpus=4)
    fig = pareto_figure(result)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    labels = {e.candidate.label for e in result.front}
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts]
    assert len(boxes) >= 3 and {text for text, _ in boxes} <= labels
    assert {result.front[0].candidate.label, result.front[-1].candidate.label} <= {text for text, _ in boxes}
    crossing = [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]
    assert crossing == []
    inside, legend = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
    for text, box in boxes:
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, text
        assert not box.overlaps(legend), text



def test_a_tuned_spec_launches_its_replicas(tmp_path, capsys):
    """Issue 33 item 9: tp1 x 4 replicas tuned for target trtllm is four launches, not one: serve --print prints
    four pinned lines and --manifests a Deployment of four replicas."""
    assert tune(tmp_path, REPO / "build" / "llama3-8b-awq-h100.yaml", "--gpus", "4", "--gpu", "H100",
                "--top", "1") == 0, capsys.readouterr().err
    [path] = tune_json(tmp_path)["specs"]
    written = load_spec(path)
    assert (written.parallelism.world_size, written.serving.replicas) == (1, 4)
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "serve", path, "--print"]) == 0
    pinned = [x for x in capsys.readouterr().out.splitlines() if x.startswith("CUDA_VISIBLE_DEVICES=")]
    assert [x.split()[0] for x in pinned] == [f"CUDA_VISIBLE_DEVICES={i}" for i in range(4)]
    assert main(["--root", str(tmp_path), "serve", path, "--manifests", str(tmp_path / "m")]) == 0
    assert yaml.safe_load((tmp_path / "m" / "deployment.yaml").read_text())["spec"]["replicas"] == 4
