"""Device rows a user calibrated from their own runs (`toolchain calibrate`, plan/calibrate.py), as the
performance model reads them back.

One JSON file per (GPU, path, TensorRT-LLM version) under the user's cache, beside the host profiles
(hostprofile.cache_dir's parent: $XDG_CACHE_HOME or ~/.cache, then trtllm-toolchain/calibrated). A file holds the
fitted row by field name (`row`), the shipped row it started from, the reports it was fitted to (path, sha256,
format) and the fit's errors, so a later plan can say what it rests on. `predict()` (plan/perf/predict.py) asks
`calibrated_row` for a GPU target's device, path and TensorRT-LLM version before the shipped table; setting
$TOOLCHAIN_NO_CALIBRATION to anything but 0 makes it ignore the cache (reproducible runs: the published checks).

This module reads and writes the files only; the fit lives in plan/calibrate.py, which imports this one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolchain import gpus
from toolchain.fsutil import atomic_file
from toolchain.gpus import Gpu
from toolchain.hostprofile import cache_dir as host_profile_dir
from toolchain.plan.perf.efficiency import Efficiency, efficiency_of
from toolchain.plan.perf.kernels import SYSTEMS as KERNEL_SYSTEMS

IGNORE_ENV = "TOOLCHAIN_NO_CALIBRATION"
ROW_KIND = "trtllm-toolchain calibrated efficiency row"
ROW_VERSION = 1
"""Bumped when a row file's keys change meaning: a file of another version is not read."""


@dataclass(frozen=True)
class CalibratedRow:
    """A row the user calibrated, with what a prediction on it says."""

    eff: Efficiency
    basis: str
    """e.g. "roofline x efficiencies calibrated on 4 runs of H100 80GB (pytorch, TensorRT-LLM 1.2.1), fit error
    6.1% (leave-one-out), 2026-12-07"."""
    error_pct: float
    """The fit's error on its reports: leave-one-out where there are >= 3 reports, else on the reports fitted."""
    reports: int
    file: Path


def cache_dir() -> Path:
    return host_profile_dir().parent / "calibrated"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def normal_version(version: str) -> str:
    """"v1.2.1 " and "1.2.1" name one release."""
    return str(version).strip().lstrip("vV")


def row_path(gpu_name: str, path: str, version: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"{_slug(gpu_name)}_{path}_{_slug(normal_version(version))}.json"


def shipped_row(device: Gpu, path: str, version: str | None = None) -> Efficiency:
    """The shipped table's row a calibration starts from: the measured-kernel step's on a card AIConfigurator's
    database measured (the serving costs measured on `path` nearest TensorRT-LLM `version`), else the roofline's
    of its generation."""
    return efficiency_of(device, measured_kernels=device.name in KERNEL_SYSTEMS, release=version, path=path)


def row_of(doc: dict, file: Path) -> CalibratedRow:
    """The row a file holds: its fields by name over the shipped row (a field the file lacks, such as one added
    to Efficiency since, keeps the shipped value)."""
    device = gpus.lookup(doc["gpu"])
    # the numeric fields; `kernels` (which step the row is for) comes from the shipped row it was fitted from
    known = {f.name for f in dataclasses.fields(Efficiency) if f.name != "kernels"}
    values: dict[str, Any] = {k: float(v) for k, v in doc["row"].items() if k in known}
    eff = dataclasses.replace(shipped_row(device, doc["path"], doc["trtllm_version"]), **values)
    err = doc["error_pct"]
    loo = err.get("leave_one_out")
    error = float(loo if loo is not None else err["after"])
    n = len(doc["reports"])
    kind = "measured kernels x serving costs" if eff.kernels else "roofline x efficiencies"
    basis = (f"{kind} calibrated on {n} run{'s' if n != 1 else ''} of {doc['gpu']} ({doc['path']}, "
             f"TensorRT-LLM {doc['trtllm_version']}), fit error {error:.1f}%"
             f"{' (leave-one-out)' if loo is not None else ' on the runs it was fitted to'}, {doc['date']}")
    return CalibratedRow(eff, basis, error, n, file)


def read_row(file: Path) -> CalibratedRow | None:
    """The row in `file`, or None when it is unreadable or not a row of this version."""
    try:
        doc = json.loads(Path(file).read_text())
        if doc.get("kind") != ROW_KIND or doc.get("format_version") != ROW_VERSION:
            return None
        return row_of(doc, Path(file))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def ignored() -> bool:
    return os.environ.get(IGNORE_ENV, "") not in ("", "0")


def calibrated_row(gpu_name: str, path: str, version: str, root: Path | None = None) -> CalibratedRow | None:
    """The row the user calibrated for this GPU, path and TensorRT-LLM version, or None (none cached, or
    $TOOLCHAIN_NO_CALIBRATION set)."""
    if ignored():
        return None
    return read_row(row_path(gpu_name, path, version, root))


def save_row(doc: dict, root: Path | None = None) -> Path:
    """Write a row file whole or not at all (a temporary file beside it, renamed into place)."""
    file = row_path(doc["gpu"], doc["path"], doc["trtllm_version"], root)
    with atomic_file(file) as fh:
        fh.write(json.dumps({"kind": ROW_KIND, "format_version": ROW_VERSION, **doc}, indent=2) + "\n")
    return file


def cached_rows(root: Path | None = None) -> list[tuple[Path, dict]]:
    """Every row file in the cache with its document (unreadable ones left out)."""
    out = []
    for file in sorted((root or cache_dir()).glob("*.json")):
        try:
            doc = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("kind") == ROW_KIND:
            out.append((file, doc))
    return out


def clear_rows(root: Path | None = None) -> list[Path]:
    """Remove every row file; returns what was removed."""
    removed = []
    for file, _ in cached_rows(root):
        file.unlink(missing_ok=True)
        removed.append(file)
    return removed
