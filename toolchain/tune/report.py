"""What `toolchain tune` prints and writes: the ranked table, the drop summary, the SLO-miss line, the Pareto
front (text and PNG), the top specs as YAML ready for `toolchain deploy`, and tune.json.

Everything goes into --out through `fsutil.atomic_dir`: a reader sees the previous directory or the whole new
one, never a half-written set of specs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from toolchain.fsutil import atomic_dir
from toolchain.plan.perf import bar_text
from toolchain.slo import judged_on, thresholds
from toolchain.spec import DeploymentSpec
from toolchain.targets import target_of
from toolchain.tune.candidates import derive
from toolchain.tune.search import Evaluated, SearchResult, replica_spec


SEARCHED = {"parallelism": ("tp", "pp"), "limits": ("max_batch_size", "max_num_tokens"),
            "build": ("chunked_context",), "quantization": ("method", "kv_cache")}
NOTE_WIDTH = 72
"""Most characters of a cross-check's note in the table."""


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[Evaluated], by_cost: bool) -> list[str]:
    head: tuple[str, ...] = ("#", "candidate", "tok/s/GPU", "error", "TTFT ms", "TPOT ms", "batch@max", "TPOT@max", "$/Mtok",
                             "bound")
    checked = any(e.cross_check for e in rows)
    if checked:  # the second opinion beside ours: its throughput per GPU and TPOT at our batch@max
        head += ("AIC tok/s/GPU", "AIC TPOT@max", "AIC note")
    lines = [head]
    for i, e in enumerate(rows, 1):
        p = e.performance if e.predicted else {}
        bound = "/".join(p["bound"].values()) if p else "-"
        row: tuple[str, ...] = (str(i), e.candidate.label, _num(p.get("per_gpu_output_tokens_per_s"), ",.0f"),
                                bar_text(p.get("error_bar")), _num(p.get("ttft_ms"), ",.1f"), _num(p.get("tpot_ms"), ".2f"),
                                _num(p.get("batch_size_at_max"), "d"), _num(e.full_load.get("tpot_ms"), ".2f"),
                                _num(p.get("usd_per_million_output_tokens"), ".3f"), bound)
        if checked:
            c = e.cross_check
            note = c.get("error", "") if c else "not cross-checked"  # tune.json keeps the whole message
            row += (_num(c.get("per_gpu_output_tokens_per_s"), ",.0f"), _num(c.get("tpot_ms"), ".2f"),
                    note if len(note) <= NOTE_WIDTH else note[:NOTE_WIDTH - 3] + "...")
        lines.append(row)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    left = {1, len(head) - 1} if checked else {1}  # the label and the note read left to right
    return ["  ".join(c.ljust(w) if j in left else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in lines]


def cross_check_line(rows: list[Evaluated]) -> str | None:
    """What the AIC columns are: the tool and the TensorRT-LLM release(s) its data was measured on."""
    bases = sorted({e.cross_check["basis"] for e in rows if e.cross_check.get("basis")})
    if not any(e.cross_check for e in rows):
        return None
    what = "; ".join(bases) if bases else "aiconfigurator: no estimate"
    return (f"AIC: {what}, each candidate at our batch@max (one replica, aggregated serving); ours: plan's model "
            "of TensorRT-LLM 1.2.1")


def summary_line(result: SearchResult) -> str:
    counts = result.drop_counts()
    parts = [f"{n} {'miss the SLO' if why == 'slo' else ('do not fit (memory.fits)' if why == 'memory.fits' else f'fail {why}')}"
             for why, n in counts.items()]
    dropped = f"dropped {len(result.dropped)}: {', '.join(parts)}" if parts else "dropped 0"
    refused = f"; {len(result.refused)} combinations the spec refuses" if result.refused else ""
    return f"searched {result.searched} candidates; {dropped}{refused}; {len(result.ranked)} kept"


def slo_miss_line(result: SearchResult) -> str | None:
    """One line when nothing meets the SLO: the closest candidate and what it misses by."""
    if result.ranked:
        return None
    near = result.closest()
    if near is None:
        return None
    misses = ", ".join(f"{name} on the predicted mean {m['predicted']:,.1f} > {m['limit']:,.1f} (+{m['predicted'] / m['limit'] - 1:.0%}) "
                       f"at concurrency {m['concurrency']}" for name, m in near.slo_misses.items())
    return f"no candidate meets the SLO; closest: {near.candidate.label}: {misses}"


def pareto_lines(result: SearchResult) -> list[str]:
    if not result.front:
        return []
    out = ["Pareto front (predicted output tokens/s per GPU against tokens/s per user, both at the batch of the "
           "maximum throughput):"]
    out += [f"  {e.per_gpu():>10,.0f} tok/s/GPU  {e.tokens_per_user():>8,.1f} tok/s/user  {e.candidate.label}"
            for e in result.front]
    return out


def slo_line(result: SearchResult) -> str | None:
    """The SLO candidates were judged against, and which of its bounds a predicted mean stood for."""
    if not result.slo:
        return None
    bounds = ", ".join(f"{t.name} {'<=' if t.upper else '>='} {t.value:g}" for t in result.slo)
    basis = judged_on(result.slo)
    return f"slo: {bounds}" + (f"; {basis}" if basis else "")


def render(result: SearchResult, top: int) -> str:
    lines = [summary_line(result)]
    slo = slo_line(result)
    if slo:
        lines.append(slo)
    miss = slo_miss_line(result)
    if miss:
        lines.append(miss)
    lines += [f"note: {n}" for n in result.notes]
    if result.unpredicted_slo:
        lines.append(f"note: not predicted, so not used to drop: {', '.join(result.unpredicted_slo)}")
    if result.ranked:
        lines.append("")
        lines += table(result.shown[:top], result.by_cost)
        if any(e.predicted for e in result.ranked):
            lines.append("(predicted by plan's roofline model: TTFT/TPOT are means at a replica's share of the "
                         "workload's concurrency, TPOT@max at the batch of the maximum; both meet the SLO's bounds)")
        if any(e.predicted and e.performance.get("error_bar") for e in result.shown[:top]):
            lines.append("(error: the model's median throughput error on the published or measured cells nearest each "
                         "candidate, tune.json's error_bar says which; ranked by the prediction itself)")
        same = len(result.ranked) - len(result.shown)
        if same:
            lines.append(f"({same} kept candidates predicted the same as a better one, differing only in knobs the "
                         "model does not see, are left out of this list; tune.json has them all)")
        aic = cross_check_line(result.shown[:top])
        if aic:
            lines.append(aic)
        front = pareto_lines(result)
        if front:
            lines.append("")
            lines += front
    return "\n".join(lines)


def written_spec(e: Evaluated, rank: int) -> DeploymentSpec:
    """The candidate as the spec the user deploys: one replica's share of the workload (`replica_spec`, the spec
    it was planned and predicted at, so `toolchain plan` of the file reproduces its row), the SLO it was judged
    against, and its own name, so its outputs sit beside the original's."""
    base = replica_spec(e.candidate.spec, e.candidate.replicas)
    return derive(base, {"name": f"{e.candidate.spec.name}-tuned-{rank}"})


# The path fields spec.py's _resolve_paths makes absolute against the spec's directory.
PATH_FIELDS = (("model", "checkpoint"), ("model", "tokenizer"), ("gpu", "hostfile"), ("speculative", "draft_model"),
               ("speculative", "heads"), ("build", "trtllm_build"), ("quantization", "calibration", "dataset"),
               ("validation", "workload", "prompts_file"), ("serving", "tritonserver"), ("serving", "admin_key_file"))
# Fields of the section whose value the default of `model.checkpoint` stands for when the file leaves it out.
DEFAULT_RELATIVE = {("model", "checkpoint")}


def _get(data: dict, path: tuple[str, ...]):
    node = data
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def relative_paths(data: dict, source: Path | None, dest: Path) -> None:
    """Paths the user's spec file gave relative (to its own directory, as the loader reads them) are written
    relative to `dest`, the written spec's directory, so the pair of files moves together as the original did;
    paths it gave absolute, that only an override set, or whose tree (the directory holding both the original
    spec and the path) does not hold `dest`, stay absolute."""
    try:
        raw = yaml.safe_load(source.read_text()) if source is not None else None
    except (OSError, yaml.YAMLError):
        return
    if not isinstance(raw, dict):
        return
    for path in PATH_FIELDS:
        value = _get(data, path)
        if not isinstance(value, str) or not os.path.isabs(value):
            continue
        given = _get(raw, path)
        if given is None and path not in DEFAULT_RELATIVE:
            continue
        if given is not None and os.path.isabs(os.path.expanduser(str(given))):
            continue
        where = dest.resolve()
        # Relative only where the written spec sits inside the tree holding both the original spec and the path
        # (a project moved or cloned whole keeps working); written outside it (a scratch --out), a path climbing
        # out through shared parents like /tmp breaks as soon as either side moves, so it stays absolute.
        tree = os.path.commonpath([value, str(source.resolve().parent)]) if source is not None else where.anchor
        if tree == where.anchor or os.path.commonpath([tree, where]) != tree:
            continue
        node = _get(data, path[:-1])
        node[path[-1]] = os.path.relpath(value, where)


def spec_yaml(spec: DeploymentSpec, header: list[str], dest: Path | None = None, replicas: int = 1) -> str:
    """The spec as YAML to be written into directory `dest` (relative paths kept relative to it), with the
    header lines as comments; `replicas` goes into the target's replica field where it has one."""
    data = spec.model_dump(mode="json", exclude={"source"}, exclude_defaults=True)
    # The searched fields are written even where they equal the defaults, so the file says what was chosen.
    for section, fields in SEARCHED.items():
        full = getattr(spec, section)
        data.setdefault(section, {}).update({f: getattr(full, f) for f in fields})
    for field_name in target_of(spec).replica_fields if replicas > 1 else ():
        section, key = field_name.split(".")
        data.setdefault(section, {})[key] = replicas
    if dest is not None:
        relative_paths(data, spec.source, dest)
    data = {"name": spec.name, **{k: v for k, v in data.items() if k != "name"}}
    return "".join(f"# {h}\n" for h in header) + yaml.safe_dump(data, sort_keys=False)


DPI = 120
# Where a front point's label may go, tried in order, in points from the point (dx, dy; a negative dx puts the
# text to the left, right-aligned): beside it first, then further above and below.
LABEL_SPOTS = [(dx, dy) for dy in (4, -12, 14, -22, 24, -32) for dx in (4, -4)]


def _label_front(fig, ax, front: list[Evaluated]) -> None:
    """Label each front point at the first spot where its text stays inside the axes and overlaps neither the
    legend nor a label already placed; a point with no such spot stays unlabelled (the printed front and
    tune.json name every point). Neighbours on the front often differ in one knob and sit close together, so
    labels at one fixed offset overwrote each other."""
    fig.canvas.draw()  # the layout and the legend's place are final before texts are measured
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    taken = [legend.get_window_extent(renderer)] if legend is not None else []
    for e in front:
        xy = (e.tokens_per_user(), e.per_gpu())
        for dx, dy in LABEL_SPOTS:
            # A label moved off the point's shoulder gets a thin leader line, so it still says whose it is.
            leader = None if dy == LABEL_SPOTS[0][1] else {"arrowstyle": "-", "color": "0.6", "linewidth": 0.5}
            text = ax.annotate(e.candidate.label, xy, fontsize=6, xytext=(dx, dy), textcoords="offset points",
                               ha="left" if dx > 0 else "right", arrowprops=leader)
            box = text.get_window_extent(renderer)
            fits = (inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1)
            if fits and not any(box.overlaps(other) for other in taken):
                taken.append(box)
                break
            text.remove()


def pareto_figure(result: SearchResult):
    """The Pareto PNG's figure (laid out, front labelled), or None when nothing kept was predicted."""
    points = [e for e in result.ranked if e.predicted]
    if not points:
        return None
    import matplotlib  # heavy: only when there is something to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=DPI)  # measured at the dpi it is saved at
    ax.scatter([e.tokens_per_user() for e in points], [e.per_gpu() for e in points], s=10, c="0.7",
               label="kept candidates")
    front = result.front
    ax.plot([e.tokens_per_user() for e in front], [e.per_gpu() for e in front], "o-", color="C1",
            label="Pareto front")
    ax.set_xlabel("output tokens/s per user (1 / TPOT at the batch of the maximum)")
    ax.set_ylabel("output tokens/s per GPU (predicted maximum)")
    ax.set_title("toolchain tune: throughput per GPU against speed per user (predicted)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()  # before the labels: they are placed in the final layout's display coordinates
    _label_front(fig, ax, front)
    return fig


def _plot(result: SearchResult, path: Path) -> bool:
    fig = pareto_figure(result)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def share_line(fleet, mine, replicas: int) -> str:
    """The header line saying the written workload is one replica's share of the fleet's."""
    shares = [f"concurrency {fleet.concurrency} -> {mine.concurrency}"]
    if fleet.mode == "rate":
        shares.append(f"rate {fleet.rate:g} -> {mine.rate:g} req/s")
    if fleet.sweep:
        shares.append(f"sweep {'/'.join(f'{v:g}' for v in fleet.sweep)} -> {'/'.join(f'{v:g}' for v in mine.sweep)}")
    return (f"validation.workload is one replica's share of the workload given, over {replicas} replicas: "
            f"{', '.join(shares)} (bench one replica at it; the fleet serves the whole)")


def write(out: Path, result: SearchResult, top: int, text: str, extra: dict | None = None) -> list[Path]:
    """--out: specs/<name>.yaml for the top candidates, table.txt, pareto.png, tune.json. Returns the spec paths
    as they will be once the directory is in place."""
    written: list[Path] = []
    with atomic_dir(out) as tmp:
        (tmp / "specs").mkdir()
        for rank, e in enumerate(result.shown[:top], 1):
            spec = written_spec(e, rank)
            p = e.performance
            header = [f"toolchain tune: rank {rank} of {len(result.shown)}: {e.candidate.label}"]
            if spec.gpu.name:
                fields = target_of(spec).replica_fields
                field_name = " and ".join(fields)
                verb = "say" if len(fields) > 1 else "says"
                how = f"{field_name} {verb} so" if field_name and e.candidate.replicas > 1 else \
                    "run this many copies of the deployment"
                header.append(f"replicas: {e.candidate.replicas} ({how}; {e.candidate.gpu_count} GPUs in all)")
            if e.candidate.replicas > 1:
                header.append(share_line(e.candidate.spec.validation.workload, spec.validation.workload,
                                         e.candidate.replicas))
            split = p.get("disaggregated") if e.predicted else None
            if split:
                header.append(f"disaggregated (NVIDIA Dynamo): {split['prefill']['workers']} prefill workers of tp "
                              f"{split['prefill']['tp']}, {split['decode']['workers']} decode workers of tp "
                              f"{split['decode']['tp']}; `toolchain dynamo <this file> --manifests DIR` writes the "
                              "DynamoGraphDeployment")
                header.append(f"predicted KV transfer {split['kv_transfer_ms']:.2f} ms per request over "
                              f"{split['link']}; the {split['bottleneck']} workers bound the throughput")
            if e.predicted:
                bar = f" {bar_text(p['error_bar'])}" if p.get("error_bar") else ""
                header.append(f"predicted per replica: {p['max_output_tokens_per_s']:,.0f} output tokens/s{bar} at batch "
                              f"{p['batch_size_at_max']}; mean TTFT {p['ttft_ms']:,.1f} ms, mean TPOT "
                              f"{p['tpot_ms']:.2f} ms at concurrency {p['concurrency']} ({p['basis']})")
                basis = judged_on(thresholds(spec.validation.slo))
                if basis:
                    header.append(f"validation.slo: {basis}")
            name = f"{spec.name}.yaml"
            (tmp / "specs" / name).write_text(spec_yaml(spec, header, out / "specs", e.candidate.replicas))
            written.append(out / "specs" / name)
        (tmp / "table.txt").write_text(text + "\n")
        plotted = _plot(result, tmp / "pareto.png")
        doc = {"searched": result.searched, "kept": len(result.ranked), "dropped": result.drop_counts(),
               "refused": len(result.refused), "ranking": "usd_per_million_output_tokens" if result.by_cost
               else "per_gpu_output_tokens_per_s", "notes": result.notes,
               "slo_not_predicted": result.unpredicted_slo, "slo_miss": slo_miss_line(result),
               "top": [e.candidate.label for e in result.shown[:top]],
               "specs": [str(p) for p in written], "pareto_png": str(out / "pareto.png") if plotted else None,
               "pareto": [e.candidate.label for e in result.front],
               "cross_check": cross_check_line(result.shown[:top]),
               "candidates": [e.as_dict() for e in result.ranked],
               "dropped_candidates": [e.as_dict() for e in result.dropped], **(extra or {})}
        (tmp / "tune.json").write_text(json.dumps(doc, indent=1) + "\n")
    return written
