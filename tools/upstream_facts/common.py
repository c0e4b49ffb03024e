"""Shared by the fact modules: the document shape and the check of curated quotes."""

from __future__ import annotations

from typing import Any

from tools.upstream_facts.source import Source


def document(about: str, sources: dict[str, Source], facts: Any) -> dict[str, Any]:
    return {"about": about, "sources": {name: src.record() for name, src in sources.items()}, "facts": facts}


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def verify_quotes(entries: list[dict[str, Any]], sources: dict[str, Source]) -> None:
    """Every curated entry's `quote` must occur in its file; its `line` is set to
    the nearest occurrence to the recorded one. Raises SystemExit naming the
    first entry whose quote is gone."""
    cache: dict[tuple[str, str], list[str]] = {}
    for entry in entries:
        key = (entry["source"], entry["path"])
        if key not in cache:
            cache[key] = sources[entry["source"]].read(entry["path"]).splitlines()
        lines = cache[key]
        quote = entry["quote"].strip()
        hits = [i + 1 for i, line in enumerate(lines) if quote in line]
        if not hits:
            raise SystemExit(f"{entry['path']}: quote not found: {quote!r}")
        entry["line"] = min(hits, key=lambda n: abs(n - int(entry.get("line") or 0)))
