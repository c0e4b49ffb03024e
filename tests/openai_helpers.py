"""Shared set-up of the OpenAI server tests: a tiny checkpoint converted and built for the CPU engine, and the
server (`python -m toolchain.openai`) serving it."""

from __future__ import annotations

import contextlib
from pathlib import Path


def build_engine(root: Path, checkpoint: Path, **sections) -> Path:
    """`checkpoint` converted and built into `root` under a spec of the given sections; the engine directory."""
    from conftest import write_spec
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    spec = load_spec(write_spec(root / "spec.yaml", checkpoint, **sections))
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    return Path(ws.engine_dir(spec))


@contextlib.contextmanager
def serving(engine_dir: Path, tokenizer: Path, model: str, log_dir: Path, guided: bool = False):
    """The OpenAI server on `engine_dir` with a 4096-token KV cache and one engine thread, logging to `log_dir`;
    `guided`: with guided decoding on (XGrammar), as response_format needs."""
    from toolchain.openai import OpenAIServer

    with OpenAIServer(engine_dir, tokenizer, model, log_path=log_dir / "server.log",
                      extra_args=("--max-tokens-in-paged-kv-cache", "4096", "--engine-threads", "1",
                                  "--log-level", "warning",
                                  *(("--guided-decoding-backend", "xgrammar") if guided else ()))) as srv:
        yield srv
