"""SIGTERM as an exception, for programs that run others (the planner, benchmarks).

Python's default SIGTERM ends the process at once: a `subprocess.run` child keeps running
and `with` blocks (temporary directories) never clean up. Raised as `Terminated` in the
main thread instead, `subprocess.run` kills its child on the way out and every `with`
block exits.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from tfmulti.errors import Terminated


def on_main_thread() -> bool:
    """Whether this code runs on the main thread, the only one Python lets install a
    signal handler (Ray Train, for one, runs a training function on another)."""
    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises_terminated() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread; the previous
    handler comes back after it. Off the main thread the block changes nothing."""
    if not on_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
