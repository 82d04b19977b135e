"""A private network for a local launch: a Linux user+network namespace holding only loopback.

TensorFlow's gRPC servers have no authentication and listen on every interface of
their network namespace. Workers that join a fresh namespace whose only interface is
loopback can reach each other on 127.0.0.1 and no one else can reach them. Files,
processes, signals and user ids are untouched: the namespace maps the current user to
itself, so files the workers write belong to that user outside as well.

A small holder process creates the namespace (unshare) and keeps it alive; each worker
joins it (setns) between fork and exec, so the launcher keeps its own network and stays
the parent of its workers. No TensorFlow is imported here.

Example:
    >>> with PrivateNetwork() as network:
    ...     subprocess.run(["ss", "-ltn"], preexec_fn=network.enter)
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

ISOLATIONS = ("auto", "namespace", "none")
ISOLATION_VARIABLE = "TFMULTI_ISOLATION"
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

# Run in the holder: unshare, map this user to itself, bring loopback up, then wait
# until the launcher closes stdin (or dies, which closes it too).
_HOLDER_CODE = r"""# tfmulti launch: holds the workers' private network
import ctypes, fcntl, os, socket, struct, sys
uid, gid = os.getuid(), os.getgid()
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x40000000) != 0:
    sys.stdout.write("unshare: " + os.strerror(ctypes.get_errno()) + "\n")
    sys.exit(1)
try:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, 0x8913, request)[:18])[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
except OSError as error:
    sys.stdout.write(f"{error}\n")
    sys.exit(1)
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.read()
"""


class IsolationUnavailable(OSError):
    """Raised when this machine cannot give a launch a private network."""


class PrivateNetwork:
    """A network namespace with only loopback (up), kept alive until `close`.

    Raises:
        IsolationUnavailable: not Linux, or the kernel refuses unprivileged user
            namespaces; the message says why.
    """

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise IsolationUnavailable(f"needs Linux namespaces. Received: {sys.platform}")
        self._holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # Out of the terminal's process group: Ctrl-C goes to the launcher, which stops
            # the workers and then closes the holder's stdin.
            start_new_session=True,
        )
        answer = self._holder.stdout.readline().strip()
        if answer != "ready":
            self.close()
            raise IsolationUnavailable(answer or "the namespace holder exited")

    def enter(self) -> None:
        """Moves the calling process into the namespace; call between fork and exec."""
        libc = ctypes.CDLL(None, use_errno=True)
        pid = self._holder.pid
        descriptors = [os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY) for kind in ("user", "net")]
        for descriptor, kind in zip(descriptors, (_CLONE_NEWUSER, _CLONE_NEWNET), strict=True):
            if libc.setns(descriptor, kind) != 0:
                raise OSError(ctypes.get_errno(), "setns into the launch's private network")
            os.close(descriptor)

    def close(self) -> None:
        """Lets the holder exit; the namespace ends once its last worker has."""
        self._holder.stdin.close()
        self._holder.wait()
        self._holder.stdout.close()

    def __enter__(self) -> PrivateNetwork:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def has_only_loopback() -> bool:
    """Whether this process's network namespace has no interface but loopback (Linux)."""
    try:
        with open("/proc/net/dev") as file:
            lines = file.read().splitlines()[2:]
    except OSError:
        return False
    return {line.split(":")[0].strip() for line in lines} == {"lo"}
