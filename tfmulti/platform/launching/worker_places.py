"""Where each worker of a launch runs: its address in `TF_CONFIG`, its host, and its GPUs.

A plain launch runs every worker here on a fresh loopback port. With a remote shell,
each slot's host (`host` or `host:index`, as the SLURM allocation and host lists name
them) runs its workers: this machine directly, another host through the remote shell,
which also finds ports free there and counts its GPUs. No TensorFlow is imported here.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
from collections.abc import Sequence

from tfmulti.platform.launching.remote_shell import RemoteShell
from tfmulti.platform.launching.slurm_nodes import host_of, is_this_machine


@dataclasses.dataclass(frozen=True)
class WorkerPlace:
    """One worker's place in the cluster.

    Attributes:
        address: `host:port` its server listens on, as `TF_CONFIG` names it.
        remote_host: the host the remote shell starts it on; None: started here.
        index_on_host: its position among the workers of its host (its GPU slice).
        workers_on_host: how many workers its host runs.
        host_gpus: GPUs its host has.
    """

    address: str
    remote_host: str | None
    index_on_host: int
    workers_on_host: int
    host_gpus: int


def free_ports(count: int, interface: str = "127.0.0.1") -> list[int]:
    """Returns `count` distinct TCP ports free on `interface` right now ("" = every one)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((interface, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def visible_gpu_count() -> int:
    """Number of NVIDIA GPUs `nvidia-smi -L` lists; 0 without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def loopback_places(num_workers: int, num_gpus: int) -> list[WorkerPlace]:
    """Every worker here, on a fresh loopback port."""
    return [
        WorkerPlace(f"127.0.0.1:{port}", None, rank, num_workers, num_gpus)
        for rank, port in enumerate(free_ports(num_workers))
    ]


def slot_places(
    slots: Sequence[str], remote_shell: RemoteShell, python: str, local_gpus: int
) -> list[WorkerPlace]:
    """Each slot's worker on the slot's host, on a port free there now.

    Hosts are addressed by the names the slots give, so name them as the other hosts
    reach them; this machine named by a loopback name (`localhost`, 127.x) beside other
    hosts is addressed by its host name instead. This machine's slots bind every
    interface, as its remote peers connect.

    Raises:
        remote_shell.RemoteShellError: a host that did not answer (its `host`).
    """
    hosts = [host_of(slot) for slot in slots]
    here = {host: is_this_machine(host) for host in dict.fromkeys(hosts)}
    ports: dict[str, list[int]] = {}
    gpus: dict[str, int] = {}
    for host in here:
        count = hosts.count(host)
        if here[host]:
            ports[host], gpus[host] = free_ports(count, interface=""), local_gpus
        else:
            found = remote_shell.probe(host, python, count)
            ports[host], gpus[host] = list(found.ports), found.gpus
    spans_hosts = not all(here.values())
    places = []
    for rank, host in enumerate(hosts):
        index = hosts[:rank].count(host)
        renamed = spans_hosts and here[host] and _is_loopback(host)
        name = socket.gethostname() if renamed else host
        places.append(
            WorkerPlace(
                address=f"{name}:{ports[host][index]}",
                remote_host=None if here[host] else host,
                index_on_host=index,
                workers_on_host=hosts.count(host),
                host_gpus=gpus[host],
            )
        )
    return places


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"
