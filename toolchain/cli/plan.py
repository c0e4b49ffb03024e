"""`toolchain plan SPEC`: memory per rank, the verdict, the exact build and launch
commands, and every preflight check, before anything is built."""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from toolchain.cli._common import Context, spec_command
from toolchain.errors import StageFailed, ToolchainError
from toolchain.engine.build import planned_commands
from toolchain.triton.launch import launch_command
from toolchain.checks.preflight import build_context, run_checks
from toolchain.checks.render import render_text, report_dict
from toolchain.llmapi.launch import planned_launch
from toolchain.triton.server import TritonServer


def _commands(spec, ws) -> dict:
    """trtllm-build and launch lines as build-engine and serve would run them."""
    if spec.llmapi_path:

        return {"build_commands": [], "build_note": "none on the LLM-API path (the PyTorch backend loads the "
                "checkpoint at start)", **planned_launch(spec, ws)}
    if spec.target != "trtllm":

        server = TritonServer.from_spec(spec, ws.model_repo_dir(spec))
        return {"build_commands": [], "launch_command": server.command_line()}

    out: dict[str, Any] = {"build_commands": [], "build_errors": []}
    try:
        out["build_commands"] = [shlex.join(cmd) for cmd in planned_commands(spec, ws)]
    except ToolchainError as err:  # a flag combination the table refuses: the checks say which
        out["build_errors"].append(str(err))
    out["launch_command"] = launch_command(spec, ws.model_repo_dir(spec)).shell()
    return out


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@spec_command
def command(ctx: Context, spec, skip_checks: tuple[str, ...], as_json: bool) -> None:
    """Plan SPEC before building: weights, KV cache and activations per rank on the spec's GPU
    (`gpu.name`), the verdict, the trtllm-build and launch commands, and every preflight check.
    Exit 0 when it fits and no check fails, 1 otherwise, 2 on an invalid spec."""

    context = build_context(spec, "plan", ctx.workspace)
    report = report_dict(context, run_checks(context, skip_checks))
    report.update(_commands(spec, ctx.workspace))
    click.echo(json.dumps(report, indent=2) if as_json else render_text(report))
    if not report["ok"]:
        why = (f"{len(report['failed_checks'])} check(s) failed: {', '.join(report['failed_checks'])}"
               if report["failed_checks"] else report["verdict"])
        raise StageFailed(f"plan: {why}", "change the spec as the messages say, then plan again")
