"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- latency_vs_load.png: TTFT and TPOT p50/p90/p99 against the load of each
  level, the SLO thresholds as dashed lines, and output throughput; a run of
  one level has no load axis to draw (each line would be a single dot), so it
  shows that level's percentiles and throughput as bars;
- latency_cdf.png: TTFT, TPOT and E2E CDFs, one line per level;
- itl_by_position.png: mean and p90 gap before the k-th token-bearing
  response, one line per level (decode slowing with length, periodic stalls).

Every figure is titled with the deployment (report.json's `deployment`), so a
plot copied elsewhere still says what produced it. A run without per-token
timings (non-streaming: one response a request) draws no TPOT panels and no
ITL figure rather than empty axes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from toolchain.bench import metrics as M
from toolchain.bench.deployment import title as deployment_title
from toolchain.bench.records import RequestRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTS = ("latency_vs_load.png", "latency_cdf.png", "itl_by_position.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _timed(levels: list[dict], key: str) -> bool:
    """Whether any level has samples of `key` (tpot_ms, itl_ms): none without streamed tokens."""
    return any((lv.get(key) or {}).get("n") for lv in levels)


def figures(report: dict, records: list[RequestRecord]) -> list[tuple[str, Figure]]:
    """(file name, matplotlib figure) of every plot this run has data for."""
    levels = report.get("levels", [])
    if not levels:
        return []
    plt = _plt()
    per_token = _timed(levels, "tpot_ms")
    out = [("latency_vs_load.png", _vs_load(plt, report, levels, per_token)),
           ("latency_cdf.png", _cdf(plt, report, levels, records, per_token))]
    if _timed(levels, "itl_ms"):
        out.append(("itl_by_position.png", _itl_position(plt, report, levels, records)))
    head = deployment_title(report.get("deployment"))
    for _, fig in out:
        fig.suptitle("\n".join(t for t in (head, f"{report.get('model', '')} over {report.get('protocol', '')}") if t))
    return out


def write_plots(out_dir: Path, report: dict, records: list[RequestRecord]) -> list[str]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    written = []
    for name, fig in figures(report, records):
        tmp = out_dir / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=110, bbox_inches="tight", metadata={"Title": fig.get_suptitle()})
        plt.close(fig)
        tmp.replace(out_dir / name)
        written.append(name)
    for stale in set(PLOTS) - set(written):  # an earlier run's plot must not pass for this run's
        (out_dir / stale).unlink(missing_ok=True)
    return written


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _label(level: dict) -> str:
    load = level["load"]
    return f"{'c' if load['mode'] == 'concurrency' else 'rate '}{load['value']:g}"


def _slo_lines(ax, report: dict, metric: str) -> None:
    for name, check in (report.get("slo") or {}).items():
        if isinstance(check, dict) and name.startswith(metric + "_p") and name.endswith("_ms"):
            ax.axhline(check["threshold"], color="red", linestyle="--", linewidth=1, label=f"SLO {name}")


def _vs_load(plt, report, levels, per_token: bool):
    if len(levels) == 1:
        return _at_load(plt, report, levels[0], per_token)
    panels = [("ttft", "TTFT")] + ([("tpot", "TPOT")] if per_token else [])
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.6), layout="constrained")
    x = [lv["load"]["value"] for lv in levels]
    xlabel = "concurrency" if levels[0]["load"]["mode"] == "concurrency" else "request rate (req/s)"
    for ax, (key, name) in zip(axes, panels, strict=False):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
            y = [lv[f"{key}_ms"][stat] for lv in levels]
            ax.plot(x, [np.nan if v is None else v for v in y], style, label=stat)
        _slo_lines(ax, report, key)
        ax.set(title=f"{name} vs load", xlabel=xlabel, ylabel="ms")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    ax = axes[-1]
    ax.plot(x, [lv["output_tokens_per_s"] or np.nan for lv in levels], "o-", label="output tok/s (left)")
    ax.set(title="throughput vs load", xlabel=xlabel, ylabel="output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(x, [lv["requests_per_s"] or np.nan for lv in levels], "s--", color="gray", markerfacecolor="none",
             markersize=9, label="req/s (right)")
    ax2.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    _twin_legend(ax, ax2)
    return fig


