"""Runs one worker on a remote host and ties its life to the launcher's connection.

`tfmulti-launch --remote_shell=...` starts a worker on another host as
`<remote shell> <host> "... python -m tfmulti.platform.launching.worker_guard -- <command>"`.
A remote shell (ssh, srun) forwards neither the launcher's signals nor, without a
terminal, its death, so the guard listens on its standard input, which the remote shell
connects to the launcher:

- a line `TERM` sends SIGTERM to the worker (the preemption path: it saves, then exits);
- end of input (the launcher stopped it or died, or the connection dropped) sends SIGTERM,
  then SIGKILL after the grace period, or SIGKILL at once after a `TERM`;
- SIGTERM, SIGHUP or SIGINT to the guard itself (a cancelled SLURM step, a closed
  terminal) acts as end of input.

The guard exits with the worker's status (128 + signal number for a worker killed by a
signal), which the remote shell hands back to the launcher. No TensorFlow is imported here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

TERMINATE_LINE = "TERM"


class _Guard:
    """Signals one worker process group as the launcher's messages ask."""

    def __init__(self, process: subprocess.Popen, grace_seconds: float):
        self._process = process
        self._grace_seconds = grace_seconds
        self._lock = threading.Lock()
        self._asked_to_terminate = False  # a TERM line came from the launcher
        self._stopping = False  # the grace period has started

    def terminate(self) -> None:
        """A `TERM` line: SIGTERM now (the worker saves and exits)."""
        with self._lock:
            self._asked_to_terminate = True
        self._signal(signal.SIGTERM)

    def connection_lost(self) -> None:
        """End of input, or SIGTERM/SIGHUP/SIGINT to the guard: SIGKILL at once after a
        `TERM` line; else SIGTERM, then SIGKILL if the worker outlasts the grace period
        (a later call during that period changes nothing)."""
        with self._lock:
            kill_now, already_stopping = self._asked_to_terminate, self._stopping
            self._stopping = True
        if kill_now:
            self._signal(signal.SIGKILL)
            return
        if already_stopping:
            return
        self._signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=self._grace_seconds)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)

    def listen(self, messages: TextIO) -> None:
        for line in messages:
            if line.strip() == TERMINATE_LINE:
                self.terminate()
        self.connection_lost()

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self._process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def exit_status(returncode: int) -> int:
    """A process's return code as a shell reports it: the code, or 128 + signal number."""
    return returncode if returncode >= 0 else 128 - returncode


def run(command: Sequence[str], grace_seconds: float, messages: TextIO | None = None) -> int:
    """Runs `command` in its own process group under the guard; returns its exit status.

    The launcher's scratch directory (`TMPDIR`, where a serving worker posts its settings
    for the chief to check) is made here if this host lacks it; it is shared by the host's
    workers, so the launcher, not a guard, removes it at the end.
    """
    scratch = os.environ.get("TMPDIR")
    if scratch:
        os.makedirs(scratch, exist_ok=True)
    # Installed before the worker starts, so a stop request is never missed; the handler
    # only records it, and a thread stops the worker.
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())
    process = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, start_new_session=True)
    guard = _Guard(process, grace_seconds)
    threading.Thread(target=_stop_when_set, args=(stop_requested, guard), daemon=True).start()
    threading.Thread(target=guard.listen, args=(messages or sys.stdin,), daemon=True).start()
    return exit_status(process.wait())


def _stop_when_set(stop_requested: threading.Event, guard: _Guard) -> None:
    stop_requested.wait()
    guard.connection_lost()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfmulti.platform.launching.worker_guard",
        description="Run a worker, stopping it when the launcher asks or its connection ends.",
    )
    parser.add_argument("--grace_seconds", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    arguments = parser.parse_args(argv)
    command = arguments.command[1:] if arguments.command[:1] == ["--"] else arguments.command
    if not command:
        parser.error("give the worker command after --")
    return run(command, arguments.grace_seconds)


if __name__ == "__main__":
    sys.exit(main())
