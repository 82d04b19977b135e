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

from tfmulti.platform.remote_shell import RemoteShell
from tfmulti.platform.slurm_nodes import host_of, is_this_machine


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


def free_loopback_ports(count: int) -> list[int]:
    """Returns `count` distinct TCP ports free on 127.0.0.1 right now."""
    return free_ports(count)


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
        for rank, port in enumerate(free_loopback_ports(num_workers))
    ]


def slot_places(
    slots: Sequence[str], remote_shell: RemoteShell, python: str, local_gpus: int
) -> list[WorkerPlace]:
    """Each slot's worker on the slot's host, on a port free there now.

    Hosts are addressed by the names the slots give, so name them as the other hosts
    reach them. This machine's slots bind every interface, as its remote peers connect.

    Raises:
        remote_shell.RemoteShellError: a host that did not answer.
    """
    hosts = [host_of(slot) for slot in slots]
    ports: dict[str, list[int]] = {}
    gpus: dict[str, int] = {}
    for host in dict.fromkeys(hosts):
        count = hosts.count(host)
        if is_this_machine(host):
            ports[host], gpus[host] = free_ports(count, interface=""), local_gpus
        else:
            found = remote_shell.probe(host, python, count)
            ports[host], gpus[host] = list(found.ports), found.gpus
    places = []
    for rank, host in enumerate(hosts):
        index = hosts[:rank].count(host)
        places.append(
            WorkerPlace(
                address=f"{host}:{ports[host][index]}",
                remote_host=None if is_this_machine(host) else host,
                index_on_host=index,
                workers_on_host=hosts.count(host),
                host_gpus=gpus[host],
            )
        )
    return places
