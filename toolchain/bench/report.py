"""report.json, requests.csv and the console tables.

Every figure is derived from the raw records by `metrics`. report.json holds
one entry per load level under `levels` and a `sweep` summary; the top-level
metric keys (ttft_ms, tpot_ms, itl_ms, e2e_ms, output_tokens_per_s,
requests_per_s, num_requests, ...) are the single level of a one-level run, or
the last (highest) level of a sweep, and `slo.passed` is true only when every
level met every threshold. The CSV keeps one row per request (times in ms
after the run's monotonic anchor, whose wall-clock time is `started_at`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from toolchain.bench import metrics as M
from toolchain.bench.deployment import title as deployment_title
from toolchain.bench.prediction import summary_lines
from toolchain.bench.records import RequestRecord
from toolchain.fsutil import atomic_file
from rich.console import Console
from rich.table import Table

LATENCY_KEYS = ("ttft_ms", "ttfr_ms", "ttst_ms", "tpot_ms", "itl_ms", "itl_per_token_ms", "e2e_ms", "e2e_final_ms",
                "send_lag_ms", "ttft_sched_ms", "e2e_sched_ms")
FEW_SAMPLES = 100
# Rows the table drops when their figures are those of another row: ttfr is ttft when the first response
# carries a token, e2e_final is e2e when the final flag rides on the last token, itl_per_token is itl
# when every response carries one token. report.json keeps them all.
SAME_AS = {"ttfr_ms": "ttft_ms", "e2e_final_ms": "e2e_ms", "itl_per_token_ms": "itl_ms"}
# Schedule figures only mean something open loop: closed loop sends the moment a slot frees.
SCHEDULE_KEYS = ("send_lag_ms", "ttft_sched_ms", "e2e_sched_ms")
_STATS = ("mean", "p50", "p90", "p95", "p99", "min", "max")
# What each row of the console tables measures: printed under the tables for the rows they showed, and kept
# whole in report.json's `legend` (the definitions are metrics.request_metrics' and level_metrics').
LEGEND = {
    "ttft": "send -> first response carrying a token",
    "ttfr": "send -> first response of any kind",
    "ttst": "first token-bearing response -> the second",
    "tpot": "(last token - first token) / (output tokens - those of the first token-bearing response)",
    "itl": "gap between consecutive token-bearing responses",
    "itl_per_token": "that gap / the tokens the later response carries",
    "e2e": "send -> last token",
    "e2e_final": "send -> the response flagged final",
    "send_lag": "send - scheduled send (open loop: the client falling behind)",
    "ttft_sched": "scheduled send -> first token",
    "e2e_sched": "scheduled send -> last token",
    "goodput": "requests per second that met every SLO threshold (%: their share of the requests)",
    "window": "first send -> last token: what req/s, tok/s and goodput are over",
}
SWEEP_LEGEND = {"load": "concurrency or request rate of the level", "lag mean": "mean send lag (ms)",
                "err": "failed requests", "SLO": "the level met every SLO threshold"}

CSV_COLUMNS = ("index", "request_id", "level", "class", "adapter", "session", "turn", "warmup", "isl", "max_tokens", "osl",
               "server_osl", "client_osl", "responses", "token_source", "t_sched_ms", "t_send_ms", "t_first_resp_ms",
               "t_first_tok_ms", "t_last_tok_ms", "t_final_ms", "send_lag_ms", "ttft_ms", "ttfr_ms", "ttst_ms",
               "tpot_ms", "e2e_ms", "e2e_final_ms", "ttft_sched_ms", "draft_tokens", "accepted_draft_tokens",
               "cancelled", "timed_out", "error")


def level_notes(metrics: dict, token_source: str, osl_mismatches: int, open_loop: bool = True) -> list[str]:
    notes = []
    n = metrics["ttft_ms"]["n"]
    if 0 < n < FEW_SAMPLES:
        notes.append(f"p99 values come from only {n} requests; treat them as indicative (>= {FEW_SAMPLES} advised)")
    if token_source == "tokenizer":
        notes.append("output token counts re-tokenise streamed text with the deployment tokenizer (an estimate)")
    elif token_source == "server-total":
        notes.append("OSL is the server's usage total; per-chunk counts (ITL per token) are tokenizer estimates")
    if osl_mismatches:
        notes.append(f"{osl_mismatches} requests produced a token count other than max_tokens")
    check = metrics.get("token_count_check", {})
    if check.get("mismatches"):
        used = {"server": "OSL, TPOT and throughput use the server's counts",
                "server-total": "OSL and throughput use the server's totals (per-chunk splits are the tokenizer's)",
                }.get(token_source, f"the figures use the {token_source} counts")
        notes.append(f"server and tokenizer token counts differ for {check['mismatches']} of "
                     f"{check['requests_with_both']} requests ({check['server_total']} vs {check['client_total']} "
                     f"tokens): {used}; the tokenizer re-encodes the streamed text, which need not give back the "
                     "generated ids (tokens merged or split at chunk joins, EOS and other special tokens that "
                     "decode to no text)")
    lag = metrics["send_lag_ms"]
    if open_loop and lag["n"] and lag["mean"] is not None and lag["mean"] > 1.0:
        notes.append(f"mean send lag {lag['mean']:.2f} ms: the client fell behind its schedule; trust the "
                     "*_sched_ms figures, and the achieved rate, over the nominal load")
    return notes


def sweep_row(level: dict) -> dict:
    def s(key, stat):
        return (level.get(key) or {}).get(stat)

    return {"level": level["level"], "mode": level["load"]["mode"], "load": level["load"]["value"],
            "requests_per_s": level["requests_per_s"], "output_tokens_per_s": level["output_tokens_per_s"],
            "goodput_req_per_s": level["goodput_req_per_s"], "ttft_p50_ms": s("ttft_ms", "p50"),
            "ttft_p99_ms": s("ttft_ms", "p99"), "tpot_p50_ms": s("tpot_ms", "p50"), "tpot_p99_ms": s("tpot_ms", "p99"),
            "itl_p99_ms": s("itl_ms", "p99"), "e2e_p99_ms": s("e2e_ms", "p99"), "send_lag_mean_ms": s("send_lag_ms", "mean"),
            "send_lag_p99_ms": s("send_lag_ms", "p99"), "num_requests": level["num_requests"],
            "errors": level["errors"], "cancelled": level["cancelled"], "slo_passed": level["slo"]["passed"]}


def build_report(levels: list[dict], *, run: dict, workload: dict, notes: list[str]) -> dict:
    last = levels[-1] if levels else {}
    top = {k: v for k, v in last.items() if k not in ("level", "slo", "notes")}
    passed = bool(levels) and all(lv["slo"]["passed"] for lv in levels) and run.get("aborted") is None
    failing = next((lv for lv in levels if not lv["slo"]["passed"]), last)
    slo = {**(failing.get("slo") or {"errors": {"threshold": 0, "measured": 0, "passed": True}}), "passed": passed}
    if len(levels) > 1:
        slo["level"] = failing.get("level")
    rows = [sweep_row(lv) for lv in levels]
    held = [r["load"] for r in rows if r["slo_passed"]]
    return {
        **run, **top,
        "percentile_method": f"numpy {M.PERCENTILE_METHOD}", "stdev_kind": "population",
        "workload": workload, "slo": slo,
        "sweep": {"levels": rows, "max_load_meeting_slo": max(held) if held else None},
        "levels": levels,
        "legend": {**{f"{k}_ms" if f"{k}_ms" in LATENCY_KEYS else k: v for k, v in LEGEND.items()},
                   **{f"sweep {k}": v for k, v in SWEEP_LEGEND.items()}},
        "notes": notes + [f"level {lv['level']} ({lv['load']['value']:g}): {n}" for lv in levels for n in lv["notes"]],
    }


def _rel(t: int | None, anchor: int) -> float | None:
    return None if t is None else round((t - anchor) / M.NS_PER_MS, 4)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def csv_rows(records: list[RequestRecord], anchor_ns: int):
    for rec in records:
        per = M.request_metrics(rec)
        yield {
            "index": rec.index, "request_id": rec.request_id, "level": rec.level, "class": rec.cls,
            "adapter": rec.adapter or "",
            "session": "" if rec.session is None else rec.session, "turn": rec.turn, "warmup": int(rec.warmup),
            "isl": rec.isl, "max_tokens": rec.max_tokens, "osl": rec.osl,
            "server_osl": "" if rec.server_osl is None else rec.server_osl,
            "client_osl": "" if rec.client_osl is None else rec.client_osl,
            "responses": len(rec.responses), "token_source": rec.token_source,
            "t_sched_ms": _rel(rec.t_sched, anchor_ns), "t_send_ms": _rel(rec.t_send, anchor_ns),
            "t_first_resp_ms": _rel(rec.t_first_resp, anchor_ns), "t_first_tok_ms": _rel(rec.t_first_tok, anchor_ns),
            "t_last_tok_ms": _rel(rec.t_last_tok, anchor_ns), "t_final_ms": _rel(rec.t_final, anchor_ns),
            **{f"{k}_ms": _round(per[k]) for k in ("send_lag", "ttft", "ttfr", "ttst", "tpot", "e2e", "e2e_final",
                                                   "ttft_sched")},
            "draft_tokens": "" if rec.draft_tokens is None else rec.draft_tokens,
            "accepted_draft_tokens": "" if rec.accepted_draft_tokens is None else rec.accepted_draft_tokens,
            "cancelled": int(rec.cancelled), "timed_out": int(rec.timed_out), "error": rec.error or "",
        }


def write_outputs(out_dir: Path, report: dict, records: list[RequestRecord], anchor_ns: int,
                  with_report: bool = True) -> None:
    """requests.csv, then report.json unless the caller saves it itself (`deploy`, once its stage timings
    are known: write_report)."""
    out_dir = Path(out_dir)
    with atomic_file(out_dir / "requests.csv", "w") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(csv_rows(records, anchor_ns))
    if with_report:
        write_report(out_dir, report)


def write_report(out_dir: Path, report: dict) -> Path:
    """out_dir/report.json, atomically. Written after requests.csv: its presence means the CSV next to it
    belongs to the same run."""
    path = Path(out_dir) / "report.json"
    with atomic_file(path, "w") as fh:
        json.dump(report, fh, indent=2, sort_keys=False)
        fh.write("\n")
    return path


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _console():
    """A console wide enough for the latency table: rich falls back to 80
    columns when the output is not a terminal (make demo | tee, CI logs), which
    would cut the metric names and figures."""
    import shutil

    return Console(width=max(110, shutil.get_terminal_size((110, 24)).columns))


def table_keys(level: dict) -> tuple[list[str], list[str]]:
    """The latency rows a level's table shows, and 'ttfr = ttft' for each row left out as a copy of another;
    rows without samples, and the schedule rows of a closed-loop level, are left out too."""
    closed = level["load"]["mode"] == "concurrency"
    keys, same = [], []
    for key in LATENCY_KEYS:
        s = level.get(key)
        if not s or not s["n"] or closed and key in SCHEDULE_KEYS:
            continue
        twin = level.get(SAME_AS.get(key, ""))
        if twin and all(twin[c] == s[c] for c in (*_STATS, "n")):
            same.append(f"{key.removesuffix('_ms')} = {SAME_AS[key].removesuffix('_ms')}")
            continue
        keys.append(key)
    return keys, same


def print_level(level: dict, console=None, title: str = "") -> None:
    console = console or _console()
    load = level["load"]
    table = Table(title=title or f"level {level['level']}: {load['mode']} {load['value']:g}", title_justify="left")
    table.add_column("metric (ms)", no_wrap=True)
    for col in ("mean", "p50", "p90", "p95", "p99", "min", "max", "n"):
        table.add_column(col, justify="right", no_wrap=True)
    keys, same = table_keys(level)
    for key in keys:
        s = level[key]
        table.add_row(key.removesuffix("_ms"), *(_fmt(s[c]) for c in _STATS), str(s["n"]))
    console.print(table)
    if same:
        console.print(f"[dim]not shown, equal to another row: {', '.join(same)}[/dim]")
    gf = level["goodput_fraction"]
    console.print(
        f"requests {level['num_requests']} ok, {level['errors']} failed, {level['cancelled']} cancelled, "
        f"{level['warmup_requests']} warm-up | window {_fmt(level['window_s'], 3)} s | "
        f"{_fmt(level['requests_per_s'])} req/s | {_fmt(level['output_tokens_per_s'], 1)} output tok/s | "
        f"goodput {_fmt(level['goodput_req_per_s'])} req/s ({_fmt(100 * gf if gf is not None else None, 0)} %) | "
        f"tokens: {level['token_count_source']}")
    for name, c in (level.get("per_class") or {}).items():
        on = f" (adapter {c['adapter']})" if c.get("adapter") else ""
        console.print(f"  class {name}{on}: {c['num_requests']} ok, TTFT p99 {_fmt(c['ttft_ms']['p99'])} ms, "
                      f"TPOT p99 {_fmt(c['tpot_ms']['p99'])} ms, E2E p99 {_fmt(c['e2e_ms']['p99'])} ms")
    spec = level.get("speculation")
    if spec:
        console.print(f"speculation: {spec['accepted_draft_tokens']} of {spec['draft_tokens']} draft tokens accepted "
                      f"(acceptance {_fmt(100 * spec['acceptance_rate'], 0)} %, over {spec['requests']} requests)")
    for reason, count in level.get("error_reasons", {}).items():
        console.print(f"[red]{count} x {reason}[/red]")
    srv = level.get("server") or {}
    if srv.get("available"):
        console.print(f"[dim]server: {_num(srv.get('server_requests_success'))} requests succeeded, "
                      f"{_num(srv.get('server_requests_failure'))} failed on '{srv.get('endpoint_model')}'[/dim]")
        sspec = srv.get("speculation")
        if sspec and not spec:
            console.print(f"speculation (server): {sspec['accepted_draft_tokens']} of {sspec['draft_tokens']} draft "
                          f"tokens accepted (acceptance {_fmt(100 * sspec['acceptance_rate'], 0)} %, "
                          f"{_fmt(sspec['accepted_per_step'])} accepted per step)")


def _num(v) -> str:
    return "-" if v is None else f"{v:g}"


def print_summary(report: dict, console=None) -> None:
    console = console or _console()
    rows = report["sweep"]["levels"]
    if len(rows) > 1:
        t = Table(title="sweep", title_justify="left")
        cols = [("load", "load"), ("req/s", "requests_per_s"), ("tok/s", "output_tokens_per_s"),
                ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("TPOT p50", "tpot_p50_ms"),
                ("TPOT p99", "tpot_p99_ms"), ("ITL p99", "itl_p99_ms"), ("E2E p99", "e2e_p99_ms"),
                ("lag mean", "send_lag_mean_ms"), ("err", "errors"), ("SLO", "slo_passed")]
        if all(r["mode"] == "concurrency" for r in rows):  # no schedule to lag behind
            cols.remove(("lag mean", "send_lag_mean_ms"))
        for head, _ in cols:
            t.add_column(head, justify="right")
        for r in rows:
            t.add_row(*(("pass" if r[k] else "FAIL") if k == "slo_passed" else
                        (f"{r[k]:g}" if k in ("load", "errors") else _fmt(r[k])) for _, k in cols))
        console.print(t)
        console.print(f"[dim]{'; '.join(f'{h}: {w}' for h, w in SWEEP_LEGEND.items() if h in dict(cols))}; "
                      "latencies in ms[/dim]")
        console.print(f"highest load meeting the SLOs: {_num(report['sweep']['max_load_meeting_slo'])}")
    shown = {key.removesuffix("_ms") for level in report.get("levels", []) for key in table_keys(level)[0]}
    if shown:
        console.print(f"[dim]rows (ms): {'; '.join(f'{k}: {w}' for k, w in LEGEND.items() if k in shown)}; "
                      f"goodput: {LEGEND['goodput']}; window: {LEGEND['window']}[/dim]")
    deployed = deployment_title(report.get("deployment"))
    if deployed:
        console.print(f"deployment: {deployed}")
    slo = report["slo"]
    for name, check in slo.items():
        if not isinstance(check, dict):
            continue
        mark = "[green]pass[/green]" if check["passed"] else "[red]FAIL[/red]"
        if name == "errors":
            console.print(f"failed requests: {check['measured']} (must be 0)  {mark}")
        else:
            console.print(f"SLO {name}: measured {_fmt(check['measured'])} vs {check['threshold']:g}  {mark}")
    if report.get("aborted"):
        console.print(f"[red]incomplete: {report['aborted']}[/red]")
    console.print("[green]SLO passed[/green]" if slo["passed"] else "[red]SLO missed[/red]")
    for line in summary_lines(report.get("prediction")):
        console.print(line, style="yellow" if line.startswith("warning:") else None, markup=False)
    for note in report.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")


def print_report(report: dict, console=None) -> None:
    """Every level's table, then the sweep summary and the verdict."""
    for level in report.get("levels", []):
        print_level(level, console, title=f"{report.get('model', '')} @ {report.get('url', '')} - level "
                                          f"{level['level']}: {level['load']['mode']} {level['load']['value']:g}")
    print_summary(report, console)
