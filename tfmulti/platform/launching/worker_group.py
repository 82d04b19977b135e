"""The worker processes of one launch attempt: started together, their output relayed
with rank prefixes, stopped together (SIGTERM, then SIGKILL after a grace period).

No TensorFlow is imported here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, TextIO

from tfmulti.names import PREEMPTED_EXIT_CODE
from tfmulti.platform.launching.membership import SlotListWatcher
from tfmulti.platform.launching.network_isolation import PrivateNetwork
from tfmulti.platform.launching.worker_guard import TERMINATE_LINE, exit_status

_POLL_SECONDS = 0.05
# What ssh exits with when it cannot connect or loses the connection.
_REMOTE_SHELL_FAILED = 255
# How long a remote shell gets to end by itself once its input is closed (its guard then
# kills the worker on the host), before the launcher kills the shell.
_REMOTE_EXIT_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How one worker process ended."""

    rank: int
    returncode: int
    remote: bool = False  # started through a remote shell, which reports 128 + a signal

    @property
    def preempted(self) -> bool:
        """The worker saved a checkpoint on SIGTERM and asks to be restarted."""
        return self.returncode == PREEMPTED_EXIT_CODE

    def describe(self) -> str:
        if self.preempted:
            return (
                f"worker {self.rank} was preempted and saved a checkpoint (code {self.returncode})"
            )
        if self.returncode < 0:
            return f"worker {self.rank} was killed by {signal.Signals(-self.returncode).name}"
        if self.remote and self.returncode == _REMOTE_SHELL_FAILED:
            return (
                f"worker {self.rank} exited with code {self.returncode} (ssh's code for a "
                "connection that failed or dropped: is its host up?)"
            )
        if self.remote and 128 < self.returncode < 128 + signal.NSIG:
            # The guard reports a worker killed on its host as 128 + the signal.
            name = _signal_name(self.returncode - 128)
            return f"worker {self.rank} exited with code {self.returncode} (killed by {name})"
        return f"worker {self.rank} exited with code {self.returncode}"

    @property
    def exit_status(self) -> int:
        """The status a shell would report: the code, or 128 + signal number."""
        return exit_status(self.returncode)


