"""The upstream fact files carry their provenance: each names the repository and
commit it was read from, and every entry that came from a file names its path,
line and commit, so a reader can open the exact upstream line a rule stands on."""

from __future__ import annotations

import json
import re

import pytest

from toolchain import upstream

FILES = sorted(p.stem for p in upstream.FACTS_DIR.glob("*.json"))
HEX40 = set("0123456789abcdef")


def _entries(node, inherited=None):
    """Every dict with a `line`, with `path`/`commit`/`source` taken from the nearest
    enclosing entry that names them (a template's tensors sit under its path)."""
    if isinstance(node, dict):
        context = {**(inherited or {}), **{k: node[k] for k in ("path", "commit", "source") if k in node}}
        if isinstance(node.get("line"), int) or ("line" in node and "path" in context):
            yield {**context, "line": node["line"]}
        for value in node.values():
            yield from _entries(value, context)
    elif isinstance(node, list):
        for value in node:
            yield from _entries(value, inherited)


def test_the_expected_fact_files_exist():
    assert {"backend_parameters", "model_templates", "containers"} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_every_entry_names_repository_commit_path_and_line(name):
    doc = upstream.load(name)
    assert doc["about"] and doc["sources"]
    for src in doc["sources"].values():
        if src["repository"].startswith("pypi:"):
            # A released package (Dynamo's wheels): its version, and each file read by the hash its RECORD states.
            assert src["version"] and all(d.startswith("sha256=") for d in src["files"].values()), src
            continue
        assert "/" in src["repository"] and len(src["commit"]) == 40 and set(src["commit"]) <= HEX40
    entries = list(_entries(doc["facts"]))
    assert entries, name
    for entry in entries:
        assert entry.get("source", next(iter(doc["sources"]))) in doc["sources"], entry
        assert entry.get("path"), entry
        assert isinstance(entry["line"], int) and entry["line"] > 0, entry
        src = doc["sources"][entry.get("source", next(iter(doc["sources"])))]
        if src["repository"].startswith("pypi:"):
            assert entry["path"] in src["files"], entry
            continue
        commit = entry.get("commit") or doc["sources"][entry.get("source", next(iter(doc["sources"])))]["commit"]
        # A stored file version whose commit the code index does not report is named by its id there,
        # which opens the same text again; anything else must be a full commit.
        if commit.startswith("stored version: read_file id "):
            assert re.fullmatch(r"stored version: read_file id \d+, \d+ chars \(commit not reported by the index\)",
                                commit), entry
            continue
        assert len(commit) == 40 and set(commit) <= HEX40, entry
    assert upstream.cite(name, entries[0]).count("@") == 1


@pytest.mark.parametrize("name", [n for n in FILES if any(
    s["repository"] == "NVIDIA/TensorRT-LLM" for s in upstream.load(n)["sources"].values())])
def test_tensorrt_llm_facts_say_whether_they_were_read_at_the_pinned_release(name):
    """Every file read from TensorRT-LLM names the release the toolchain pins and whether the facts were read at it;
    where not (the code index holds no 1.2.1 file), each entry's own commit is what it was read from."""
    from toolchain.versions import TRTLLM_VERSION

    for src in upstream.load(name)["sources"].values():
        if src["repository"] != "NVIDIA/TensorRT-LLM":
            continue
        pinned = src["pinned_release"]
        assert pinned["version"] == TRTLLM_VERSION and isinstance(pinned["held_by_code_index"], bool)
        assert pinned["held_by_code_index"] or (TRTLLM_VERSION in pinned["note"] and src.get("version") != TRTLLM_VERSION)
        if pinned["held_by_code_index"]:
            assert src.get("version") == TRTLLM_VERSION, src
        # The note names the TensorRT-LLM commit the Triton containers of that release pin (containers.json).
        pins = {r["tensorrt_llm_submodule"]["commit"] for r in upstream.facts("containers")["releases"].values()
                if r["tensorrt_llm"] == TRTLLM_VERSION}
        assert pins and all(commit in pinned["note"] for commit in pins), pins


def test_fact_files_are_stable_json():
    """Written by tools.upstream_facts with a fixed layout, so a regeneration diff is readable."""
    for name in FILES:
        path = upstream.FACTS_DIR / f"{name}.json"
        assert path.read_text() == json.dumps(json.loads(path.read_text()), indent=1) + "\n", name
