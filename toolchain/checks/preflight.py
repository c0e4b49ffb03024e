"""Preflight checks: every known failure that can be caught before a stage starts.

`toolchain plan` runs them all; `convert`, `build-engine`, `model-repo`, `serve` and `deploy` run the
ones guarding them through `run_preflight` and refuse to start on a failure unless `--skip-check ID`
names it. Importing the check modules below registers them (toolchain/checks/registry.py), in this
order, which is the order `toolchain plan` lists them.
"""

from __future__ import annotations

from toolchain.checks import engine, llmapi, lora, serving, speculative  # noqa: F401  (registers the checks)
from toolchain.checks.registry import (FAIL, GUARDED, PASS, REGISTRY, SKIP, WARN, CheckResult, Context, applies,
                                       build_context)
from toolchain.errors import ToolchainError

__all__ = ["FAIL", "GUARDED", "PASS", "REGISTRY", "SKIP", "WARN", "CheckResult", "Context", "PreflightFailed",
           "build_context", "check_skip_ids", "run_checks", "run_preflight"]


def check_skip_ids(skip: tuple[str, ...] | list[str]) -> None:
    """Refuse a --skip-check id no check has (a typo would silently skip nothing)."""
    unknown = [s for s in skip if s not in REGISTRY]
    if unknown:
        raise ToolchainError(f"unknown check id '{unknown[0]}' in --skip-check",
                             "`toolchain plan SPEC` lists every check id")


def run_checks(ctx: Context, skip: tuple[str, ...] | list[str] = ()) -> list[CheckResult]:
    """Run every check that applies to ctx.stage and the target's path, in registration order; one for
    another device is listed as skipped, naming the target it applies to."""
    check_skip_ids(skip)
    results = []
    row = ctx.row
    for chk in REGISTRY.values():
        if not applies(chk, ctx.stage) or row.path not in chk.paths:
            continue
        if chk.id in skip:
            results.append(CheckResult(chk.id, SKIP, "skipped by --skip-check"))
            continue
        if row.device not in chk.devices:
            results.append(CheckResult(chk.id, *(chk.elsewhere or (SKIP, chk.device_skip(row.path)))))
            continue
        try:
            status, message = chk.fn(ctx)
        except ToolchainError as err:
            status, message = FAIL, str(err)
        results.append(CheckResult(chk.id, status, message))
    return results


class PreflightFailed(ToolchainError):
    """A stage refused to start because a preflight check failed."""


def run_preflight(spec, stage: str, workspace=None, skip: tuple[str, ...] | list[str] = (),
                  enforce: bool = True) -> list[CheckResult]:
    """Run the checks guarding `stage`; raise PreflightFailed naming the failed
    ids unless `enforce` is False (dry runs only report)."""
    results = run_checks(build_context(spec, stage, workspace), skip)
    failed = [r for r in results if r.status == FAIL]
    if failed and enforce:
        first = failed[0]
        more = f" (and {len(failed) - 1} more: {', '.join(r.id for r in failed[1:])})" if len(failed) > 1 else ""
        raise PreflightFailed(f"preflight check {first.id} failed: {first.message}{more}",
                              f"fix the spec, or pass --skip-check {first.id} to {stage} anyway")
    return results
