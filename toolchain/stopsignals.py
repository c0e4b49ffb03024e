"""Stop signals for every command that starts servers: SIGTERM (`kill`, a CI timeout), SIGINT (Ctrl-C) and
SIGHUP (the terminal or ssh session closing) all end the command the same way, after it has stopped what it
started.

Python's defaults differ per signal: SIGINT raises KeyboardInterrupt, so `finally` blocks stop the servers, but
SIGTERM and SIGHUP end the interpreter on the spot. The servers run in their own process groups (procgroup.py),
so those would outlive the command with their ports, memory and /dev/shm regions. Inside `stop_on_signals()` the
first of the three raises `Stopped` (a KeyboardInterrupt, so code that already handles Ctrl-C handles it), and
later ones are ignored: a second `kill` or Ctrl-C must not cut the stop short and leak what the first was
stopping. The command's `finally` and `with` blocks do the stopping; the CLI exits with 128 + the signal number,
as a shell reports a process ended by that signal.

A leaf: the standard library only.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """The command was asked to stop by `signum`."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def stop_on_signals(on_signal: Callable[[int], None] | None = None) -> Iterator[None]:
    """Within the block, the first stop signal raises `Stopped` where the main thread is; or, with `on_signal`,
    calls it (a server with its own graceful shutdown, e.g. uvicorn's) and raises `Stopped` once the block has
    returned. Later stop signals are ignored until the block exits; the previous handlers are then restored.
    Off the main thread (where Python cannot take signals) the block runs unguarded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    swallowed: list[int] = []
    main = threading.main_thread().ident
    assert main is not None

    def handler(signum: int, frame) -> None:
        if received and not swallowed:
            return  # already stopping: let the cleanup finish
        swallowed.clear()
        received.append(signum)
        if on_signal is None:
            raise Stopped(signum)
        on_signal(signum)

    # A handler's exception that lands while the main thread runs a __del__ or a weakref callback (the bench's
    # clients run many) is printed as "Exception ignored" and dropped, and the command would go on: seen on
    # `deploy`. Python reports such an exception to sys.unraisablehook; a Stopped there is raised again a moment
    # later, by the same signal sent to the main thread once more.
    previous_hook = sys.unraisablehook

    active = [True]

    def resend(signum: int) -> None:
        if active[0]:
            signal.pthread_kill(main, signum)

    def unraisable(info) -> None:
        if isinstance(info.exc_value, Stopped):
            swallowed.append(info.exc_value.signum)
            threading.Timer(0.05, resend, (info.exc_value.signum,)).start()
            return
        previous_hook(info)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        active[0] = False
        sys.unraisablehook = previous_hook
        for sig, old in previous.items():
            signal.signal(sig, old)
    if received and on_signal is not None:
        raise Stopped(received[0])
