"""`toolchain bench` option plumbing that needs no server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolchain.cli import main as cli_main
from toolchain.cli.bench import default_url, missed_slos
from toolchain.errors import ToolchainError
from toolchain.spec import spec_from_dict


def spec(**serving):
    return spec_from_dict({"serving": serving}, base=Path("."))


def test_default_url_from_spec():
    assert default_url(spec(host="10.0.0.5", grpc_port=9001)) == "10.0.0.5:9001"
    assert default_url(spec(host="0.0.0.0", grpc_port=8001)) == "127.0.0.1:8001"
    with pytest.raises(ToolchainError, match="grpc_port is 0"):
        default_url(spec(grpc_port=0))


def test_missed_slos_names_each_miss():
    slo = {"passed": False, "ttft_p99_ms": {"threshold": 5, "measured": 51.234567, "passed": False},
           "tpot_p99_ms": {"threshold": 50, "measured": 10.0, "passed": True},
           "errors": {"threshold": 0, "measured": 2, "passed": False}}
    assert missed_slos(slo) == "ttft_p99_ms 51.2346 > 5, errors 2 > 0"


def test_workload_too_long_for_the_engine_is_a_user_error(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"limits": {"max_input_len": 16, "max_seq_len": 64},
                                    "validation": {"workload": {"input_tokens": 32}}}))
    assert cli_main(["bench", str(path), "--url", "127.0.0.1:1"]) == 2
    assert "input_tokens (32) exceeds limits.max_input_len (16)" in capsys.readouterr().err
