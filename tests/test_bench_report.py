"""What a report says about its run, against the in-process OpenAI mock: the deployment behind the figures
(report.json and every plot title), a table without copies of other rows or closed-loop schedule rows, plots
without empty per-token panels, the throughput legend, and the token-count note that says which count stands."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import yaml
from PIL import Image
from rich.console import Console

from test_bench_openai import server  # noqa: F401  (the mock server fixture)
from toolchain import __version__
from toolchain.bench.plots import figures
from toolchain.bench.report import print_level, print_summary
from toolchain.bench.run import run_bench
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-llama"
# The spec's words for what runs behind the mock; `auto` resolves from tiny-llama's config (float16).
DEPLOYED = {"target": "cpu", "model": {"checkpoint": str(TINY), "dtype": "auto"}, "parallelism": {"tp": 2},
            "quantization": {"method": "int8_wo"}, "speculative": {"mode": "lookahead"}}


def bench(server_info, name: str, plots: bool = False, words: bool = True, **workload) -> tuple[dict, Path]:
    """A run against the mock; `words`: count with the mock's tokenizer (one token a word) instead of tiny-llama's."""
    url, tok, root = server_info
    wl = {"num_requests": 8, "warmup_requests": 1, "concurrency": 2, "input_tokens": 16, "output_tokens": 6,
          "endpoint": "mock", "protocol": "openai-completions", **workload}
    path = root / f"{name}.yaml"
    model = {**DEPLOYED["model"], **({"tokenizer": str(tok)} if words else {})}
    path.write_text(yaml.safe_dump({"name": name, **DEPLOYED, "model": model, "validation": {"workload": wl}}))
    out = root / name
    return run_bench(load_spec(path), url=url, out_dir=out, plots=plots), path


def table(level: dict) -> list[str]:
    buf = io.StringIO()
    print_level(level, Console(file=buf, width=200))
    return re.findall(r"^│ (\w+)\s+│", buf.getvalue(), re.M)


def test_report_and_plots_name_the_deployment(server):  # noqa: F811
    report, path = bench(server, "named", plots=True)
    expected = {"name": "named", "target": "cpu", "tp": 2, "pp": 1, "dtype": "float16", "quantization": "int8_wo",
                "kv_cache_dtype": "float32", "gpu": "host CPU", "speculative_mode": "lookahead",
                "spec_hash": load_spec(path).spec_hash(), "toolchain_version": __version__}
    assert report["deployment"] == expected
    out = path.parent / "named"
    assert json.loads((out / "report.json").read_text())["deployment"] == expected
    head = "named: cpu tp2 pp1 float16, int8_wo, kv float32, host CPU, speculative lookahead"
    assert report["plots"] == ["latency_vs_load.png", "latency_cdf.png", "itl_by_position.png"]
    for png in report["plots"]:
        assert Image.open(out / png).info["Title"].startswith(head), png
    buf = io.StringIO()
    print_summary(report, Console(file=buf, width=200))
    assert f"deployment: {head}" in buf.getvalue()


def test_table_drops_copies_of_other_rows(server):  # noqa: F811
    completions, _ = bench(server, "copies")
    level = completions["levels"][0]
    # A completion's first chunk carries a token and each chunk one token: TTFR is TTFT, ITL per token is ITL.
    assert level["ttfr_ms"] == level["ttft_ms"] and level["itl_per_token_ms"] == level["itl_ms"]
    rows = table(level)
    assert "ttft" in rows and "itl" in rows and "ttfr" not in rows and "itl_per_token" not in rows
    assert ("e2e_final" in rows) == (level["e2e_final_ms"] != level["e2e_ms"])
    # A chat stream opens with a role-only chunk: TTFR differs and keeps its row.
    chat, _ = bench(server, "chat", protocol="openai-chat")
    assert chat["levels"][0]["ttfr_ms"]["p50"] < chat["levels"][0]["ttft_ms"]["p50"]
    assert "ttfr" in table(chat["levels"][0])


def test_schedule_rows_only_in_open_loop(server):  # noqa: F811
    closed, _ = bench(server, "closed")
    level = closed["levels"][0]
    assert level["ttft_sched_ms"]["n"] and level["send_lag_ms"]["n"]  # measured, and kept in report.json
    assert not {"send_lag", "ttft_sched", "e2e_sched"} & set(table(level))
    opened, _ = bench(server, "open", mode="rate", rate=40)
    assert {"send_lag", "ttft_sched", "e2e_sched"} <= set(table(opened["levels"][0]))


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def test_non_streaming_run_draws_no_per_token_panels(server):  # noqa: F811
    streamed, _ = bench(server, "streamed")
    figs = dict(figures(streamed, []))
    assert _titles(figs["latency_vs_load.png"]) == ["TTFT at c2", "TPOT at c2", "throughput at c2"]
    assert _titles(figs["latency_cdf.png"]) == ["TTFT CDF", "TPOT CDF", "E2E CDF"]
    assert "itl_by_position.png" in figs

    url, _, root = server
    (root / "whole").mkdir(exist_ok=True)
    (root / "whole" / "itl_by_position.png").write_bytes(b"an earlier run's plot")
    whole, _ = bench(server, "whole", plots=True, streaming=False)
    assert whole["tpot_ms"]["n"] == 0 and whole["itl_ms"]["n"] == 0  # one response a request
    assert whole["plots"] == ["latency_vs_load.png", "latency_cdf.png"]
    assert not (root / "whole" / "itl_by_position.png").exists()
    figs = dict(figures(whole, []))
    assert _titles(figs["latency_vs_load.png"]) == ["TTFT at c2", "throughput at c2"]
    assert _titles(figs["latency_cdf.png"]) == ["TTFT CDF", "E2E CDF"]


def test_throughput_panel_has_a_legend_for_both_axes(server):  # noqa: F811
    report, _ = bench(server, "legend", sweep=[1, 2])
    fig = dict(figures(report, []))["latency_vs_load.png"]
    panel = next(ax for ax in fig.axes if ax.get_title() == "throughput vs load")
    legend = panel.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["output tok/s (left)", "req/s (right)"]


def test_one_level_draws_percentile_bars_not_single_dots(server):  # noqa: F811
    """A run of one load level has no load axis: a line per percentile would be one dot each."""
    report, _ = bench(server, "one-level")
    report["slo"] = {"ttft_p90_ms": {"threshold": 5000.0}}  # the SLO line still shows
    fig = dict(figures(report, []))["latency_vs_load.png"]
    dots = [(ax.get_title(), line.get_label()) for ax in fig.axes for line in ax.get_lines()
            if len(line.get_xdata()) == 1]
    assert dots == []
    ttft = next(ax for ax in fig.axes if ax.get_title() == "TTFT at c2")
    heights = [bar.get_height() for bar in ttft.patches]
    assert heights == [report["levels"][0]["ttft_ms"][p] for p in ("p50", "p90", "p99")]
    assert [t.get_text() for t in ttft.get_xticklabels()] == ["p50", "p90", "p99"]
    assert [t.get_text() for t in ttft.get_legend().get_texts()] == ["SLO ttft_p90_ms"]
    throughput = next(ax for ax in fig.axes if ax.get_title() == "throughput at c2")
    assert [t.get_text() for t in throughput.get_legend().get_texts()] == ["output tok/s (left)", "req/s (right)"]
    # A sweep keeps its lines against the load.
    sweep, _ = bench(server, "two-levels", sweep=[1, 2])
    lines = dict(figures(sweep, []))["latency_vs_load.png"].axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [2, 2, 2]


def test_every_console_row_is_explained(server):  # noqa: F811
    """An open-loop sweep over chat shows the most rows (ttfr, the schedule rows): each row the tables print is
    defined under them, and report.json's legend defines every latency key it holds."""
    report, _ = bench(server, "legend-rows", protocol="openai-chat", mode="rate", rate=40, sweep=[20, 40])
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    for level in report["levels"]:
        print_level(level, console)
    print_summary(report, console)
    out = " ".join(buf.getvalue().split())  # rich wraps the legend line
    rows = {row for level in report["levels"] for row in table(level)}
    assert {"ttft", "ttfr", "send_lag", "ttft_sched"} <= rows
    for row in rows:
        assert f" {row}: " in out, row
    for head in ("lag mean", "err", "SLO"):
        assert f"{head}: " in out, head
    assert {k for k in report["levels"][0] if k.endswith("_ms")} <= set(report["legend"])


def test_token_count_note_says_which_count_stands_and_why(server):  # noqa: F811
    """The mock counts one token per word in its usage; tiny-llama's tokenizer splits its words further."""
    report, _ = bench(server, "counts", words=False, output_tokens=8)
    check = report["levels"][0]["token_count_check"]
    assert check["mismatches"] > 0 and check["server_total"] != check["client_total"]
    note = next(n for n in report["notes"] if "server and tokenizer token counts differ" in n)
    assert "OSL and throughput use the server's totals" in note
    assert "re-encodes the streamed text" in note
