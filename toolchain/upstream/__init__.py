"""Facts taken from upstream's own source, each with where it came from.

Every file in `facts/` is data written by `python -m tools.upstream_facts` from
local checkouts of the upstream repositories (never committed). A file holds
`sources` (name -> repository, ref, commit) and `facts`, whose entries name
their `source`, `path` and `line`, so a reader can open the exact line a rule
was taken from. The renderers read these files, and the conformance tests hold
every artifact a GPU host consumes against them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

FACTS_DIR = Path(__file__).parent / "facts"


@lru_cache(maxsize=None)
def load(name: str) -> dict[str, Any]:
    """The whole fact file `facts/<name>.json` (sources and facts)."""
    path = FACTS_DIR / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no upstream fact file {path}; regenerate with `python -m tools.upstream_facts`") from None


def facts(name: str) -> Any:
    return load(name)["facts"]


def cite(name: str, entry: dict[str, Any] | None = None) -> str:
    """'repository@ref path:line' for an entry of fact file `name` (or its first source)."""
    doc = load(name)
    key = (entry or {}).get("source") or next(iter(doc["sources"]))
    src = doc["sources"][key]
    where = f"{src['repository']}@{src['ref']}"
    if entry and entry.get("path"):
        where += f" {entry['path']}" + (f":{entry['line']}" if entry.get("line") else "")
    return where
