"""`toolchain eval`: metrics, text windows, and the command end to end on the
trained tiny Llama (target cpu through the built engine, target trtllm through
a CPU view of the converted checkpoint)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY_TRAINED, write_spec
from test_engine_cpu_util import _one_thread  # noqa: F401

from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.eval import evaluate, token_windows
from toolchain.eval.metrics import Comparison

needs_tiny = pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama not built")


def test_identical_models_agree_fully():
    torch.manual_seed(0)
    table = torch.randn(50, 50)
    logits = lambda ids: table[ids]  # noqa: E731
    windows = [[1, 2, 3, 4, 5], [7, 8, 9]]
    r = evaluate(logits, logits, windows)
    assert r["tokens_evaluated"] == 6 and r["windows"] == 2
    assert r["perplexity"] == r["reference_perplexity"] and r["greedy_token_agreement"] == 1.0
    assert r["max_abs_logit_diff"] == 0.0 and r["perplexity_ratio"] == 1.0


def test_uniform_model_has_vocabulary_perplexity_and_agreement_counts():
    uniform = lambda ids: torch.zeros(len(ids), 40)  # noqa: E731
    peaked = lambda ids: torch.nn.functional.one_hot(torch.tensor(ids) % 40, 40).float() * 5  # noqa: E731
    r = evaluate(uniform, peaked, [[0, 1, 2, 3]])
    assert math.isclose(r["perplexity"], 40.0, rel_tol=1e-4)
    # argmax of zeros is 0; the peaked model picks the current token: agree only at position 0.
    assert r["greedy_token_agreement"] == pytest.approx(1 / 3, abs=1e-4)


def test_mismatched_logits_rejected():
    with pytest.raises(ValueError, match="do not both cover"):
        Comparison().add([1, 2, 3], torch.zeros(3, 5), torch.zeros(2, 5))


def test_windows_spread_over_the_stream():
    stream = list(range(1000))
    windows = token_windows(stream, 100, 300)
    assert [w[0] for w in windows] == [0, 450, 900] and all(len(w) == 100 for w in windows)
    short = token_windows(list(range(250)), 100, 1000)  # shorter than asked: used whole
    assert [len(w) for w in short] == [100, 100, 50]
    assert token_windows([1, 2, 3], 2, 10) == [[1, 2]]  # a 1-token tail predicts nothing
    with pytest.raises(ToolchainError, match="window"):
        token_windows(stream, 1, 10)


def _tiny_spec(tmp_path, **sections):
    sections = {"parallelism": {"tp": 2, "pp": 1},
                "limits": {"max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 512}, **sections}
    return write_spec(tmp_path / "tiny.yaml", TINY_TRAINED, name=sections.pop("name", "tiny-eval"), **sections)


@needs_tiny
def test_eval_cli_tiny_llama_tp2(tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["--root", str(tmp_path / "root"), "eval", str(_tiny_spec(tmp_path)), "--json", str(out),
               "--max-tokens", "1024", "--window", "128"])
    assert rc == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    for key in ("perplexity", "reference_perplexity", "greedy_token_agreement", "tokens_evaluated"):
        assert key in report
    assert report["tokens_evaluated"] == 8 * 127 and report["windows"] == 8
    assert report["greedy_token_agreement"] == 1.0
    assert report["perplexity"] == pytest.approx(report["reference_perplexity"], rel=1e-4)
    assert 10 < report["perplexity"] < 400  # trained: far below the 4096 of a uniform model
    assert report["model"]["tp"] == 2 and report["passed"] is True
    assert "greedy agreement" in capsys.readouterr().out
    assert (tmp_path / "root" / "engines" / "tiny-eval" / "engine" / "config.json").is_file()  # built on demand


@needs_tiny
def test_eval_trtllm_target_uses_the_checkpoint(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n\nclass Point:\n    pass\n" * 20)
    spec = _tiny_spec(tmp_path, target="trtllm", parallelism={"tp": 2, "pp": 2})
    out = tmp_path / "e.json"
    rc = main(["--root", str(tmp_path / "root"), "eval", str(spec), "--text", str(text), "--json", str(out),
               "--max-tokens", "256", "--window", "64"])
    assert rc == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["model"]["pp"] == 2 and report["model"]["dtype"] == "float32"
    assert report["greedy_token_agreement"] == 1.0 and str(text) in report["text"]
    assert not (tmp_path / "root" / "engines" / "tiny-eval" / "engine").exists()  # no trtllm-build ran


@needs_tiny
def test_eval_threshold_missed_exits_1_after_writing(tmp_path, capsys):
    out = tmp_path / "e.json"
    rc = main(["--root", str(tmp_path / "root"), "eval", str(_tiny_spec(tmp_path)), "--json", str(out),
               "--max-tokens", "128", "--window", "64", "--max-perplexity-ratio", "0.5"])
    err = capsys.readouterr().err
    assert rc == 1 and "perplexity_ratio" in err
    assert json.loads(out.read_text())["passed"] is False


@needs_tiny
def test_eval_tokenizer_outside_vocabulary(tmp_path, capsys, hf_llama):
    spec = write_spec(tmp_path / "s.yaml", hf_llama, name="mismatch", model={"tokenizer": str(TINY_TRAINED)})
    rc = main(["--root", str(tmp_path / "root"), "eval", str(spec), "--max-tokens", "64", "--window", "32"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "outside the model's vocabulary [0, 250)" in err and len(err.splitlines()) == 1


@needs_tiny
def test_eval_on_the_llmapi_stand_in_runs_the_engine_its_servers_load(tmp_path, capsys):
    """An llmapi-cpu spec is evaluated through the engine its convert prepares for LLM()'s stand-in: the same
    convert and CPU build of the same checkpoint as target cpu (at the same dtype, tp and limits), so the logits,
    and with them both perplexities and the agreement, are the ones target cpu reports."""
    reports = {}
    for target in ("cpu", "llmapi-cpu"):
        spec = _tiny_spec(tmp_path, target=target, name=f"tiny-{target}")
        out = tmp_path / f"{target}.json"
        rc = main(["--root", str(tmp_path / "root"), "eval", str(spec), "--json", str(out),
                   "--max-tokens", "256", "--window", "64"])
        assert rc == 0, capsys.readouterr()
        reports[target] = json.loads(out.read_text())
    cpu, llm = reports["cpu"], reports["llmapi-cpu"]
    assert llm["model"]["tp"] == 2 and llm["model"]["dtype"] == cpu["model"]["dtype"] == "float32"
    assert llm["tokens_evaluated"] == cpu["tokens_evaluated"] > 0
    for key in ("perplexity", "reference_perplexity", "greedy_token_agreement"):
        assert llm[key] == pytest.approx(cpu[key], rel=1e-6), key
    assert llm["greedy_token_agreement"] == 1.0
    # What ran is the stand-in's engine, prepared where the servers find it; no engine-path engine was built.
    root = tmp_path / "root" / "engines" / "tiny-llmapi-cpu"
    assert (root / "cpu-llm").is_dir() and not (root / "engine").exists()


def test_eval_refuses_the_gpu_llmapi_target_in_one_line(tmp_path, capsys, hf_llama):
    """Target llmapi runs in the PyTorch backend on a GPU: eval says so and names the stand-in's spelling."""
    spec = write_spec(tmp_path / "s.yaml", hf_llama, target="llmapi")
    rc = main(["--root", str(tmp_path / "root"), "eval", str(spec), "--max-tokens", "64", "--window", "32"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "target llmapi " in err and "--set target=llmapi-cpu" in err
    assert not (tmp_path / "root" / "engines").exists()  # refused before converting anything
