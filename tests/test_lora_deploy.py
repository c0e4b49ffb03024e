"""The shipped multi-LoRA specs deploy on CPU and pass their SLOs with a mixed-adapter workload:
build/tiny-llama-lora.yaml through Triton (the ensemble, adapter requests carrying lora_task_id) and
build/tiny-llama-lora-llmapi.yaml through Triton's llmapi model (base only: it takes no adapter per request) and
the OpenAI server (the adapter's name in `model`), each report naming every class's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_TRAINED

from toolchain.cli import main

REPO = Path(__file__).resolve().parents[1]
TRITON_SPEC = REPO / "build" / "tiny-llama-lora.yaml"
LLMAPI_SPEC = REPO / "build" / "tiny-llama-lora-llmapi.yaml"
# Enough requests that every class is drawn (seed 0), and the spec's own SLOs: a loaded host meets them.
QUICK = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0", "llmapi.openai_port=0",
         "validation.workload.num_requests=16", "validation.workload.warmup_requests=2",
         "validation.workload.output_tokens=16", "validation.workload.request_timeout_s=120"]
ADAPTERS = {"base": None, "attn": "attn", "all": "all"}


@pytest.fixture(scope="module")
def tiny_lora() -> Path:
    """models/tiny-llama-lora as `make tiny-lora` writes it (a no-op when it is current)."""
    from toolchain.tinymodel.lora import build_tiny_lora

    return build_tiny_lora(TINY_TRAINED, REPO / "models" / "tiny-llama-lora", log=lambda msg: None)


def _deploy(spec: Path, root: Path) -> dict:
    argv = ["--root", str(root), "deploy", str(spec)]
    for item in QUICK:
        argv += ["--set", item]
    assert main(argv) == 0
    return json.loads((root / "reports" / spec.stem / "report.json").read_text())


def _served_every_class(report: dict, adapters: dict) -> None:
    assert report["errors"] == 0 and report["slo"]["passed"] is True, report["slo"]
    assert {name: c["adapter"] for name, c in report["per_class"].items()} == adapters
    assert all(c["num_requests"] > 0 for c in report["per_class"].values())


@pytest.mark.e2e
@pytest.mark.slow
def test_the_triton_deploy_serves_the_mixed_adapter_workload(tiny_lora, tmp_path):
    report = _deploy(TRITON_SPEC, tmp_path)
    _served_every_class(report, ADAPTERS)
    assert "lora_task_id" in report["workload"]["inputs_sent"] and report["transport"]["model"] == "ensemble"
    converted = json.loads((tmp_path / "engines" / "tiny-llama-lora" / "lora" / "adapters.json").read_text())
    assert converted["adapters"] == {"attn": 1, "all": 2}


@pytest.mark.e2e
@pytest.mark.slow
def test_the_llmapi_deploy_serves_the_adapters_through_the_openai_server(tiny_lora, tmp_path):
    report = _deploy(LLMAPI_SPEC, tmp_path)
    _served_every_class(report, {name: None for name in ADAPTERS})  # Triton's llmapi model: every class on the base
    openai = json.loads((tmp_path / "reports" / LLMAPI_SPEC.stem / "openai" / "report.json").read_text())
    _served_every_class(openai, ADAPTERS)
    assert openai["protocol"] == "openai-completions"
