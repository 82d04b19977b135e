"""Layouts over several hosts: which mesh axis crosses the hosts, and what crossing costs.

Pure Python. `scripts/train.py` lays a mesh over launched workers (one per host) with one
axis across them (`--cross_host_axis`), and tensor groups always inside a host:

- data: each host holds data / hosts whole replicas. A hybrid run sums a stage's
  gradients over the replicas of each host, then over the hosts (`WorkerCollectives`); a
  data-only mesh runs `--strategy=multi_worker`, one ring over every replica.
- pipe: each host holds pipe / hosts consecutive stages of every replica, so a stage's
  gradient sum stays inside one host and only the activations and their gradients at the
  stage boundaries between hosts cross (a pipe-only mesh runs `--strategy=pipeline` over
  the workers' devices). Such a step runs unrolled: a rolled loop's state would cross
  hosts every round.

Inside a host a transfer or an all-reduce costs what it costs on one host; between
hosts, the inter-host link's latency per message plus bytes over its bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence

from tfmulti.pipeline.actions import Action, Schedule
from tfmulti.pipeline.dependencies import run_in_order
from tfmulti.pipeline.simulate import CostModel
from tfmulti.planner.costs import Hardware, allreduce_seconds
from tfmulti.platform.mesh import HybridMesh

CROSS_HOST_AXES = ("data", "pipe")


def hosts_used(mesh_devices: int, hosts: int, devices_per_host: int) -> int | None:
    """Hosts a mesh of `mesh_devices` runs on: whole hosts, or part of one; None if neither.

    Example:
        >>> hosts_used(4, hosts=2, devices_per_host=2), hosts_used(1, 2, 2), hosts_used(3, 3, 2)
        (2, 1, None)
    """
    if mesh_devices % devices_per_host == 0 and hosts % (mesh_devices // devices_per_host) == 0:
        return mesh_devices // devices_per_host
    if devices_per_host % mesh_devices == 0:
        return 1
    return None


def cross_host_axes(mesh: HybridMesh, hosts: int) -> tuple[str | None, ...]:
    """The axes `scripts/train.py` can lay across `hosts` hosts for `mesh` ((None,) on one).

    An axis crosses when its size is a multiple of the hosts; tensor groups never cross.

    Example:
        >>> cross_host_axes(HybridMesh(data=2, pipe=2), 2), cross_host_axes(HybridMesh(tensor=4), 2)
        (('data', 'pipe'), ())
    """
    if hosts == 1:
        return (None,)
    return tuple(axis for axis in CROSS_HOST_AXES if getattr(mesh, axis) % hosts == 0)


def check_cross_host_axis(mesh: HybridMesh, hosts: int, cross_host_axis: str | None) -> None:
    """Raises ValueError unless `cross_host_axis` can cross `hosts` hosts for `mesh`."""
    allowed = cross_host_axes(mesh, hosts)
    if cross_host_axis not in allowed:
        raise ValueError(
            f"Mesh {mesh} over {hosts} host(s) can lay across them: {allowed or 'no axis'} "
            "(an axis whose size is a multiple of the hosts; tensor groups stay inside a "
            f"host). Received: cross_host_axis={cross_host_axis!r}"
        )


def inter_host_ring_seconds(num_bytes: float, group_size: int, hardware: Hardware) -> float:
    """A ring all-reduce over `group_size` ranks whose slowest links join hosts:
    2(n-1) messages, each of latency, moving 2(n-1)/n x bytes at the inter-host bandwidth.

    Example:
        >>> link = Hardware(inter_host_bandwidth=1e9, inter_host_latency=1e-4)
        >>> round(inter_host_ring_seconds(1e6, 2, link), 6)
        0.0012
    """
    if group_size <= 1:
        return 0.0
    steps = 2 * (group_size - 1)
    return steps * hardware.inter_host_latency + (
        steps / group_size * num_bytes / hardware.inter_host_bandwidth
    )


def gradient_allreduce_seconds(
    num_bytes: float,
    mesh: HybridMesh,
    hosts: int,
    cross_host_axis: str | None,
    hardware: Hardware,
) -> float:
    """The data-parallel sum of one device's `num_bytes` of gradients.

    Inside one host (or with the pipe axis across hosts) an all-reduce over the data
    replicas; with the data axis across, a data-only mesh's one ring over every replica
    (MultiWorkerMirroredStrategy), else a sum over each host's replicas then over hosts.
    """
    if hardware.devices_per_node is not None:
        return _node_ring_seconds(
            num_bytes, mesh.data, mesh.tensor * mesh.data > hardware.devices_per_node, hardware
        )
    if cross_host_axis != "data":
        return allreduce_seconds(num_bytes, mesh.data, hardware)
    if mesh.pipe == 1 and mesh.tensor == 1:
        return inter_host_ring_seconds(num_bytes, mesh.data, hardware)
    return allreduce_seconds(num_bytes, mesh.data // hosts, hardware) + inter_host_ring_seconds(
        num_bytes, hosts, hardware
    )


def pipe_transfer_seconds(num_bytes: float, mesh: HybridMesh, hardware: Hardware) -> float:
    """One send of `num_bytes` between consecutive pipeline devices on one host, or, on a
    cluster of nodes (`Hardware.devices_per_node`), over the link between them: between
    nodes once a replica's tensor x data devices fill a node.

    Example:
        >>> node = Hardware(bandwidth=1e9, inter_host_bandwidth=1e8, devices_per_node=8)
        >>> pipe_transfer_seconds(1e6, HybridMesh(data=1, pipe=2, tensor=8), node)
        0.0101
    """
    if hardware.devices_per_node is None:
        return num_bytes / hardware.bandwidth
    if mesh.tensor * mesh.data * mesh.pipe > hardware.devices_per_node:
        return hardware.inter_host_latency + num_bytes / hardware.inter_host_bandwidth
    return hardware.intra_node_latency + num_bytes / hardware.bandwidth


def _node_ring_seconds(
    num_bytes: float, group_size: int, across_nodes: bool, hardware: Hardware
) -> float:
    """A ring all-reduce over `group_size` devices of a cluster: 2(n-1) messages, each
    of the link's latency, moving 2(n-1)/n x bytes at the slowest link's bandwidth."""
    if group_size <= 1:
        return 0.0
    steps = 2 * (group_size - 1)
    bandwidth = hardware.inter_host_bandwidth if across_nodes else hardware.bandwidth
    latency = hardware.inter_host_latency if across_nodes else hardware.intra_node_latency
    return steps * latency + steps / group_size * num_bytes / bandwidth


def pipe_device_hosts(pipe: int, hosts: int, cross_host_axis: str | None) -> tuple[int, ...]:
    """The host of each pipeline device of a replica: consecutive pipe / hosts devices on
    each host when the pipe axis crosses, else all on one.

    Example:
        >>> pipe_device_hosts(4, 2, "pipe")
        (0, 0, 1, 1)
    """
    if cross_host_axis != "pipe":
        return (0,) * pipe
    per_host = pipe // hosts
    return tuple(device // per_host for device in range(pipe))


def makespan_across_hosts(
    plan: Schedule,
    costs: CostModel,
    device_hosts: Sequence[int],
    inter_host_transfer: float,
) -> float:
    """The simulated step of `plan` when a transfer between devices of different hosts takes
    `inter_host_transfer` seconds and one inside a host `costs.transfer_time`.

    `tfmulti.pipeline.simulate` has one transfer time for every link; this runs the same
    actions with two.
    """
    stage_devices = plan.stage_devices

    def transfer(producer: Action, consumer: Action) -> float:
        source, target = stage_devices[producer.stage], stage_devices[consumer.stage]
        if source == target:
            return 0.0
        if device_hosts[source] != device_hosts[target]:
            return inter_host_transfer
        return costs.transfer_time

    records, _ = run_in_order(
        plan,
        lambda action: costs.stages[action.stage].duration(action.kind),
        transfer,
        costs.pair_duration,
    )
    return max((record.end for record in records), default=0.0)
