"""Script runs for the tests that skip TensorFlow's import: a server forks them ready-made.

A small `train.py` run spends about 80% of its CPU time importing TensorFlow, Keras and
tfmulti (about 4 s on two cores), and the suite runs such scripts hundreds of times. A server
(one per xdist worker) imports them once, without starting TensorFlow's runtime (no eager
context, no devices), and forks a process per run. The run is still a process of its own,
with the test's arguments, environment, working directory and standard streams, started by
`python tests/warm_start.py run SOCKET script args...` (a client of a few milliseconds that
passes its streams to the forked run and exits as it does, or with its signal). So
`subprocess.run` with `capture_output` and `timeout` keeps working: a killed client's run is
killed with it.

Runs stay cold (a plain `python script`) where the server cannot reproduce a fresh start:
`launch.py` (signals and process groups are the point there), `--help` (which must not load
TensorFlow), a TensorFlow log level or any variable read while TensorFlow is imported that
differs from the server's. `TFMULTI_TESTS_COLD=1` runs every script cold.

    python tests/warm_start.py serve SOCKET     # the server (tests/script_runner.py starts it)
    python tests/warm_start.py run SOCKET SCRIPT ARGS...
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile

COLD_ENV = "TFMULTI_TESTS_COLD"
# Read while Python, TensorFlow or Keras start, so a forked run would not see a new value.
IMPORT_TIME_VARIABLES = (
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL",
    "TF_CPP_VMODULE",
    "TF_ENABLE_ONEDNN_OPTS",
    "TF_XLA_FLAGS",
    "XLA_FLAGS",
    "KERAS_BACKEND",
    "KERAS_HOME",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTHONHASHSEED",
    "PYTHONOPTIMIZE",
    "PYTHONWARNINGS",
    "PYTHONDONTWRITEBYTECODE",
    "MPLBACKEND",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
)
COLD_SCRIPTS = ("launch.py",)
COLD_FLAGS = ("--help", "--helpfull", "--helpshort", "--tf_log_level")
NAMESPACES = ("user", "net")
STREAMS_AND_NAMESPACES = 3 + len(NAMESPACES)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def can_run_warm(script: str, args: tuple[str, ...], env: dict, server_env: dict) -> bool:
    """Whether a forked run of `script args` under `env` starts as a fresh process would."""
    if env.get(COLD_ENV) or os.path.basename(script) in COLD_SCRIPTS:
        return False
    if any(arg.split("=")[0] in COLD_FLAGS for arg in args):
        return False
    return all(env.get(name) == server_env.get(name) for name in IMPORT_TIME_VARIABLES)


class WarmServer:
    """This process's server, started at the first warm run; cold runs only if it fails."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.socket_path: str | None = None
        self.process = None
        self.failed = False

    def command(self, script_path: str, args: tuple[str, ...], env: dict) -> list[str] | None:
        """The command that runs `script_path args` warm under `env`, or None: run it cold."""
        if self.failed or not can_run_warm(script_path, args, env, self.env):
            return None
        if self.process is None:
            self._start()
        elif self.process.poll() is not None:
            self.failed = True  # the server died: later runs start cold
        if self.failed:
            return None
        return [
            sys.executable,
            os.path.abspath(__file__),
            "run",
            self.socket_path,
            script_path,
            *args,
        ]

    def launch_command(self, argv: list[str], env: dict) -> list[str]:
        """`python launch.py flags -- python script.py args` with the workers' command warm.

        The launcher stays cold; each worker is a client whose run joins the worker's
        private network (the server decides, with the worker's environment, what goes cold).
        """
        if "--" not in argv:
            return argv
        split = argv.index("--") + 1
        launcher, worker = argv[:split], argv[split:]
        if len(worker) < 2 or worker[0] != sys.executable or not worker[1].endswith(".py"):
            return argv
        warm = self.command(worker[1], tuple(worker[2:]), env)
        return [*launcher, *warm] if warm else argv

    def _start(self) -> None:
        import atexit
        import subprocess
        import tempfile
        import time

        directory = tempfile.mkdtemp(prefix="warm-")
        self.socket_path = os.path.join(directory, "socket")
        log = open(os.path.join(directory, "server.log"), "w")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", self.socket_path],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        atexit.register(self.process.kill)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.failed = True
                with open(log.name) as text:
                    sys.stderr.write(
                        f"warm_start: no server, runs go cold: {text.read()[-2000:]}\n"
                    )
                return
            time.sleep(0.05)


