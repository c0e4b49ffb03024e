"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- latency_vs_load.png: TTFT and TPOT p50/p90/p99 against the load of each
  level, the SLO thresholds as dashed lines, and output throughput;
- latency_cdf.png: TTFT, TPOT and E2E CDFs, one line per level;
- itl_by_position.png: mean and p90 gap before the k-th token-bearing
  response, one line per level (decode slowing with length, periodic stalls).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from toolchain.bench import metrics as M
from toolchain.bench.records import RequestRecord

PLOTS = ("latency_vs_load.png", "latency_cdf.png", "itl_by_position.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(out_dir: Path, report: dict, records: list[RequestRecord]) -> list[str]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = report.get("levels", [])
    if not levels:
        return []
    plt = _plt()
    written = []
    for name, fn in (("latency_vs_load.png", _vs_load), ("latency_cdf.png", _cdf),
                     ("itl_by_position.png", _itl_position)):
        fig = fn(plt, report, levels, records)
        tmp = out_dir / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        plt.close(fig)
        tmp.replace(out_dir / name)
        written.append(name)
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


def _vs_load(plt, report, levels, records):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = [lv["load"]["value"] for lv in levels]
    xlabel = "concurrency" if levels[0]["load"]["mode"] == "concurrency" else "request rate (req/s)"
    for ax, key, title in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
            y = [lv[f"{key}_ms"][stat] for lv in levels]
            ax.plot(x, [np.nan if v is None else v for v in y], style, label=stat)
        _slo_lines(ax, report, key)
        ax.set(title=f"{title} vs load", xlabel=xlabel, ylabel="ms")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    ax = axes[2]
    ax.plot(x, [lv["output_tokens_per_s"] or np.nan for lv in levels], "o-", label="output tok/s")
    ax.set(title="throughput vs load", xlabel=xlabel, ylabel="output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(x, [lv["requests_per_s"] or np.nan for lv in levels], "s--", color="gray", label="req/s")
    ax2.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{report.get('model', '')} ({report.get('protocol', '')})")
    return fig


def _per_level_values(records, level: int, key: str) -> np.ndarray:
    vals = [M.request_metrics(r)[key] for r in records if r.level == level and not r.warmup and r.ok]
    return np.sort(np.asarray([v for v in vals if v is not None], float))


def _cdf(plt, report, levels, records):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "E2E"), strict=False):
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
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for lv in levels:
        pos = M.itl_by_position([r for r in records if r.level == lv["level"]])
        if pos["position"]:
            line, = ax.plot(pos["position"], pos["mean_ms"], label=f"{_label(lv)} mean")
            ax.plot(pos["position"], pos["p90_ms"], linestyle=":", color=line.get_color(), label=f"{_label(lv)} p90")
    ax.set(title="inter-token latency by token position", xlabel="token-bearing response #", ylabel="gap (ms)")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8, ncol=2)
    return fig