def _twin_legend(ax, ax2) -> None:
    # Two y axes: one legend for both, or the gray one is unexplained.
    handles, labels = ax.get_legend_handles_labels()
    handles2, labels2 = ax2.get_legend_handles_labels()
    ax.legend(handles + handles2, labels + labels2, fontsize=8, loc="upper left")


def _at_load(plt, report, level: dict, per_token: bool):
    """One level: p50/p90/p99 bars per metric (values written on them) and the throughput as two bars."""
    panels = [("ttft", "TTFT")] + ([("tpot", "TPOT")] if per_token else [])
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.6), layout="constrained")
    at = _label(level)
    stats = ("p50", "p90", "p99")
    for ax, (key, name) in zip(axes, panels, strict=False):
        y = [level[f"{key}_ms"][stat] for stat in stats]
        bars = ax.bar(stats, [0 if v is None else v for v in y], color="tab:blue")
        ax.bar_label(bars, labels=["-" if v is None else f"{v:.3g}" for v in y], fontsize=8)
        _slo_lines(ax, report, key)
        ax.set(title=f"{name} at {at}", xlabel="percentile", ylabel="ms")
        ax.grid(alpha=0.3, axis="y")
        _legend(ax, fontsize=8)
    ax = axes[-1]
    tok_s, req_s = level["output_tokens_per_s"] or 0, level["requests_per_s"] or 0
    bar = ax.bar([0], [tok_s], color="tab:blue", label="output tok/s (left)")
    ax.bar_label(bar, labels=[f"{tok_s:.3g}"], fontsize=8)
    ax.set(title=f"throughput at {at}", ylabel="output tokens/s", xticks=[0, 1],
           xticklabels=["output tok/s", "req/s"])
    ax2 = ax.twinx()
    bar2 = ax2.bar([1], [req_s], color="gray", label="req/s (right)")
    ax2.bar_label(bar2, labels=[f"{req_s:.3g}"], fontsize=8)
    ax2.set_ylabel("requests/s")
    ax.grid(alpha=0.3, axis="y")
    _twin_legend(ax, ax2)
    return fig


def _per_level_values(records, level: int, key: str) -> np.ndarray:
    vals = [M.request_metrics(r)[key] for r in records if r.level == level and not r.warmup and r.ok]
    return np.sort(np.asarray([v for v in vals if v is not None], float))


def _cdf(plt, report, levels, records, per_token: bool):
    panels = [("ttft", "TTFT")] + ([("tpot", "TPOT")] if per_token else []) + [("e2e", "E2E")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), layout="constrained")
    for ax, (key, title) in zip(axes, panels, strict=False):
        for lv in levels:
            v = _per_level_values(records, lv["level"], key)
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=_label(lv))
        _vline_slo(ax, report, key)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    return fig


def _vline_slo(ax, report, metric):
    for name, check in (report.get("slo") or {}).items():
        if isinstance(check, dict) and name.startswith(metric + "_p") and name.endswith("_ms"):
            ax.axvline(check["threshold"], color="red", linestyle="--", linewidth=1, label=f"SLO {name}")


def _itl_position(plt, report, levels, records):
    fig, ax = plt.subplots(figsize=(9, 4.6), layout="constrained")
    for lv in levels:
        pos = M.itl_by_position([r for r in records if r.level == lv["level"]])
        if pos["position"]:
            line, = ax.plot(pos["position"], pos["mean_ms"], label=f"{_label(lv)} mean")
            ax.plot(pos["position"], pos["p90_ms"], linestyle=":", color=line.get_color(), label=f"{_label(lv)} p90")
    ax.set(title="inter-token latency by token position", xlabel="token-bearing response #", ylabel="gap (ms)")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8, ncol=2)
    return fig
