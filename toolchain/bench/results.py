"""The end of every script in benchmarks/: the results printed as JSON and written to `--json PATH`.

One place so that each benchmark writes its results file the same way (its folder created, JSON with
a final newline), which is where `make bench` collects them (reports/benchmarks/<name>.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def write_results(results: Any, json_path: Path | None, *, indent: int = 2,
                  default: Callable[[Any], Any] | None = None) -> None:
    """Write `results` as JSON to `json_path` (its folder created, a final newline); nothing when no path was given."""
    if json_path is None:
        return
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=indent, default=default) + "\n")


def print_and_write(results: Any, json_path: Path | None, *, indent: int = 2, printed: Any = None,
                    default: Callable[[Any], Any] | None = None) -> None:
    """Print `printed` (the results themselves when None) as JSON on stdout, then write the results."""
    print(json.dumps(results if printed is None else printed, indent=indent, default=default))
    write_results(results, json_path, indent=indent, default=default)
