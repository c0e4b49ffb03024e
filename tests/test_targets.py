"""The targets table (toolchain/targets.py) against the spec that names them."""

from typing import get_args

from toolchain.spec import DeploymentSpec
from toolchain.targets import TARGETS, named, target_of


def test_every_spec_target_has_a_row_and_no_row_is_unreachable():
    assert set(get_args(DeploymentSpec.model_fields["target"].annotation)) == set(TARGETS)


def test_rows_say_what_each_target_is():
    assert [t for t in TARGETS if TARGETS[t].builds_engine] == ["cpu", "trtllm"]
    assert [t for t in TARGETS if TARGETS[t].on_cpu] == ["cpu", "llmapi-cpu"]
    assert named("llmapi", "cpu") == "llmapi-cpu" and named("engine", "gpu") == "trtllm"
    spec = DeploymentSpec(target="llmapi-cpu")
    assert target_of(spec) is TARGETS["llmapi-cpu"] and spec.llmapi_path and spec.on_cpu
    for row in TARGETS.values():
        assert row.default_launch is None or row.default_launch in row.launches
