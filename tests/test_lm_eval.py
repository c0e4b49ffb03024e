"""EleutherAI's lm-evaluation-harness 0.4.13, unchanged, against the OpenAI server, each task shipped in
tests/data/lm_eval scored through the server and by lm-eval's own `hf` backend on the same checkpoint:
- `local-completions`: a loglikelihood multiple-choice task (the 30 items toolchain eval ships) through
  /v1/completions (token-id prompts, echo, logprobs 1, max_tokens 1); the two accuracies are within one item.
- `local-chat-completions`: a generation task through /v1/chat/completions (greedy, stop strings, the chat
  template); every generated answer is the hf backend's, and so is the score.

lm-eval lives in a venv of its own, benchmarks/.venv/lm-eval (`make lm-eval`, which `make test` runs); the fixture
makes it on demand and skips, naming why, only when it cannot be made (no package source, a package missing)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_TRAINED, needs_extras, starts_server
from llmapi_helpers import deploy_llmapi_cpu

REPO = Path(__file__).resolve().parents[1]
LM_EVAL = REPO / "benchmarks" / ".venv" / "lm-eval" / "bin" / "lm_eval"
TASKS = REPO / "tests" / "data" / "lm_eval"
CHOICE_ITEMS, GENERATE_ITEMS = 30, 12

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
@needs_extras
def lm_eval() -> Path:
    if not (LM_EVAL.parent.parent / ".setup-stamp").exists():
        try:
            run = subprocess.run(["make", "--no-print-directory", "lm-eval"], cwd=REPO, capture_output=True,
                                 text=True, timeout=1200)
        except (OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"`make lm-eval` could not make benchmarks/.venv/lm-eval: {err}")
        if run.returncode != 0 or not LM_EVAL.exists():
            tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
            pytest.skip("`make lm-eval` could not install lm-evaluation-harness 0.4.13 into benchmarks/.venv/lm-eval "
                        f"(no package source, or a package missing): {' | '.join(tail)}")
    return LM_EVAL


@pytest.fixture(scope="module")
@starts_server
def api(tmp_path_factory):
    from toolchain.pipeline import openai_server

    if not (TINY_TRAINED / "config.json").is_file():
        pytest.skip("models/tiny-llama not built")
    spec, ws = deploy_llmapi_cpu(tmp_path_factory.mktemp("lm-eval"), TINY_TRAINED, name="tiny-lm-eval")
    with openai_server(spec, ws, ws.root / "openai.log") as server:
        yield server


def _score(lm_eval: Path, task: str, model: str, model_args: str, out: Path, *extra: str) -> dict:
    """lm_eval on a shipped task: its results for the task and its answers, in document order."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Nothing from the Hub: the task's data is a local JSON file, the tokenizer and checkpoint local directories.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(out / "hf-home"), TOKENIZERS_PARALLELISM="false")
    cmd = [str(lm_eval), "--model", model, "--model_args", model_args, "--tasks", task, "--include_path", str(TASKS),
           "--output_path", str(out), "--batch_size", "1", "--log_samples", *extra]
    if model == "hf":
        cmd += ["--device", "cpu"]
    run = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-30:])
    assert run.returncode == 0, f"lm_eval --model {model} exited {run.returncode}:\n{tail}"
    results, samples = sorted(out.rglob("results_*.json")), sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert results and samples, f"lm_eval --model {model} wrote no results under {out}:\n{tail}"
    data = json.loads(results[-1].read_text())
    docs = sorted((json.loads(line) for line in samples[-1].read_text().splitlines()), key=lambda d: d["doc_id"])
    return {**data["results"][task], "samples": data["n-samples"][task]["effective"],
            "answers": [d["resps"] for d in docs]}


def test_lm_eval_loglikelihood_through_completions_scores_as_its_hf_backend(lm_eval, api, tmp_path):
    # lm-eval's hf backend encodes with the tokenizer's own special tokens (the tiny Llama's BOS); its API models
    # add none unless add_bos_token: the same token ids go to both this way.
    served = _score(lm_eval, "toolchain_choice", "local-completions",
                    f"base_url={api.url}/v1/completions,model={api.served_model_name},tokenizer={TINY_TRAINED},"
                    "tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=1,max_retries=1",
                    tmp_path / "served")
    hf = _score(lm_eval, "toolchain_choice", "hf", f"pretrained={TINY_TRAINED},dtype=float32", tmp_path / "hf")
    assert served["samples"] == hf["samples"] == CHOICE_ITEMS
    assert abs(served["acc,none"] - hf["acc,none"]) * CHOICE_ITEMS <= 1 + 1e-9, (served["acc,none"], hf["acc,none"])
    # Each choice's log-likelihood as well, at float32 (a doc's resps: per choice [[loglikelihood, is_greedy]]).
    pairs = [(float(a[0][0]), float(b[0][0])) for x, y in zip(served["answers"], hf["answers"], strict=True)
             for a, b in zip(x, y, strict=True)]
    assert len(pairs) >= 2 * CHOICE_ITEMS and max(abs(a - b) for a, b in pairs) < 1e-4


def test_lm_eval_generation_through_chat_completions_answers_as_its_hf_backend(lm_eval, api, tmp_path):
    # The chat endpoint renders the template and adds no special tokens (trtllm-serve's chat default,
    # add_special_tokens false); the hf backend is told the same with add_bos_token=False.
    served = _score(lm_eval, "toolchain_generate", "local-chat-completions",
                    f"base_url={api.url}/v1/chat/completions,model={api.served_model_name},num_concurrent=1,"
                    "max_retries=1", tmp_path / "served", "--apply_chat_template")
    hf = _score(lm_eval, "toolchain_generate", "hf", f"pretrained={TINY_TRAINED},dtype=float32,add_bos_token=False",
                tmp_path / "hf", "--apply_chat_template")
    assert served["samples"] == hf["samples"] == GENERATE_ITEMS
    assert served["answers"] == hf["answers"]
    assert any(a[0][0].strip() for a in served["answers"])  # answers with text, not only empty ones
    assert served["exact_match,none"] == hf["exact_match,none"]
