"""Is NVIDIA Dynamo installed as `make dynamo` installs it? One line saying how to get it when it is not.

`pip install ai-dynamo` cannot work here: ai-dynamo 1.6.1 pins aisimulate 0.13.0, a stub that downloads from a host
not reachable at install time. The Makefile installs ai-dynamo-runtime with its dependencies, ai-dynamo without its
own, then ai-dynamo's other listed dependencies (pyproject's `dynamo` extra).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from toolchain.dynamo import DYNAMO_VERSION
from toolchain.errors import ToolchainError

INSTALL = (f"run `make dynamo` (pip install ai-dynamo-runtime=={DYNAMO_VERSION}; pip install --no-deps "
           f"ai-dynamo=={DYNAMO_VERSION}; pip install -e '.[dynamo]')")
# What the frontend and a worker import beyond the two wheels (ai-dynamo's listed dependencies).
NEEDED_MODULES = ("dynamo.frontend", "dynamo.llm", "dynamo.runtime", "msgspec", "zstandard", "zmq", "uvloop")


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def problem() -> str | None:
    """Why this interpreter cannot run Dynamo's frontend and workers, or None."""
    for dist in ("ai-dynamo-runtime", "ai-dynamo"):
        try:
            version = _version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"NVIDIA Dynamo is not installed ({dist} is missing)"
        if version != DYNAMO_VERSION:
            return f"{dist} {version} is installed; this toolchain runs Dynamo {DYNAMO_VERSION}"
    missing = [m for m in NEEDED_MODULES if not _has_module(m)]
    if missing:
        return f"NVIDIA Dynamo is installed without {', '.join(missing)} (ai-dynamo went in without its dependencies)"
    return None


def require() -> None:
    """Raise a one-line ToolchainError naming the install command unless Dynamo can run."""
    why = problem()
    if why:
        raise ToolchainError(why, INSTALL)
