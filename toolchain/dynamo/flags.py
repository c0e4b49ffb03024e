"""Dynamo's own names, looked up before they are emitted: every flag of `python -m dynamo.frontend` and
`python3 -m dynamo.trtllm`, read from the parsers Dynamo 1.6.1 builds (toolchain/upstream/facts/dynamo.json,
written by `python -m tools.upstream_facts`). A name missing there is a bug here (LookupError), never a user error."""

from __future__ import annotations

from typing import Any

from toolchain import upstream


def _facts() -> dict[str, Any]:
    return upstream.facts("dynamo")


def _lookup(section: str, name: str) -> str:
    flags = _facts()[section]["flags"]
    names = {n for flag, entry in flags.items() for n in (flag, *entry["aliases"])}
    if name not in names:
        raise LookupError(f"{_facts()[section]['module']} has no flag {name} (facts/dynamo.json {section}.flags)")
    return name


def frontend(name: str) -> str:
    """`name` if dynamo.frontend declares it."""
    return _lookup("frontend", name)


def worker(name: str) -> str:
    """`name` if dynamo.trtllm declares it."""
    return _lookup("trtllm_worker", name)


def choices(section: str, name: str) -> list[str]:
    return list(_facts()[section]["flags"][name].get("choices") or [])


def default(section: str, name: str) -> Any:
    return _facts()[section]["flags"][name]["default"]


def trtllm_pin() -> str | None:
    """The TensorRT-LLM release Dynamo's trtllm extra pins (`tensorrt-llm==...`)."""
    return _facts()["release"].get("trtllm_extra_pin")
