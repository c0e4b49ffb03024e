"""Shared by the fact modules: the document shape and the check of curated quotes."""

from __future__ import annotations

import ast
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


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    """Every class of a parsed module, by name."""
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def init_of(cls: ast.ClassDef) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def self_calls(cls: ast.ClassDef) -> dict[str, ast.Call]:
    """`self.<name> = <Call>` in __init__: a module's submodules, by attribute name (the
    checkpoint names its parameters by these attribute paths)."""
    out = {}
    for node in ast.walk(init_of(cls)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "self"
                and isinstance(node.value, ast.Call)):
            out[node.targets[0].attr] = node.value
    return out


def keyword_defaults(cls: ast.ClassDef, where: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """__init__'s keyword-only parameters with defaults: name -> default, `where` and line."""
    init = init_of(cls)
    return {a.arg: {"default": ast.literal_eval(d), **where, "line": a.lineno}
            for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=False) if d is not None}