def _signal_name(signum: int) -> str:
    """SIGKILL for 9; a real-time signal, which has no name, as `signal 35`."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _die_with_parent() -> None:
    # A launcher killed by SIGKILL cannot stop its workers; the kernel does it instead.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _worker_setup(network: PrivateNetwork | None) -> Callable[[], None]:
    """What a worker runs between fork and exec: join the network, then die with the parent."""
    if network is None:
        return _die_with_parent

    def setup() -> None:
        # Set after joining: prctl(2) clears the parent-death signal on credential
        # changes, and joining a user namespace changes credentials.
        network.enter()
        _die_with_parent()

    return setup


class _OutputRelay:
    """Copies workers' output to one stream, each line prefixed with the worker's rank.

    The chief's carriage returns pass through so its progress bar redraws in
    place; other workers' output is shown a whole line at a time.
    """

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self._open_line_owner: int | None = None

    def relay(self, rank: int, pipe) -> None:
        if rank == 0:
            self._relay_chief(pipe)
        else:
            for raw_line in iter(pipe.readline, b""):
                text = raw_line.decode(errors="replace").rstrip("\n").split("\r")[-1]
                self._write(rank, f"[worker {rank}] {text}\n", ends_line=True)
        pipe.close()

    def _relay_chief(self, pipe) -> None:
        at_line_start = True
        for chunk in iter(lambda: os.read(pipe.fileno(), 4096), b""):
            pieces = []
            for char in chunk.decode(errors="replace"):
                if at_line_start and char not in "\r\n":
                    pieces.append("[worker 0] ")
                    at_line_start = False
                pieces.append(char)
                if char in "\r\n":
                    at_line_start = True
            text = "".join(pieces)
            self._write(0, text, ends_line=text.endswith("\n"))

    def _write(self, rank: int, text: str, ends_line: bool) -> None:
        with self._lock:
            if self._open_line_owner not in (None, rank):
                self._stream.write("\n")
            self._stream.write(text)
            self._stream.flush()
            self._open_line_owner = None if ends_line else rank


@dataclasses.dataclass(frozen=True)
class WorkerProcess:
    """How to start one worker: its command and environment, run here or on another host.

    A remote worker's command is a remote shell running `worker_guard`; its standard input
    carries the launcher's requests (`worker_guard.TERMINATE_LINE`, then end of input),
    since signals to the local remote-shell process do not reach the host.
    """

    command: tuple[str, ...]
    environment: dict[str, str]
    remote: bool = False


class WorkerGroup:
    """One attempt: the worker processes of a group, started together and stopped together."""

    def __init__(
        self,
        workers: Sequence[WorkerProcess],
        stream: TextIO,
        network: PrivateNetwork | None = None,
    ):
        self._relay = _OutputRelay(stream)
        self._workers = list(workers)
        self.processes: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        for rank, worker in enumerate(self._workers):
            process = subprocess.Popen(
                list(worker.command),
                env=worker.environment,
                stdin=subprocess.PIPE if worker.remote else None,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_worker_setup(None if worker.remote else network),
            )
            self.processes.append(process)
            thread = threading.Thread(
                target=self._relay.relay, args=(rank, process.stdout), daemon=True
            )
            thread.start()
            self._threads.append(thread)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def wait(self, should_stop: threading.Event | SlotListWatcher) -> WorkerExit | None:
        """Waits until all workers succeed (None), one fails, or `should_stop` is set
        (a `SlotListWatcher` is also set by a change of membership)."""
        while not should_stop.is_set():
            exits = [process.poll() for process in self.processes]
            for rank, returncode in enumerate(exits):
                if returncode not in (None, 0):
                    return WorkerExit(rank, returncode, self._workers[rank].remote)
            if all(returncode == 0 for returncode in exits):
                return None
            time.sleep(_POLL_SECONDS)
        return None

    @property
    def returncodes(self) -> list[int | None]:
        return [process.poll() for process in self.processes]

    def stop(self, grace_seconds: float, terminate: bool = True) -> None:
        """Ends every worker's process group: SIGTERM (if `terminate`), SIGKILL after the grace.

        Without `terminate` the workers get the grace period to exit by themselves, as
        preempted peers do once they have saved at the step they agreed on.
        """
        if terminate:
            self._terminate()
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(_POLL_SECONDS)
        # A remote guard kills its worker at once on end of input after a TERM; its remote
        # shell then ends by itself, unless the connection is already gone.
        self._terminate(remote_only=True)
        remote = [p for w, p in zip(self._workers, self.processes, strict=True) if w.remote]
        for process in remote:
            _close_quietly(process.stdin)
        deadline = time.monotonic() + _REMOTE_EXIT_SECONDS
        while time.monotonic() < deadline and any(p.poll() is None for p in remote):
            time.sleep(_POLL_SECONDS)
        self._signal_groups(signal.SIGKILL)
        for process in self.processes:
            process.wait()
        for thread in self._threads:
            thread.join(timeout=5)

    def _terminate(self, remote_only: bool = False) -> None:
        """SIGTERM to local workers; a TERM line to remote ones."""
        for worker, process in zip(self._workers, self.processes, strict=True):
            if worker.remote:
                _write_quietly(process, TERMINATE_LINE)
            elif not remote_only:
                _signal_group(process, signal.SIGTERM)

    def _signal_groups(self, signum: int) -> None:
        for process in self.processes:
            _signal_group(process, signum)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    # Each worker leads its own group; killing the group also reaches its children.
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _write_quietly(process: subprocess.Popen, line: str) -> None:
    """Sends `line` to a remote worker's guard, unless it has already gone."""
    if process.poll() is not None or process.stdin is None or process.stdin.closed:
        return
    try:
        process.stdin.write(f"{line}\n".encode())
        process.stdin.flush()
    except (BrokenPipeError, OSError):
        pass


def _close_quietly(pipe: IO[bytes] | None) -> None:
    if pipe is None or pipe.closed:
        return
    try:
        pipe.close()
    except (BrokenPipeError, OSError):
        pass
