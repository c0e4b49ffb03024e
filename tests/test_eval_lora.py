"""`toolchain eval SPEC --adapter NAME`: the converted model under a LoRA adapter against PEFT's merged model
(transformers, float32), on the engine path (the converted adapter files put into the CPU engine's LoRA cache;
target trtllm through a CPU view of its converted checkpoint) and on the LLM-API path (the stand-in's adapter
loader), at tp 1 and 2, for the attention-only and the every-projection adapters that `make tiny-lora` makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_TRAINED, starts_server, write_spec
from test_engine_cpu_util import _one_thread  # noqa: F401

from toolchain.cli import main
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = REPO / "models" / "tiny-llama-lora"
TOKENS, WINDOW = ("--max-tokens", "256"), ("--window", "64")


@pytest.fixture(scope="module")
def tiny_lora() -> Path:
    """models/tiny-llama-lora as `make tiny-lora` writes it (a no-op when it is current)."""
    from toolchain.tinymodel.lora import build_tiny_lora

    return build_tiny_lora(TINY_TRAINED, ADAPTERS, log=lambda msg: None)


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict:
    """One workspace per (target, tp): the second adapter's eval reuses the first one's engine."""
    return {}


def _spec(dir: Path, tiny_lora: Path, target: str, tp: int) -> Path:
    return write_spec(dir / "lora.yaml", TINY_TRAINED, name=f"eval-lora-{target}-tp{tp}", target=target,
                      parallelism={"tp": tp, "pp": 1},
                      limits={"max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 512},
                      lora={"adapters": {"attn": str(tiny_lora / "attn"), "all": str(tiny_lora / "all")}})


def _eval(capsys, root: Path, spec: Path, *args: str) -> tuple[int, dict | None, str]:
    out = root / f"eval-{len(list(root.glob('eval-*.json')))}.json"
    rc = main(["--root", str(root), "eval", str(spec), "--json", str(out), *TOKENS, *WINDOW, *args])
    got = capsys.readouterr()
    return rc, json.loads(out.read_text()) if out.is_file() else None, got.out + got.err


@pytest.mark.parametrize("target", ["cpu", "trtllm", "llmapi-cpu"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("adapter", ["attn", "all"])
def test_the_converted_model_under_an_adapter_agrees_with_peft_merged(tiny_lora, roots, tmp_path_factory, capsys,
                                                                      target, tp, adapter):
    if (target, tp) not in roots:
        roots[(target, tp)] = tmp_path_factory.mktemp(f"{target}-tp{tp}")
    root = roots[(target, tp)]
    spec = _spec(root, tiny_lora, target, tp)
    rc, report, out = _eval(capsys, root, spec, "--adapter", adapter)
    assert rc == 0, out
    assert report["greedy_token_agreement"] == 1.0 and report["model"]["tp"] == tp
    assert report["perplexity"] == pytest.approx(report["reference_perplexity"], rel=1e-4)
    assert report["max_abs_logit_diff"] < 1e-3
    assert report["adapter"]["name"] == adapter and report["adapter"]["task_id"] == load_spec(spec).lora.task_id(adapter)
    assert report["adapter"]["rank"] == {"attn": 8, "all": 16}[adapter]
    assert f"LoRA adapter {adapter}" in out and "merged by PEFT" in out


def test_the_adapter_is_what_is_measured(tiny_lora, tmp_path, capsys):
    """The base model as the 'merged' reference disagrees, and the adapter's own merged checkpoint (--reference)
    agrees: the engine really ran the adapter, and --reference is what the engine is compared with."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = _spec(tmp_path, tiny_lora, "cpu", 1)
    rc, report, out = _eval(capsys, tmp_path, spec, "--adapter", "all", "--reference", str(TINY_TRAINED))
    assert rc == 0, out
    assert report["greedy_token_agreement"] < 0.9 and report["adapter"]["reference"] == str(TINY_TRAINED)
    merged = tmp_path / "merged"
    base = AutoModelForCausalLM.from_pretrained(TINY_TRAINED, dtype=torch.float32)
    PeftModel.from_pretrained(base, tiny_lora / "all").merge_and_unload().save_pretrained(merged)
    rc, report, out = _eval(capsys, tmp_path, spec, "--adapter", "all", "--reference", str(merged))
    assert rc == 0, out
    assert report["greedy_token_agreement"] == 1.0 and str(merged) in out


def test_a_bad_adapter_request_is_one_line(tiny_lora, tmp_path, capsys):
    spec = _spec(tmp_path, tiny_lora, "cpu", 1)
    rc, report, out = _eval(capsys, tmp_path, spec, "--adapter", "every")
    assert rc == 2 and report is None
    assert out.strip() == ("error: --adapter every: no LoRA adapter of that name in eval-lora-cpu-tp1's "
                           "lora.adapters (name one of: all, attn)"), out
    plain = write_spec(tmp_path / "plain.yaml", TINY_TRAINED, name="plain")
    rc, _, out = _eval(capsys, tmp_path, plain, "--adapter", "attn")
    assert rc == 2 and "serves no LoRA adapters" in out and len(out.strip().splitlines()) == 1
    rc, _, out = _eval(capsys, tmp_path, spec, "--reference", str(TINY_TRAINED))
    assert rc == 2 and "pass --adapter NAME with it" in out


@pytest.fixture(scope="module")
@starts_server
def openai_with_adapters(tiny_lora, tmp_path_factory):
    """This project's OpenAI server on a llmapi-cpu LoRA spec (float32, tp 1), the adapters served by name."""
    from llmapi_helpers import deploy_llmapi_cpu

    from toolchain.pipeline import openai_server

    spec, ws = deploy_llmapi_cpu(tmp_path_factory.mktemp("eval-lora-endpoint"), TINY_TRAINED, name="lora-ep",
                                 lora={"adapters": {"attn": str(tiny_lora / "attn"), "all": str(tiny_lora / "all")}})
    with openai_server(spec, ws, ws.root / "openai.log") as server:
        yield spec, ws, server


def test_the_endpoint_under_an_adapter_agrees_with_peft_merged(openai_with_adapters, tmp_path, capsys):
    """--endpoint with --adapter asks the server for the adapter by name (the model field) and compares its echoed
    log-probs with PEFT's merged model on the same tokens."""
    spec, ws, server = openai_with_adapters
    out = tmp_path / "eval.json"
    rc = main(["--root", str(ws.root), "eval", str(spec.source), "--endpoint", server.url, "--adapter", "all",
               "--json", str(out), *TOKENS, *WINDOW])
    assert rc == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["served_model"] == "all" and report["adapter"]["name"] == "all"
    assert report["greedy_token_agreement"] == 1.0 and report["perplexity_ratio"] == pytest.approx(1.0, abs=1e-3)
