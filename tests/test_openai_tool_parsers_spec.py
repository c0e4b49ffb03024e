"""llmapi.tool_parser / llmapi.reasoning_parser: every line that starts trtllm-serve or the CPU OpenAI server
passes them under trtllm-serve's own option names (read from upstream's serve.py, facts/llmapi.json), and plan
refuses a parser that does not exist or a family no upstream parser reads, in one line."""

from __future__ import annotations

import shlex

import pytest

from conftest import write_spec
from toolchain.llmapi import launch
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

PARSERS = {"tool_parser": "qwen3", "reasoning_parser": "qwen3"}


def _spec(tmp_path, checkpoint, target="llmapi", **llmapi):
    return load_spec(write_spec(tmp_path / f"{target}.yaml", checkpoint, name="tools-model", target=target,
                                llmapi=llmapi))


def _value(argv: list[str], option: str) -> str | None:
    return argv[argv.index(option) + 1] if option in argv else None


def test_launch_lines_pass_the_parsers_by_upstreams_names(tmp_path, hf_qwen3):
    from toolchain.pipeline import openai_server

    ws = Workspace(tmp_path / "ws")
    # tp 8 x pp 2 on hosts of 8 GPUs: the srun line is rendered too.
    gpu = load_spec(write_spec(tmp_path / "gpu.yaml", hf_qwen3, name="tools-model", target="llmapi",
                               parallelism={"tp": 8, "pp": 2}, gpu={"per_node": 8}, llmapi=PARSERS))
    lines = launch.gpu_launch_lines(gpu, ws)
    for key in ("trtllm_serve", "trtllm_serve_multi_node"):
        argv = shlex.split(lines[key])
        assert _value(argv, "--tool_parser") == "qwen3" and _value(argv, "--reasoning_parser") == "qwen3", key
        assert {"--tool_parser", "--reasoning_parser"} <= set(launch.serve_options())
    cpu = _spec(tmp_path, hf_qwen3, target="llmapi-cpu", **PARSERS)
    for argv in (launch.openai_cpu_command(cpu, ws), openai_server(cpu, ws, tmp_path / "log").command(),
                 shlex.split(launch.planned_launch(cpu, ws)["openai_command"])):
        assert _value(argv, "--tool_parser") == "qwen3" and _value(argv, "--reasoning_parser") == "qwen3"
    # And the CPU server takes what it is given (its own argument parser knows the names).
    from toolchain.openai.__main__ import _args

    args = _args(launch.openai_cpu_command(cpu, ws)[3:])
    assert (args.tool_parser, args.reasoning_parser) == ("qwen3", "qwen3")
    # No parser in the spec: no option on any line.
    plain = _spec(tmp_path, hf_qwen3, target="llmapi-cpu")
    assert "--tool_parser" not in launch.openai_cpu_command(plain, ws)
    assert "--tool_parser" not in shlex.split(launch.gpu_launch_lines(_spec(tmp_path, hf_qwen3), ws)["trtllm_serve"])


def _check(spec):
    from toolchain.checks.preflight import build_context, run_checks

    return {r.id: r for r in run_checks(build_context(spec, "plan"))}["llmapi.parsers"]


@pytest.mark.parametrize("target, llmapi, status, words", [
    ("llmapi-cpu", PARSERS, "pass", "--tool_parser qwen3, --reasoning_parser qwen3"),
    ("llmapi", {"tool_parser": "qwen3_coder"}, "pass", "--tool_parser qwen3_coder"),  # trtllm-serve has it
    ("llmapi-cpu", {"tool_parser": "qwen3_coder"}, "fail", "it implements qwen3, deepseekv3"),
    ("llmapi", {"tool_parser": "hermes"}, "fail", "trtllm-serve's --tool_parser takes qwen3, qwen3_coder, kimi_k2"),
    ("llmapi", {"reasoning_parser": "r1"}, "fail", "--reasoning_parser takes deepseek-r1, qwen3"),
])
def test_plan_checks_the_parser_names(tmp_path, hf_qwen3, target, llmapi, status, words):
    result = _check(_spec(tmp_path, hf_qwen3, target=target, **llmapi))
    assert result.status == status and words in result.message and "\n" not in result.message, result


def test_plan_refuses_a_tool_parser_for_a_family_upstream_has_none_for(tmp_path, hf_llama):
    result = _check(_spec(tmp_path, hf_llama, target="llmapi-cpu", tool_parser="qwen3"))
    assert result.status == "fail"
    assert result.message.startswith("trtllm-serve has no tool parser for the llama family's tool-call format")
    assert _check(_spec(tmp_path, hf_llama, target="llmapi-cpu", reasoning_parser="deepseek-r1")).status == "pass"


def test_dynamo_refuses_the_parsers_rather_than_dropping_them(tmp_path, hf_qwen3):
    from toolchain.dynamo.checks import problems

    found = problems(_spec(tmp_path, hf_qwen3, target="llmapi-cpu", **PARSERS))
    assert any(p.startswith("llmapi.tool_parser and llmapi.reasoning_parser name trtllm-serve's parsers") for p in found)
    assert not any("parser" in p for p in problems(_spec(tmp_path, hf_qwen3, target="llmapi-cpu")))


def test_the_reasoning_parser_is_set_in_its_own_field_not_in_llmapi_options(tmp_path, hf_qwen3):
    from toolchain.llmapi.args import options_problem

    spec = load_spec(write_spec(tmp_path / "o.yaml", hf_qwen3, target="llmapi-cpu",
                                llmapi={"options": {"reasoning_parser": "qwen3"}}))
    assert options_problem(spec).startswith("llmapi.options.reasoning_parser is derived from llmapi.reasoning_parser")
