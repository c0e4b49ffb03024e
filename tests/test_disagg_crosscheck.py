"""AIConfigurator's disaggregated estimate, read as the cross-check reads it (plan/crosscheck.py), from a report
recorded from aiconfigurator 0.12.0 (nothing installs at test time). The fixture
tests/aiconfigurator/estimate-disagg-llama-3.1-70b-h200.txt is the stdout of, from the repository root:
    aiconfigurator cli estimate --model-path build/configs/llama-3.1-70b-instruct --system h200_sxm \\
        --backend trtllm --estimate-mode disagg --isl 4000 --osl 500 --prefill-tp-size 2 --prefill-pp-size 1 \\
        --prefill-batch-size 1 --prefill-num-workers 2 --decode-tp-size 4 --decode-pp-size 1 \\
        --decode-batch-size 64 --decode-num-workers 1 --gemm-quant-mode fp8 --kvcache-quant-mode fp8 \\
        --no-color --log-level ERROR
(benchmarks/disagg_crosscheck.py runs the same command through crosscheck.disagg_command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchain.errors import ToolchainError
from toolchain.plan import crosscheck

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "tests" / "aiconfigurator" / "estimate-disagg-llama-3.1-70b-h200.txt"
AGG = REPO / "tests" / "aiconfigurator" / "estimate-llama-3.1-70b-h200-tp4.txt"


def test_a_disaggregated_report_parses_with_each_roles_lines():
    est = crosscheck.parse(REPORT.read_text())
    assert (est.ttft_ms, est.tpot_ms, est.per_gpu_output_tokens_per_s) == (574.736, 17.332, 352.35)
    assert (est.output_tokens_per_s, est.concurrency) == (2818.8, 64)
    assert est.roles == {"prefill": {"tp": 2, "pp": 1, "bs": 1, "workers": 2, "memory_gb": 38.368},
                         "decode": {"tp": 4, "pp": 1, "bs": 64, "workers": 1, "memory_gb": 31.854}}
    assert est.memory_gb == 38.368  # the larger role's: what one GPU must hold
    # tokens/s/gpu is over every GPU of both roles: 2 x tp 2 + 1 x tp 4
    assert est.per_gpu_output_tokens_per_s == pytest.approx(est.output_tokens_per_s / 8, abs=0.01)


def test_an_aggregated_report_has_no_roles_and_a_cut_one_is_refused():
    assert crosscheck.parse(AGG.read_text()).roles is None
    cut = "\n".join(line for line in REPORT.read_text().splitlines() if "(d) Memory" not in line)
    with pytest.raises(ToolchainError) as err:
        crosscheck.parse(cut)
    assert "lacks memory_gb" in str(err.value) and "\n" not in err.value.message


def test_the_disaggregated_command_is_the_recorded_one():
    cmd = crosscheck.disagg_command("build/configs/llama-3.1-70b-instruct", "h200_sxm", 4000, 500, (2, 1, 2),
                                    (4, 64, 1), "fp8", "fp8")
    recorded = [line.strip(" \\") for line in (__doc__ or "").splitlines() if line.startswith("    ")]
    assert " ".join(cmd) == " ".join(" ".join(recorded).split())