# ---- framing: a length-prefixed JSON message, with file descriptors on the first ----


def _send(connection: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(connection, [payload], list(fds))
    else:
        connection.sendall(payload)


def _receive(connection: socket.socket, max_fds: int = 0):
    """(message or None at end of stream, fds)."""
    fds: list[int] = []
    buffer = b""
    while len(buffer) < 4 or len(buffer) < 4 + struct.unpack("!I", buffer[:4])[0]:
        if max_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(connection, 65536, max_fds)
        else:
            chunk = connection.recv(65536)
        if not chunk:
            return None, fds
        buffer += chunk
    (size,) = struct.unpack("!I", buffer[:4])
    return json.loads(buffer[4 : 4 + size]), fds


# ---- the client: what the test's subprocess runs ----


def run_client(socket_path: str, argv: list[str]) -> None:
    """Asks the server for a run of `argv` with this process's streams, environment and
    directory; forwards signals to it; exits with its code, or dies of its signal."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(socket_path)
    except OSError as error:  # the server is gone: the run starts cold instead
        sys.stderr.write(f"warm_start: no server at {socket_path} ({error}); running cold\n")
        os.execv(sys.executable, [sys.executable, *argv])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    # The run joins this process's user and network namespaces (a launch's private network).
    namespaces = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in NAMESPACES]
    _send(connection, request, [0, 1, 2, *namespaces])
    for number in FORWARDED_SIGNALS:
        signal.signal(number, lambda number, frame: _send(connection, {"signal": number}))
    while True:
        try:
            message, _ = _receive(connection)
        except InterruptedError:
            continue
        if message is None:
            sys.stderr.write("warm_start: the server closed the run without its status\n")
            os._exit(1)
        if message.get("cold"):  # a variable read at import differs from the server's
            os.execv(sys.executable, [sys.executable, *argv])
        if "signal" in message and "exited" in message:
            if message["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(message["signal"], signal.SIG_DFL)
            os.kill(os.getpid(), message["signal"])
        if "exited" in message:
            os._exit(message["exited"])


# ---- the server ----


def _import_everything() -> None:
    """Imports what the scripts import, starting no TensorFlow runtime."""
    from tfmulti.platform.runtime.tf_startup import start_tensorflow

    start_tensorflow()
    import keras  # noqa: F401
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import sklearn.datasets  # noqa: F401

    # The library, not tfmulti.cli: each script defines its own flags when imported.
    for package in (
        "data",
        "hybrid",
        "parallel",
        "pipeline",
        "planner",
        "run",
        "strategies",
        "tensor_parallel",
        "zero",
        "keras_distribution",
        "placement",
        "costing",
    ):
        importlib.import_module(f"tfmulti.{package}")
    from tensorflow.python.eager import context

    if context.context()._context_handle is not None:
        raise RuntimeError("importing the scripts' modules started TensorFlow's runtime")


def serve(socket_path: str) -> None:
    """Imports the scripts' modules, then forks a run per request until the parent goes."""
    parent = os.getppid()
    # Before importing: TensorFlow's start-up sets some of these in this process.
    import_env = {name: os.environ.get(name) for name in IMPORT_TIME_VARIABLES}
    _import_everything()
    base_path = [entry for entry in sys.path[1:] if entry not in _python_path(os.environ)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(16)
    os.rename(socket_path + ".tmp", socket_path)  # ready: clients may connect
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 1.0)
        if not readable:
            continue
        connection, _ = listener.accept()
        request, fds = _receive(connection, max_fds=STREAMS_AND_NAMESPACES)
        if (
            request is None
            or len(fds) != STREAMS_AND_NAMESPACES
            or not _same_imports(request, import_env)
        ):
            if request is not None:
                _send(connection, {"cold": True})
            connection.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _monitor(connection, request, fds, base_path)
        connection.close()
        for fd in fds:
            os.close(fd)


def _same_imports(request: dict, import_env: dict) -> bool:
    """Whether the run would import as this server did (a launched worker's environment is
    only known here)."""
    return all(request["env"].get(name) == value for name, value in import_env.items())


def _python_path(env: dict) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _monitor(connection: socket.socket, request: dict, fds: list[int], base_path: list) -> None:
    """In the forked monitor: forks the run, passes signals on, reports its end; kills the
    run if the client is killed."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    run = os.fork()
    if run == 0:
        connection.close()
        _run(request, fds, base_path)
    for fd in fds:
        os.close(fd)
    while True:
        readable, _, _ = select.select([connection], [], [], 0.05)
        if readable:
            try:
                message, _ = _receive(connection)
            except OSError:
                message = None
            if message is None:  # the client was killed: so is its run, as a child would be
                os.kill(run, signal.SIGKILL)
                os.waitpid(run, 0)
                os._exit(0)
            os.kill(run, message["signal"])
        finished, status, usage = os.wait4(run, os.WNOHANG)
        if finished:
            break
    if os.WIFSIGNALED(status):
        report = {"exited": 128 + os.WTERMSIG(status), "signal": os.WTERMSIG(status)}
    else:
        report = {"exited": os.WEXITSTATUS(status)}
    report["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    if os.environ.get("TFMULTI_TESTS_WARM_LOG"):
        with open(os.environ["TFMULTI_TESTS_WARM_LOG"], "a") as log:
            log.write(json.dumps({"argv": request["argv"], **report}) + "\n")
    try:
        _send(connection, report)
    except OSError:
        pass
    os._exit(0)


def _run(request: dict, fds: list[int], base_path: list) -> None:
    """In the forked run: becomes `python argv...` started fresh, runs it, exits as it would."""
    streams, namespaces = fds[:3], fds[3:]
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    _join_namespaces(namespaces)
    for number in (*FORWARDED_SIGNALS, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from TMPDIR (a launched worker's own scratch)
    script = os.path.abspath(request["argv"][0])
    sys.argv = [request["argv"][0], *request["argv"][1:]]
    sys.path[:] = [os.path.dirname(script), *_python_path(request["env"]), *base_path]
    _fresh_random_states()
    code = _run_main(script)
    _end(code)


def _join_namespaces(namespaces: list[int]) -> None:
    """Joins the client's user and network namespaces where they are not this process's, as
    the launcher's workers do between fork and exec (this forked run has one thread)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for kind, fd in zip(NAMESPACES, namespaces, strict=True):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino:
            if libc.setns(fd, 0) != 0:
                sys.stderr.write(f"warm_start: setns({kind}): {os.strerror(ctypes.get_errno())}\n")
                os._exit(1)
        os.close(fd)


def _fresh_random_states() -> None:
    """Seeds from the OS what a new process would: every run shares the server's otherwise."""
    import random

    import numpy as np

    random.seed()
    np.random.seed()


def _run_main(script: str) -> int:
    import runpy
    import traceback

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        code = end.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter prints any uncaught exception
        traceback.print_exc()
        return 1
    return 0


def _end(code: int) -> None:
    """Python's exit: non-daemon threads joined, exit handlers run, streams flushed."""
    import atexit
    import threading

    from tfmulti.platform.runtime.quick_exit import exit_code_will_be

    exit_code_will_be(code)
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):
            pass
    os._exit(code)


def main() -> None:
    role, socket_path, *argv = sys.argv[1:]
    if role == "serve":
        serve(socket_path)
    else:
        run_client(socket_path, argv)


if __name__ == "__main__":
    main()
