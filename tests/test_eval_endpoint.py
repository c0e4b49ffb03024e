"""`toolchain eval SPEC --endpoint URL` and deploy's `validation.quality` gate: the trained tiny Llama served by
this project's OpenAI server (target llmapi-cpu, float32) measured through echoed prompt log-probs against the
HF reference, plus the client's refusals (a down endpoint, a 4xx, an answer without prompt log-probs), the
multiple-choice set, and the engine path's refusal of a quality gate."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import TINY_TRAINED, starts_server, write_spec
from llmapi_helpers import deploy_llmapi_cpu

from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.eval import choices as mc
from toolchain.eval.endpoint import NO_PROMPT_LOGPROBS, Echoed, Endpoint, Rendering, base_url
from toolchain.eval.served import judge

needs_tiny = pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama not built")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- the client and the multiple-choice set, without a server ----------------------------------------------------

def test_base_url_takes_every_way_of_writing_the_address():
    for url in ("127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1",
                "http://127.0.0.1:8000/v1/completions"):
        assert base_url(url) == "http://127.0.0.1:8000"


def test_an_answer_without_prompt_logprobs_is_refused_naming_what_is_missing():
    # What a server that accepts echo but returns only the generated token's log-probs answers.
    with pytest.raises(ToolchainError) as err:
        Echoed.parse({"tokens": ["x"], "token_logprobs": [-0.5], "top_logprobs": [{"x": -0.5}]}, 4)
    assert NO_PROMPT_LOGPROBS in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ToolchainError, match="no top log-probabilities"):
        Echoed.parse({"tokens": ["a", "b"], "token_logprobs": [None, -1.0], "top_logprobs": [None, None]}, 2)


def test_echoed_top_is_the_most_likely_alternative():
    got = Echoed.parse({"tokens": ["a", "b", "c", "d"], "token_logprobs": [None, -1.0, -0.1, -2.0],
                        "top_logprobs": [None, {"b": -1.0, "z": -0.4}, {"c": -0.1}, {"q": -0.3, "d": -2.0}]}, 3)
    assert got.logprobs == [None, -1.0, -0.1] and got.top == [None, ("z", -0.4), ("c", -0.1)]  # the 4th is generated


@needs_tiny
def test_rendering_learns_how_the_server_names_tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TRAINED)
    ids = tok("def main():\n    return 0\n")["input_ids"]
    for names, way in ((tok.convert_ids_to_tokens(ids), "the tokenizer's pieces"),
                       ([tok.decode([i]) for i in ids], "decoded text"), ([f"token_id:{i}" for i in ids], "token_id:N")):
        rendering = Rendering(tok)
        rendering.learn(ids, Echoed(list(names), [None] * len(ids), [None] * len(ids)))
        assert rendering.name == way and rendering(ids[2]) == names[2]
    with pytest.raises(ToolchainError, match="the server's tokenizer is not the spec's"):
        Rendering(tok).learn(ids, Echoed(["?"] * len(ids), [None] * len(ids), [None] * len(ids)))


def test_the_shipped_multiple_choice_set_loads_and_bad_lines_are_named(tmp_path):
    description, items = mc.load_items()
    assert 20 <= len(items) <= 40 and "multiple_choice.jsonl" in description
    assert all(0 <= i.answer < len(i.choices) for i in items)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n{"context": "a", "choices": ["b"], '
                   '"answer": 0}\n')
    with pytest.raises(ToolchainError, match="bad.jsonl line 2: choices must be two or more"):
        mc.load_items(bad)


def test_judge_names_each_missed_bound_by_its_field():
    report = {"perplexity_ratio": 1.2, "greedy_token_agreement": 0.9,
              "choices": {"accuracy": 0.5, "reference_accuracy": 0.7}}
    judged = judge(report, {"max_perplexity_ratio": 1.1, "min_greedy_agreement": 0.8, "max_choice_accuracy_drop": 0.1,
                            "min_choice_accuracy": 0.5})
    assert judged["passed"] is False
    assert judged["missed"] == ["perplexity_ratio 1.2 > 1.1 (max_perplexity_ratio)",
                                "choice_accuracy_drop 0.2 > 0.1 (max_choice_accuracy_drop)"]


def test_a_down_endpoint_is_one_line(tmp_path, capsys):
    spec = write_spec(tmp_path / "s.yaml", TINY_TRAINED, target="llmapi-cpu")
    rc = main(["--root", str(tmp_path / "root"), "eval", str(spec), "--endpoint", f"127.0.0.1:{_free_port()}"])
    err = _one_line_error(capsys)
    assert rc != 0 and "cannot reach http://127.0.0.1:" in err and "/v1/models" in err


def test_a_quality_gate_on_the_engine_path_is_refused_before_any_stage(tmp_path, capsys):
    spec = write_spec(tmp_path / "s.yaml", TINY_TRAINED, target="cpu",
                      validation={"quality": {"min_greedy_agreement": 0.99}})
    rc = main(["--root", str(tmp_path / "root"), "deploy", str(spec)])
    err = capsys.readouterr().err
    assert rc != 0 and "quality.openai-endpoint" in err and "toolchain eval SPEC --endpoint URL" in err, err
    assert not (tmp_path / "root" / "engines").exists()  # nothing converted


# -- a live OpenAI server: this project's, on the tiny Llama at float32 ------------------------------------------

@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    if not (TINY_TRAINED / "config.json").is_file():
        pytest.skip("models/tiny-llama not built")
    return deploy_llmapi_cpu(tmp_path_factory.mktemp("eval-endpoint"), TINY_TRAINED, name="tiny-eval")


@pytest.fixture(scope="module")
@starts_server
def api(deployed):
    from toolchain.pipeline import openai_server

    spec, ws = deployed
    with openai_server(spec, ws, ws.root / "openai.log") as server:
        yield server


def test_the_endpoint_measures_what_the_reference_does(deployed, api, tmp_path, capsys):
    """float32 served by the CPU engine: the same log-probs as HF's float32 (within 1e-4), so a perplexity ratio
    of 1, full greedy agreement, and the multiple-choice set answered exactly as the reference answers it."""
    spec, ws = deployed
    out = tmp_path / "eval.json"
    rc = main(["--root", str(ws.root), "eval", str(spec.source), "--endpoint", api.url, "--json", str(out),
               "--max-tokens", "512", "--window", "64", "--max-perplexity-ratio", "1.001"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    report = json.loads(out.read_text())
    assert report["served_model"] == api.served_model_name and report["tokens_evaluated"] >= 8 * 63
    assert report["perplexity_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert report["max_abs_logprob_diff"] < 1e-4
    assert report["greedy_token_agreement"] == 1.0
    assert report["top1_accuracy"] == report["reference_top1_accuracy"]
    choices = report["choices"]
    assert choices["items"] == 30 and choices["accuracy"] == choices["reference_accuracy"]
    assert choices["same_pick"] == 1.0
    assert report["passed"] is True and "perplexity ratio" in printed.out


def test_a_model_the_server_does_not_serve_is_its_4xx_in_one_line(deployed, api, capsys):
    spec, ws = deployed
    rc = main(["--root", str(ws.root), "eval", str(spec.source), "--endpoint", api.url, "--model", "no-such-model"])
    err = _one_line_error(capsys)
    assert rc != 0 and f"{api.url}/v1/completions answered HTTP 4" in err and "no-such-model" in err, err


def test_the_model_name_comes_from_v1_models(api):
    assert Endpoint(api.url).model == api.served_model_name


@pytest.mark.e2e
def test_deploy_fails_in_one_line_on_a_quality_bound_it_misses(tmp_path, capsys):
    """An impossible bound (perplexity at most half the reference's): deploy runs every stage, measures quality
    through the OpenAI server after its bench, writes the figures into report.json beside the latency verdict,
    and fails on the bound in one line."""
    quick = {"workload": {"num_requests": 4, "warmup_requests": 0, "concurrency": 2, "input_tokens": 16,
                          "output_tokens": 4},
             "quality": {"max_perplexity_ratio": 0.5, "tokens": 128, "window": 64}}
    spec, ws = deploy_llmapi_cpu(tmp_path, TINY_TRAINED, name="tiny-gate", validation=quick)
    rc = main(["--root", str(ws.root), "deploy", str(spec.source)])
    printed = capsys.readouterr()
    error = [line for line in printed.err.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(error) == 1, printed.err
    assert "quality gate missed: perplexity_ratio 1" in error[0] and "> 0.5 (max_perplexity_ratio)" in error[0]
    report = json.loads((ws.report_dir(spec) / "report.json").read_text())
    assert report["quality"]["passed"] is False and report["quality"]["perplexity_ratio"] == pytest.approx(1, abs=1e-4)
    assert "slo" in report and report["quality"]["choices"]["items"] == 30
