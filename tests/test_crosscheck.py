"""AIConfigurator cross-check (toolchain/plan/crosscheck.py): the command a spec maps to, and the parse of a
report recorded from aiconfigurator 0.12.0 (the network is not reachable at test time, so nothing installs here).

The fixture tests/aiconfigurator/estimate-llama-3.1-70b-h200-tp4.txt is the stdout of, from the repository root:
    aiconfigurator cli estimate --model-path toolchain/plan/data/models/llama-3.1-70b --system h200_sxm \
        --backend trtllm --isl 1024 --osl 1024 --batch-size 64 --tp-size 4 --gemm-quant-mode fp8 \
        --kvcache-quant-mode fp8 --no-color --log-level ERROR
"""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchain import gpus
from toolchain.errors import ToolchainError
from toolchain.plan import crosscheck
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "tests" / "aiconfigurator" / "estimate-llama-3.1-70b-h200-tp4.txt"


def test_parse_a_recorded_report():
    est = crosscheck.parse(REPORT.read_text())
    assert (est.ttft_ms, est.tpot_ms) == (244.319, 17.178)
    assert (est.output_tokens_per_s, est.per_gpu_output_tokens_per_s) == (3694.47, 923.62)  # "3,694.47"
    assert (est.concurrency, est.memory_gb) == (64, 26.42)
    assert est.tensorrt_llm == "1.3.0rc20"
    assert est.label == "aiconfigurator 0.12.0 (data: TensorRT-LLM 1.3.0rc20)"
    assert est.as_dict()["basis"] == est.label


def test_a_report_without_figures_is_refused():
    text = REPORT.read_text().replace("TPOT:", "TPOT (ms):")
    with pytest.raises(ToolchainError, match="lacks tpot_ms"):
        crosscheck.parse(text)
    with pytest.raises(ToolchainError, match="lacks tensorrt_llm"):
        crosscheck.parse("error: argument --model-path: not a valid HuggingFace model path")


def test_command_of_a_spec():
    spec = load_spec(REPO / "build" / "llama3-70b-tp4pp2.yaml",
                     ["gpu.name=H200", "parallelism.pp=1", "parallelism.gpus=4", "quantization.method=fp8",
                      "quantization.kv_cache=fp8", "validation.workload.input_tokens=1024",
                      "validation.workload.output_tokens=1024"])
    cmd = crosscheck.command(spec, gpus.resolve(spec), 64, "/venv/bin/aiconfigurator")
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[:3] == ["/venv/bin/aiconfigurator", "cli", "estimate"]
    assert args["--model-path"] == str(REPO / "build" / "configs" / "llama-3-70b")
    assert (args["--system"], args["--backend"], args["--estimate-mode"]) == ("h200_sxm", "trtllm", "agg")
    assert (args["--isl"], args["--osl"], args["--batch-size"]) == ("1024", "1024", "64")
    assert (args["--tp-size"], args["--pp-size"]) == ("4", "1")
    assert (args["--gemm-quant-mode"], args["--kvcache-quant-mode"]) == ("fp8", "fp8")
    assert args["--free-gpu-memory-fraction"] == "0.9"


def test_a_gpu_without_data_is_refused():
    spec = load_spec(REPO / "build" / "llama3-8b-awq-h100.yaml", ["gpu.name=RTX 4090"])
    with pytest.raises(ToolchainError, match="no data for RTX 4090"):
        crosscheck.command(spec, gpus.resolve(spec), 8)
