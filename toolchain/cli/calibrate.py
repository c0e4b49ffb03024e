"""`toolchain calibrate REPORT...`: refit the performance model's device row from the user's own runs, into the
user's cache, where later plans of that GPU, path and TensorRT-LLM version find it (plan/calibrate.py,
plan/perf/calibrated.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from toolchain.errors import ToolchainError
from toolchain.plan.calibrate import Calibration, calibrate
from toolchain.plan.perf.calibrated import IGNORE_ENV, cache_dir, cached_rows, clear_rows, save_row
from toolchain.plan.reports import TRTLLM_BENCH, Facts, read_report
from toolchain.quant.formats import METHODS


def _lines(result: Calibration, written: Path | None) -> list[str]:
    d = result.doc
    err = d["error_pct"]
    lines = [f"calibrated {d['gpu']} ({d['path']}, TensorRT-LLM {d['trtllm_version']}) on {len(d['points'])} "
             f"point(s) of {len(d['reports'])} report(s)",
             f"  fitted: {', '.join(d['fitted']['parameters'])} ({d['fitted']['why']}); fields "
             f"{', '.join(d['fitted']['fields'])}",
             "  row: " + ", ".join(f"{n} {d['shipped'][n]:g} -> {d['row'][n]:g}" for n in d["fitted"]["fields"]),
             f"  error: {err['before']:.1f}% with the shipped row, {err['after']:.1f}% fitted"
             + (f", {err['leave_one_out']:.1f}% leave-one-out" if err["leave_one_out"] is not None else
                " (leave-one-out needs 3 reports)")]
    for p in d["points"]:
        vals = "; ".join(f"{k} {v:.4g} measured, {p['before'][k]:.4g} -> {p['after'][k]:.4g}"
                         for k, v in p["measured"].items())
        at = f"c{p['concurrency']}" if p["concurrency"] else "max"
        lines.append(f"  {p['report']} {p['label']}: {p['model']} tp{p['tp']} pp{p['pp']} {p['isl']}/{p['osl']} "
                     f"{at}: {vals}")
    lines += [f"  note: {n}" for n in d["notes"]]
    lines.append(f"wrote {written}" if written else "dry run: nothing written")
    return lines


def _show() -> None:
    rows = cached_rows()
    if not rows:
        click.echo(f"no calibrated rows in {cache_dir()}")
        return
    for file, doc in rows:
        err = doc.get("error_pct", {})
        loo = err.get("leave_one_out")
        click.echo(f"{doc.get('gpu')} ({doc.get('path')}, TensorRT-LLM {doc.get('trtllm_version')}), {doc.get('date')}: "
                   f"{len(doc.get('reports', []))} report(s), fitted {', '.join(doc.get('fitted', {}).get('fields', []))}, "
                   f"error {err.get('after')}%" + (f" ({loo}% leave-one-out)" if loo is not None else "") + f": {file}")


@click.command()
@click.argument("reports", nargs=-1, type=click.Path(path_type=Path))
@click.option("--gpu", help="The GPU the runs used (a GPU-table name), where a report does not say.")
@click.option("--tp", type=click.IntRange(min=1), help="Tensor-parallel size, where a report does not say.")
@click.option("--pp", type=click.IntRange(min=1), help="Pipeline stages, where a report does not say (default 1).")
@click.option("--quantization", "method", type=click.Choice(sorted(METHODS)),
              help="Weight format (a spec's quantization.method), where a report does not say.")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["none", "int8", "fp8"]),
              help="KV-cache precision, where a report does not say.")
@click.option("--path", "path", type=click.Choice(["engine", "pytorch"]),
              help="engine (trtllm-build) or pytorch (the LLM API), where a report does not say.")
@click.option("--version", "version", help="The TensorRT-LLM release that ran them, where a report does not say.")
@click.option("--model", help="A Hugging Face config directory, or one of toolchain/plan/data/models' names.")
@click.option("--spec", "spec_path", type=click.Path(path_type=Path),
              help="A spec (build/x.yaml) of the deployment the runs measured: gives every fact above and its limits.")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="trtllm-bench runs made with --concurrency N (its report does not record it); otherwise a "
                   "trtllm-bench report is a maximum-throughput run.")
@click.option("--dry-run", is_flag=True, help="Fit and print, write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the row file's content as JSON.")
@click.option("--show", is_flag=True, help="List the calibrated rows in the cache.")
@click.option("--clear", is_flag=True, help="Remove every calibrated row from the cache.")
def command(reports: tuple[Path, ...], gpu, tp, pp, method, kv_cache, path, version, model, spec_path, concurrency,
            dry_run: bool, as_json: bool, show: bool, clear: bool) -> None:
    """Refit the performance model's device row from REPORT files of real runs, into the user's cache.

    Reads trtllm-bench --report_json output, AIPerf's profile_export_aiperf.json and this toolchain's bench
    report.json (told apart by their keys); what a report does not record comes from the flags or --spec. Each
    run is predicted as `toolchain plan` predicts it, and the shipped row of its GPU, path and TensorRT-LLM
    version is refitted with as many multipliers as the reports pin. Later plans of a spec on that GPU, path and
    version use the row and say so in their basis ($TOOLCHAIN_NO_CALIBRATION=1 ignores the cache)."""
    if show or clear:
        if reports:
            raise ToolchainError("--show and --clear take no reports", "run them on their own")
        if clear:
            removed = clear_rows()
            click.echo(f"removed {len(removed)} calibrated row(s) from {cache_dir()}")
        else:
            _show()
        return
    if not reports:
        raise ToolchainError("no reports given", "pass one or more report files (or --show / --clear)")
    parsed = [read_report(r) for r in reports]
    if concurrency is not None:
        parsed = [_at_concurrency(r, concurrency) for r in parsed]
    flags = Facts(gpu=gpu, tp=tp, pp=pp, method=method, kv_cache=kv_cache, path=path, version=version, model=model)
    result = calibrate(parsed, flags, spec_path)
    written = None if dry_run else save_row(result.doc)
    if as_json:
        click.echo(json.dumps({**result.doc, "written": str(written) if written else None}, indent=2))
    else:
        click.echo("\n".join(_lines(result, written)))
    if written is not None:
        click.echo(f"later plans of {result.doc['gpu']} ({result.doc['path']}) read it; {IGNORE_ENV}=1 ignores it",
                   err=True)


def _at_concurrency(report, concurrency: int):
    """A trtllm-bench report's points at the --concurrency its run used (others keep their own)."""
    if report.format != TRTLLM_BENCH:
        return report
    report.points = [dataclasses.replace(p, concurrency=concurrency, label=f"concurrency {concurrency}")
                     for p in report.points]
    return report
