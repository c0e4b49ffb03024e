"""Regenerate toolchain/upstream/facts/*.json from local upstream checkouts.

    python -m tools.upstream_facts --source NAME=PATH[@REF] ... [--only FACT ...] [--check]

Sources (the checkouts are never committed):
  backend  triton-inference-server/tensorrtllm_backend, a git directory (`fetch` brings one);
           the C++ backend and templates are read at tag v0.19.0, the container at r26.04
  trtllm   NVIDIA/TensorRT-LLM at the 1.2 line: a directory holding the files each fact
           module names (the repository is too large to clone whole), with @COMMIT
  dynamo_wheel, dynamo   NVIDIA Dynamo 1.6.1 (see dynamo.py)
  lws      kubernetes-sigs/lws, a git directory; the v1 API and the TensorRT-LLM example at v0.10.0

Each module in this package with an `extract(sources)` function writes one fact file.
Modules marked CURATED hold hand-read entries (each with path, line and a `quote`
of the source line); with the source present their quotes are checked and line
numbers refreshed, so a fact that drifted from upstream fails here, not on a GPU.
`--check` compares instead of writing and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

from tools.upstream_facts.source import Source

REPOSITORIES = {"backend": "triton-inference-server/tensorrtllm_backend", "trtllm": "NVIDIA/TensorRT-LLM"}
# NVIDIA Dynamo: the installed 1.6.1 wheels (site-packages@1.6.1) and files of the GitHub repository gathered
# one by one (DIR@main with .commits.json).
REPOSITORIES.update({"dynamo_wheel": "pypi:ai-dynamo", "dynamo": "ai-dynamo/dynamo"})
# LeaderWorkerSet: a git directory at a release tag (lws.py).
REPOSITORIES["lws"] = "kubernetes-sigs/lws"
FACTS_DIR = Path(__file__).resolve().parents[2] / "toolchain" / "upstream" / "facts"


def fact_modules(only: list[str]):
    here = Path(__file__).parent
    for info in pkgutil.iter_modules([str(here)]):
        if info.name in ("source", "__main__", "common") or (only and info.name not in only):
            continue
        module = importlib.import_module(f"tools.upstream_facts.{info.name}")
        if hasattr(module, "extract"):
            yield info.name, module


def render(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.upstream_facts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[], metavar="NAME=PATH[@REF]")
    ap.add_argument("--only", action="append", default=[], metavar="FACT")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    given: dict[str, str] = {}
    for item in args.source:
        name, _, spec = item.partition("=")
        if name not in REPOSITORIES or not spec:
            ap.error(f"--source {item!r}: use NAME=PATH[@REF] with NAME one of {', '.join(REPOSITORIES)}")
        given[name] = spec
    failed = False
    for name, module in fact_modules(args.only):
        needed = getattr(module, "SOURCES", {})  # source name -> default ref
        missing = [s for s in needed if s not in given]
        if missing:
            print(f"skip {name}: needs --source {' '.join(missing)}")
            continue
        sources = {}
        for s, default_ref in needed.items():
            path, _, ref = given[s].partition("@")
            sources[s] = Source.open(s, REPOSITORIES[s], f"{path}@{ref or default_ref}")
        out = FACTS_DIR / f"{name}.json"
        previous = json.loads(out.read_text()) if out.is_file() else None
        doc = module.extract(sources, previous)
        text = render(doc)
        if args.check:
            if not out.is_file() or out.read_text() != text:
                print(f"DIFFERS {out}")
                failed = True
            else:
                print(f"ok      {out}")
        else:
            FACTS_DIR.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"wrote   {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
