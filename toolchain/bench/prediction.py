"""report.json's `prediction`: what the performance model (plan/perf/) predicts beside what the bench measured.

For each closed-loop level, the model predicts TTFT, TPOT and output throughput at that concurrency with the
spec's workload: for a CPU target from this host's cached profile (`toolchain probe-host`; never measured here),
for a GPU target from the GPU table. The ratio predicted / measured is set beside each, against the measured mean
(the model predicts a steady state's mean), and one warning line is added when TTFT or TPOT differs by more than
WARN_FRACTION. Where no prediction is possible (no profile, a GPU the table lacks) the object says why, once.
"""

from __future__ import annotations

from toolchain.plan.perf import predict_spec

WARN_FRACTION = 0.25
FIGURES = (("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms"), ("output_tokens_per_s", "output_tokens_per_s"))


def _measured(level: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, _ in FIGURES:
        value = level.get(key)
        out[key] = value.get("mean") if isinstance(value, dict) else value
    return out


def compare(predicted: dict, measured: dict) -> tuple[dict, str | None]:
    """(predicted / measured per figure, a warning when TTFT or TPOT is off by more than WARN_FRACTION)."""
    ratio: dict[str, float | None] = {k: round(predicted[k] / measured[k], 3) if measured.get(k) else None
                                      for k, _ in FIGURES}
    off = []
    for k in ("ttft_ms", "tpot_ms"):
        r = ratio[k]
        if r is not None and abs(r - 1) > WARN_FRACTION:
            off.append(f"{k.removesuffix('_ms').upper()} predicted {predicted[k]:.3g} ms, measured "
                       f"{measured[k]:.3g} ms (x{r:.2f})")
    warning = None
    if off:
        warning = f"prediction differs by more than {WARN_FRACTION:.0%}: " + "; ".join(off)
    return ratio, warning


def level_prediction(spec, level: dict) -> dict:
    """The prediction for one level of the report, with the measured figures and the ratios."""
    load = level.get("load", {})
    if load.get("mode") != "concurrency":
        return {"level": level.get("level"), "predicted": False,
                "note": "predicted for closed-loop (concurrency) levels only"}
    concurrency = int(load["value"])
    perf = predict_spec(spec, concurrency=concurrency)
    if not perf.get("predicted"):
        return {"level": level.get("level"), "concurrency": concurrency, "predicted": False, "note": perf["note"]}
    predicted = {k: perf[k] for k, _ in FIGURES}
    measured = _measured(level)
    ratio, warning = compare(predicted, measured)
    return {"level": level.get("level"), "concurrency": concurrency, "predicted": True, **predicted,
            "measured": measured, "ratio": ratio, "warning": warning, "notes": perf.get("notes", [])}


def prediction(spec, levels: list[dict]) -> dict:
    """report.json's `prediction`: the first predicted level's figures at the top (the run's concurrency), every
    level under `levels`, the basis, and the warnings; {"predicted": false, "note"} when there is none."""
    rows = [level_prediction(spec, lv) for lv in levels]
    done = [r for r in rows if r["predicted"]]
    if not done:
        note = rows[0]["note"] if rows else "no level was measured"
        return {"predicted": False, "note": note}
    basis = predict_spec(spec, concurrency=done[0]["concurrency"])["basis"]
    head = done[0]
    return {"predicted": True, "basis": basis, "concurrency": head["concurrency"],
            **{k: head[k] for k, _ in FIGURES}, "measured": head["measured"], "ratio": head["ratio"],
            "warnings": [r["warning"] for r in done if r["warning"]], "levels": rows}


def summary_lines(pred: dict | None) -> list[str]:
    """The printed summary's lines for the prediction."""
    if not pred:
        return []
    if not pred.get("predicted"):
        return [f"prediction: none ({pred['note']})"]
    lines = []
    for r in pred["levels"]:
        if not r["predicted"]:
            continue
        ratio = r["ratio"]

        def show(key: str, unit: str, r=r, ratio=ratio) -> str:
            x = f" (x{ratio[key]:.2f})" if ratio[key] is not None else ""
            return f"{r[key]:.4g}{unit}{x}"

        lines.append(f"predicted at concurrency {r['concurrency']} ({pred['basis']}): TTFT {show('ttft_ms', ' ms')}, "
                     f"TPOT {show('tpot_ms', ' ms')}, {show('output_tokens_per_s', ' tok/s')} "
                     "(x: predicted / measured mean)")
    lines += [f"warning: {w}" for w in pred["warnings"]]
    return lines
