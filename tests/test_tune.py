"""`toolchain tune`: the search's choices on constructed cases (fit, SLO, price), its one-line errors and SLO-miss
line, written specs that `toolchain plan` passes, and one `--measure` run on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from toolchain.cli import main
from toolchain.cli.tune import parse_slo_option
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.slo import thresholds
from toolchain.tune.candidates import layouts
from toolchain.tune.search import search

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = REPO / "build" / "llama3-70b-tp4pp2.yaml"


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


def test_an_slo_only_tp4_meets_picks_tp4():
    spec = load_spec(LLAMA_70B, ["validation.slo.tpot_p99_ms=null", "validation.slo.ttft_p99_ms=null",
                                 "parallelism.gpus=4", "parallelism.tp=4", "parallelism.pp=1"])
    free = _search(spec, [])

    def worst_ttft(e) -> float:  # the SLO holds at the workload's share and at the batch of the maximum
        return max(e.performance["ttft_ms"], e.full_load["ttft_ms"])

    best: dict[bool, float] = {}
    for e in free.ranked:
        tp4 = e.candidate.spec.parallelism.tp == 4
        best[tp4] = min(best.get(tp4, 1e9), worst_ttft(e))
    assert best[True] < best[False], "the model predicts tp 4 the fastest to the first token"
    bound = (best[True] + best[False]) / 2
    result = _search(spec, [f"ttft_p99_ms<={bound}"])
    assert result.ranked and all(e.candidate.spec.parallelism.tp == 4 for e in result.ranked)
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
    labels = [c["label"] for c in doc["candidates"][:3]]
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


def test_cpu_target_orders_by_the_stated_rule(tmp_path, capsys):
    assert tune(tmp_path, REPO / "build" / "tiny-llama.yaml", "--top", "2") == 0, capsys.readouterr().err
    doc = tune_json(tmp_path)
    assert any("no CPU prediction yet" in n for n in doc["notes"])
    first = doc["candidates"][0]
    assert (first["tp"], first["pp"]) == (1, 1) and first["quantization"] in ("int4_wo", "awq")
    # the spec's own limits stay when nothing predicts the knobs apart
    assert {(c["max_batch_size"], c["max_num_tokens"]) for c in doc["candidates"]} == {(8, 2048)}


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
