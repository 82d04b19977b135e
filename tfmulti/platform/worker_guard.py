"""Runs one worker on a remote host and ties its life to the launcher's connection.

`tfmulti-launch --remote_shell=...` starts a worker on another host as
`<remote shell> <host> "... python -m tfmulti.platform.worker_guard -- <command>"`.
A remote shell (ssh, srun) forwards neither the launcher's signals nor, without a
terminal, its death, so the guard listens on its standard input, which the remote shell
connects to the launcher:

- a line `TERM` sends SIGTERM to the worker (the preemption path: it saves, then exits);
- end of input (the launcher stopped it or died, or the connection dropped) sends SIGTERM,
  then SIGKILL after the grace period, or SIGKILL at once after a `TERM`;
- SIGTERM or SIGHUP to the guard itself acts as end of input.

The guard exits with the worker's status (128 + signal number for a worker killed by a
signal), which the remote shell hands back to the launcher. No TensorFlow is imported here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

TERMINATE_LINE = "TERM"


class _Guard:
    """Signals one worker process group as the launcher's messages ask."""

    def __init__(self, process: subprocess.Popen, grace_seconds: float):
        self._process = process
        self._grace_seconds = grace_seconds
        self._terminated = threading.Event()
        self._lock = threading.Lock()

    def terminate(self) -> None:
        with self._lock:
            self._terminated.set()
            self._signal(signal.SIGTERM)

    def connection_lost(self) -> None:
        """Stops the worker: at once after a `TERM`, else after SIGTERM and the grace."""
        with self._lock:
            already_terminated = self._terminated.is_set()
            self._terminated.set()
            self._signal(signal.SIGKILL if already_terminated else signal.SIGTERM)
        if already_terminated:
            return
        try:
            self._process.wait(timeout=self._grace_seconds)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)

    def listen(self, messages) -> None:
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


def run(command: Sequence[str], grace_seconds: float, messages=None) -> int:
    """Runs `command` in its own process group under the guard; returns its exit status.

    The launcher's scratch directory (`TMPDIR`, where a serving worker posts its settings
    for the chief to check) is made here if this host lacks it, and then removed at exit.
    """
    scratch = os.environ.get("TMPDIR")
    made_scratch = bool(scratch) and not os.path.isdir(scratch)
    if made_scratch:
        os.makedirs(scratch)
    try:
        return _run_guarded(command, grace_seconds, messages)
    finally:
        if made_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_guarded(command: Sequence[str], grace_seconds: float, messages) -> int:
    process = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, start_new_session=True)
    guard = _Guard(process, grace_seconds)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(
            signum,
            lambda *_: threading.Thread(target=guard.connection_lost, daemon=True).start(),
        )
    listener = threading.Thread(target=guard.listen, args=(messages or sys.stdin,), daemon=True)
    listener.start()
    return exit_status(process.wait())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfmulti.platform.worker_guard",
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
