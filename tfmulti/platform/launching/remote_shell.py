"""Starting workers on other hosts through a remote shell (ssh, srun), as Horovod and
DeepSpeed's launchers do.

`tfmulti-launch --remote_shell="ssh -o BatchMode=yes"` starts each worker whose slot
names another host as `<remote shell> <host> "<command line>"`; with `{host}` in the
shell's words the host goes there instead (`srun --nodes=1 --ntasks=1 -w {host} sh -c`).
The command line, for a POSIX shell on the host (ssh runs it with the login shell), changes
to the launcher's working directory, sets the variables the launcher gives the worker (its
`TF_CONFIG` above all) and runs the worker under `worker_guard`, which stops it when the
launcher asks or its connection ends.
No TensorFlow is imported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence

HOST_PLACEHOLDER = "{host}"
# Besides the variables the launcher sets, these reach remote workers when set here.
FORWARDED_VARIABLES = ("PYTHONPATH", "TFMULTI_ISOLATION", "TF_CPP_MIN_LOG_LEVEL")
_PROBE_TIMEOUT_SECONDS = 60.0
# Prints free TCP ports (bound on every interface, as TensorFlow's servers bind) and
# the host's GPU count, as JSON.
_PROBE = (
    "import json,shutil,socket,subprocess,sys\n"
    "socks=[socket.socket() for _ in range(int(sys.argv[1]))]\n"
    "[s.bind(('',0)) for s in socks]\n"
    "gpus=0\n"
    "if shutil.which('nvidia-smi'):\n"
    "    out=subprocess.run(['nvidia-smi','-L'],capture_output=True,text=True,timeout=10).stdout\n"
    "    gpus=sum(line.startswith('GPU ') for line in out.splitlines())\n"
    "print(json.dumps({'ports':[s.getsockname()[1] for s in socks],'gpus':gpus}))\n"
)


class RemoteShellError(ValueError):
    """A remote shell that cannot be used, or a host it could not reach (`host`)."""

    def __init__(self, message: str, host: str | None = None):
        super().__init__(message)
        self.host = host


@dataclasses.dataclass(frozen=True)
class HostResources:
    """What a probe of a host found: TCP ports free there now, and its GPU count."""

    ports: tuple[int, ...]
    gpus: int


@dataclasses.dataclass(frozen=True)
class RemoteShell:
    """How the launcher reaches another host: the remote shell's words.

    Example:
        >>> RemoteShell.parse("ssh -p 2222").argv("node2", "hostname")
        ['ssh', '-p', '2222', 'node2', 'hostname']
    """

    words: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> RemoteShell:
        try:
            words = tuple(shlex.split(text))
        except ValueError as error:
            raise RemoteShellError(
                f"--remote_shell is not a valid shell command ({error}). Received: {text!r}"
            ) from None
        if not words:
            raise RemoteShellError(
                "--remote_shell is empty; give a command such as 'ssh -o BatchMode=yes'. "
                f"Received: {text!r}"
            )
        return cls(words)

    def argv(self, host: str, command_line: str) -> list[str]:
        """The local command that runs `command_line` (one shell line) on `host`."""
        if any(HOST_PLACEHOLDER in word for word in self.words):
            words = [word.replace(HOST_PLACEHOLDER, host) for word in self.words]
        else:
            words = [*self.words, host]
        return [*words, command_line]

    def probe(self, host: str, python: str, num_ports: int) -> HostResources:
        """Free ports and GPUs of `host`, asked through the remote shell.

        Raises:
            RemoteShellError: the host did not answer, in one line naming it.
        """
        line = shlex.join([python, "-c", _PROBE, str(num_ports)])
        try:
            result = subprocess.run(
                self.argv(host, line),
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT_SECONDS,
                stdin=subprocess.DEVNULL,
            )
        except (subprocess.SubprocessError, OSError) as error:
            raise self._unreachable(host, python, str(error)) from None
        try:
            answer = json.loads(result.stdout.strip().splitlines()[-1])
            return HostResources(tuple(int(port) for port in answer["ports"]), int(answer["gpus"]))
        except (ValueError, IndexError, KeyError, TypeError):
            why = _last_line(result.stderr) or f"exit code {result.returncode}"
            raise self._unreachable(host, python, why) from None

    def remove_directory(self, host: str, path: str) -> None:
        """Removes `path` on `host` (the launch's scratch directory), as far as it can."""
        try:
            subprocess.run(
                self.argv(host, shlex.join(["rm", "-rf", path])),
                capture_output=True,
                timeout=_PROBE_TIMEOUT_SECONDS,
                stdin=subprocess.DEVNULL,
            )
        except (subprocess.SubprocessError, OSError):
            pass

    def _unreachable(self, host: str, python: str, why: str) -> RemoteShellError:
        return RemoteShellError(
            f"could not reach host {host} through --remote_shell={shlex.join(self.words)!r} "
            f"({why}); check that `{shlex.join(self.argv(host, 'true'))}` succeeds without "
            f"a password and that {python} runs there",
            host,
        )


def remote_python(command: Sequence[str]) -> str:
    """The interpreter that runs the guard and the probe on a remote host: the worker
    command's own when it is a Python, else `python3`."""
    program = os.path.basename(command[0]) if command else ""
    return command[0] if program.startswith("python") else "python3"


def remote_command_line(
    command: Sequence[str],
    variables: Mapping[str, str],
    working_directory: str,
    grace_seconds: float,
) -> str:
    """The shell line a remote host runs for one worker.

    Example:
        >>> remote_command_line(["python", "train.py"], {"TF_CONFIG": "{}"}, "/job", 5)
        "cd /job && exec env 'TF_CONFIG={}' python -m tfmulti.platform.launching.worker_guard ..."
    """
    assignments = [f"{name}={value}" for name, value in sorted(variables.items())]
    guarded = [
        remote_python(command),
        "-m",
        "tfmulti.platform.launching.worker_guard",
        f"--grace_seconds={grace_seconds:g}",
        "--",
        *command,
    ]
    return (
        f"cd {shlex.quote(working_directory)} && exec env {shlex.join(assignments)} "
        f"{shlex.join(guarded)}"
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
