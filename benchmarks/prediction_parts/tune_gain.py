"""Tune, then measure: what `toolchain tune --measure` gains on the embedded default deployment.

Runs `toolchain tune build/tiny-llama.yaml --measure` as a user would (its own process, a scratch root, free
ports), on the spec's own workload and SLO, then deploys the chosen spec and the spec as given `--repeats`
more times each, alternating, so a neighbour's load on a shared host falls on both alike; the ratio is of the
medians of all their runs (tune's own included).

Keys:
- `tuned_vs_default_goodput_ratio`: median goodput (requests/s meeting the SLO) of the chosen spec over the
  spec as given (target >= 1.3);
- `tuned_quality_loss_pct`: the chosen spec's perplexity increase over the unquantized model, in percent, as
  `toolchain eval` measures it (0 for an unquantized choice; target <= 1).

    python benchmarks/prediction_parts/tune_gain.py [--json PATH] [--top K] [--repeats N]

benchmarks/prediction.py runs it too, for its two `tuned_*` keys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402

SPEC = REPO / "build" / "tiny-llama.yaml"
FREE_PORTS = ["--set", "serving.http_port=0", "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]


def toolchain(root: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from toolchain.cli import main; sys.exit(main())", "--root", str(root),
           *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


def goodput(root: Path, spec: Path, out: Path, extra: list[str]) -> float | None:
    """One `toolchain deploy` of `spec`; its goodput, or None when it failed before a report."""
    toolchain(root, "deploy", str(spec), *extra, "--out", str(out))  # exit 1 on a missed SLO still reports
    report = out / "report.json"
    return json.loads(report.read_text()).get("goodput_req_per_s") if report.is_file() else None


def tuned_keys(top: int, repeats: int, root: Path) -> dict:
    out = root / "tune"
    run = toolchain(root, "tune", str(SPEC), *FREE_PORTS, "--measure", "--top", str(top), "--out", str(out))
    if not (out / "tune.json").is_file():
        raise SystemExit(f"toolchain tune failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    doc = json.loads((out / "tune.json").read_text())
    choice = doc.get("choice")
    measured = {m["label"]: m for m in doc.get("measured", [])}
    given = measured.get("as given")
    if choice is None or given is None:
        raise SystemExit(f"toolchain tune --measure chose nothing:\n{run.stdout[-3000:]}")
    chosen_runs = [choice["goodput_req_per_s"]]
    given_runs = [given["goodput_req_per_s"]]
    chosen_spec = out / "specs" / f"{choice['spec_name']}.yaml"
    if choice["label"] != "as given":
        for i in range(repeats):
            given_runs.append(goodput(root, SPEC, root / f"given-{i}", FREE_PORTS))
            chosen_runs.append(goodput(root, chosen_spec, root / f"chosen-{i}", []))
    chosen_ok = [g for g in chosen_runs if g is not None]
    given_ok = [g for g in given_runs if g is not None]
    ratio = statistics.median(chosen_ok) / statistics.median(given_ok) if chosen_ok and given_ok else None
    return {
        "tuned_vs_default_goodput_ratio": None if ratio is None else round(ratio, 3),
        "tuned_quality_loss_pct": choice.get("ppl_increase_pct") or 0.0,
        "chosen": choice["label"], "chosen_spec": choice["spec_name"],
        "goodput_req_per_s": {"chosen": chosen_runs, "given": given_runs},
        "measured": [{k: m.get(k) for k in ("label", "goodput_req_per_s", "ppl_increase_pct", "quality_ok",
                                            "slo_passed", "error", "predicted")} for m in doc["measured"]],
        "targets": {"tuned_vs_default_goodput_ratio": ">= 1.3", "tuned_quality_loss_pct": "<= 1"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    parser.add_argument("--top", type=int, default=2, help="Candidates tune deploys (default 2).")
    parser.add_argument("--repeats", type=int, default=2,
                        help="More deploys of the chosen spec and the spec as given, alternating (default 2).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tune-bench-") as tmp:
        print_and_write(tuned_keys(args.top, args.repeats, Path(tmp)), args.json)


if __name__ == "__main__":
    main()
