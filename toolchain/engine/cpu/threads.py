"""Work that must not leave an OpenMP pool in the calling thread.

libgomp gives every thread that runs parallel work (torch's intra-op kernels, MKL, oneDNN) a pool of workers of
its own for as long as that thread lives. With more pooled threads than CPUs it cuts the spinning between
parallel regions to a hundred turns, so every matmul of the thread that steps the engine waits for its workers to
wake. A server loads on its main thread, which lives on, and steps on another: loaded there, the 124M-parameter
benchmark model's decode steps took 30 ms against 20 on a two-core host (OpenMP's default wait policy, one
request); loaded on a passing thread, 20.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


def on_passing_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a thread that ends with it (and its pool with it); its exception is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread as is
            box["error"] = err

    thread = threading.Thread(target=run, name="cpu-engine-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
