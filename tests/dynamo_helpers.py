"""Dynamo 1.6.1's own argument parsers (its frontend's and its TensorRT-LLM worker's argparse groups), imported
from the installed wheel the way tools/upstream_facts/dynamo.py reads it, for tests that parse rendered commands."""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def dynamo_parsers(monkeypatch) -> Iterator[tuple[argparse.ArgumentParser, argparse.ArgumentParser]]:
    """(the frontend's parser, a worker's parser) of the installed Dynamo, with no DYN_* variable of this
    environment reaching their defaults."""
    from tools.upstream_facts.dynamo import _importable

    for key in [k for k in os.environ if k.startswith("DYN_")]:
        monkeypatch.delenv(key)
    site = Path(importlib.util.find_spec("dynamo.frontend").origin).resolve().parents[2]
    with _importable(site):
        from dynamo.common.configuration.groups.runtime_args import DynamoRuntimeArgGroup
        from dynamo.frontend.frontend_args import FrontendArgGroup
        from dynamo.trtllm.backend_args import DynamoTrtllmArgGroup

        front = argparse.ArgumentParser(exit_on_error=False)
        FrontendArgGroup().add_arguments(front)
        worker = argparse.ArgumentParser(exit_on_error=False)
        DynamoRuntimeArgGroup().add_arguments(worker)
        DynamoTrtllmArgGroup().add_arguments(worker)
        yield front, worker
