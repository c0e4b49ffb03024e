"""report.json, requests.csv and the console table.

Every figure in the report is derived from the raw records by `metrics`; the
CSV keeps one row per request (timestamps relative to the run's monotonic
anchor, whose wall-clock time is in the report) for re-analysis.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from toolchain.bench import metrics as M
from toolchain.bench.records import RequestRecord
from toolchain.fsutil import atomic_file

LATENCY_KEYS = ("ttft_ms", "ttfr_ms", "ttst_ms", "tpot_ms", "itl_ms", "itl_per_token_ms", "e2e_ms", "e2e_final_ms")
FEW_SAMPLES = 100

CSV_COLUMNS = ("index", "request_id", "warmup", "isl", "max_tokens", "osl", "responses", "token_source",
               "t_sched_ms", "t_send_ms", "t_first_resp_ms", "t_first_tok_ms", "t_last_tok_ms", "t_final_ms",
               "ttft_ms", "ttfr_ms", "ttst_ms", "tpot_ms", "e2e_ms", "e2e_final_ms", "error")


def build_report(metrics: dict, slo: dict, *, workload: dict, run: dict, token_count_source: str,
                 osl_mismatches: int) -> dict:
    notes = []
    p99_n = metrics["ttft_ms"]["n"]
    if 0 < p99_n < FEW_SAMPLES:
        notes.append(f"p99 values come from only {p99_n} requests; treat them as indicative (>= {FEW_SAMPLES} advised)")
    if token_count_source == "tokenizer":
        notes.append("output token counts re-tokenise streamed text with the deployment tokenizer (an estimate)")
    if osl_mismatches:
        notes.append(f"{osl_mismatches} requests produced a token count other than max_tokens")
    return {
        **run,
        **metrics,
        "token_count_source": token_count_source,
        "osl_mismatches": osl_mismatches,
        "percentile_method": f"numpy {M.PERCENTILE_METHOD}",
        "stdev_kind": "population",
        "workload": workload,
        "slo": slo,
        "notes": notes,
    }


def _rel(t: int | None, anchor: int) -> float | None:
    return None if t is None else round((t - anchor) / M.NS_PER_MS, 4)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def csv_rows(records: list[RequestRecord], anchor_ns: int):
    for rec in records:
        per = M.request_metrics(rec)
        yield {
            "index": rec.index, "request_id": rec.request_id, "warmup": int(rec.warmup), "isl": rec.isl,
            "max_tokens": rec.max_tokens, "osl": rec.osl, "responses": len(rec.responses),
            "token_source": rec.token_source,
            "t_sched_ms": _rel(rec.t_sched, anchor_ns), "t_send_ms": _rel(rec.t_send, anchor_ns),
            "t_first_resp_ms": _rel(rec.t_first_resp, anchor_ns), "t_first_tok_ms": _rel(rec.t_first_tok, anchor_ns),
            "t_last_tok_ms": _rel(rec.t_last_tok, anchor_ns), "t_final_ms": _rel(rec.t_final, anchor_ns),
            **{f"{k}_ms": _round(per[k]) for k in ("ttft", "ttfr", "ttst", "tpot", "e2e", "e2e_final")},
            "error": rec.error or "",
        }


def write_outputs(out_dir: Path, report: dict, records: list[RequestRecord], anchor_ns: int) -> None:
    out_dir = Path(out_dir)
    with atomic_file(out_dir / "requests.csv", "w") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(csv_rows(records, anchor_ns))
    # report.json last: its presence means the CSV next to it belongs to the same run.
    with atomic_file(out_dir / "report.json", "w") as fh:
        json.dump(report, fh, indent=2, sort_keys=False)
        fh.write("\n")


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"{report.get('model', '')} @ {report.get('url', '')}", title_justify="left")
    table.add_column("metric (ms)")
    for col in ("mean", "p50", "p90", "p95", "p99", "min", "max", "n"):
        table.add_column(col, justify="right")
    for key in LATENCY_KEYS:
        s = report.get(key)
        if not s:
            continue
        table.add_row(key.removesuffix("_ms"), *(_fmt(s[c]) for c in ("mean", "p50", "p90", "p95", "p99", "min", "max")),
                      str(s["n"]))
    console.print(table)
    console.print(
        f"requests {report['num_requests']} ok, {report['errors']} failed, {report['warmup_requests']} warm-up | "
        f"window {_fmt(report['window_s'], 3)} s | {_fmt(report['requests_per_s'])} req/s | "
        f"{_fmt(report['output_tokens_per_s'], 1)} output tok/s | goodput {_fmt(report['goodput_req_per_s'])} req/s "
        f"({_fmt(100 * report['goodput_fraction'] if report['goodput_fraction'] is not None else None, 0)} %) | "
        f"tokens: {report['token_count_source']}")
    for reason, count in report.get("error_reasons", {}).items():
        console.print(f"[red]{count} x {reason}[/red]")
    slo = report["slo"]
    for name, check in slo.items():
        if name == "passed":
            continue
        mark = "[green]pass[/green]" if check["passed"] else "[red]FAIL[/red]"
        if name == "errors":
            console.print(f"failed requests: {check['measured']} (must be 0)  {mark}")
        else:
            console.print(f"SLO {name}: measured {_fmt(check['measured'])} vs threshold {check['threshold']}  {mark}")
    console.print("[green]SLO passed[/green]" if slo["passed"] else "[red]SLO missed[/red]")
    for note in report.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")
