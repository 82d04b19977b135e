"""Device meshes: how many ways a run splits the batch (data), the layers (pipe) and each
layer (tensor), and which device holds which part. Pure Python, no TensorFlow.

Devices are numbered per host. Data replicas span hosts (each worker holds
`data / num_workers` of them); a replica's pipeline stages and tensor shards are on its
own host, so on one host replica r, stage s, tensor shard t is local device
`(r * pipe + s) * tensor + t`.
"""

from __future__ import annotations

import dataclasses

MESH_AXES = ("data", "pipe", "tensor")


class MeshError(ValueError):
    """Raised when a mesh description is malformed or does not fit the devices."""


@dataclasses.dataclass(frozen=True)
class HybridMesh:
    """A data x pipe x tensor grid of devices of `--strategy=hybrid` (`--mesh`).

    Not `keras.distribution.DeviceMesh`, which names devices along named axes.

    Args:
        data: data-parallel replicas, over all workers.
        pipe: pipeline stages (devices) of each replica.
        tensor: devices each layer is split over.

    Example:
        >>> mesh = parse_mesh("data=2,pipe=2")
        >>> mesh.num_devices, mesh.local_device_index(replica=1, stage=0)
        (4, 2)
    """

    data: int = 1
    pipe: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"Mesh axis {axis!r} needs an integer >= 1. Received: {size!r}")

    def __str__(self) -> str:
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)

    @property
    def num_devices(self) -> int:
        """Devices the whole mesh needs, over all workers."""
        return self.data * self.pipe * self.tensor

    @property
    def devices_per_replica(self) -> int:
        """Devices holding one copy of the model: pipe x tensor."""
        return self.pipe * self.tensor

    def local_replicas(self, num_workers: int = 1) -> int:
        """Data replicas on each worker."""
        return self.data // num_workers

    def check_fits(self, devices_per_worker: int, num_workers: int = 1) -> None:
        """Raises MeshError unless the mesh uses exactly the devices of `num_workers` workers
        of `devices_per_worker` devices each, with every replica inside one worker.

        Example:
            >>> parse_mesh("data=2,pipe=2").check_fits(devices_per_worker=2, num_workers=2)
        """
        total = devices_per_worker * num_workers
        if self.num_devices != total:
            raise MeshError(
                f"Mesh {self} needs data x pipe x tensor = {self.num_devices} devices, but "
                f"{num_workers} worker(s) x {devices_per_worker} device(s) = {total}. "
                f"Received: mesh={self}; make the product {total}, or change the devices "
                "(--virtual_devices, --devices_per_worker)."
            )
        if self.data % num_workers:
            raise MeshError(
                f"Mesh {self}: the data axis spans the workers, so data must be a multiple "
                f"of the {num_workers} workers; each worker runs whole replicas of "
                f"pipe x tensor = {self.devices_per_replica} devices. Received: data={self.data}"
            )

    def local_device_index(self, replica: int, stage: int, tensor_rank: int = 0) -> int:
        """This worker's device index of local `replica`'s `stage`, shard `tensor_rank`."""
        for name, value, size in (
            ("stage", stage, self.pipe),
            ("tensor_rank", tensor_rank, self.tensor),
        ):
            if not 0 <= value < size:
                raise MeshError(f"{name} must be in 0..{size - 1}. Received: {name}={value}")
        return (replica * self.pipe + stage) * self.tensor + tensor_rank

    def replica_devices(self, local_devices: list[str], num_workers: int = 1) -> list[list[str]]:
        """Splits this worker's devices into its replicas' stage devices (tensor = 1).

        Args:
            local_devices: this worker's device names, in index order.
            num_workers: workers in the cluster.

        Returns:
            One list per local replica: the device of each pipeline stage.

        Raises:
            MeshError: the devices do not fit the mesh, or tensor > 1 (a stage then has
                several devices: use `local_device_index`).
        """
        if self.tensor != 1:
            raise MeshError(
                f"replica_devices gives one device per stage, so it needs tensor=1. "
                f"Received: mesh={self}; use stage_device_groups for tensor shards."
            )
        groups = self.stage_device_groups(local_devices, num_workers)
        return [[group[0] for group in replica] for replica in groups]

    def stage_device_groups(
        self, local_devices: list[str], num_workers: int = 1
    ) -> list[list[list[str]]]:
        """Splits this worker's devices into, per local replica and pipeline stage, the
        `tensor` devices that stage's layers are split over.

        Example:
            >>> parse_mesh("data=1,pipe=2,tensor=2").stage_device_groups(["a", "b", "c", "d"])
            [[['a', 'b'], ['c', 'd']]]
        """
        self.check_fits(len(local_devices), num_workers)
        return [
            [
                [
                    local_devices[self.local_device_index(replica, stage, rank)]
                    for rank in range(self.tensor)
                ]
                for stage in range(self.pipe)
            ]
            for replica in range(self.local_replicas(num_workers))
        ]


def parse_mesh(text: str) -> HybridMesh:
    """Reads a mesh like "data=2,pipe=2" or "data=4,pipe=2,tensor=1"; absent axes are 1.

    Raises:
        MeshError: an unknown or repeated axis, or a size that is not an integer >= 1.

    Example:
        >>> parse_mesh("pipe=4")
        HybridMesh(data=1, pipe=4, tensor=1)
    """
    sizes = {}
    for part in str(text).split(","):
        axis, equals, value = part.strip().partition("=")
        axis = axis.strip()
        if not equals or axis not in MESH_AXES or axis in sizes:
            if not equals:
                problem = f"has {part.strip()!r}, not AXIS=SIZE"
            elif axis in sizes:
                problem = f"names axis {axis!r} twice"
            else:
                problem = f"has unknown axis {axis!r}"
            raise MeshError(
                f"Mesh {text!r} {problem}. Write AXIS=SIZE pairs joined by commas, each "
                f"axis of {MESH_AXES} at most once, e.g. 'data=2,pipe=2'."
            )
        try:
            sizes[axis] = int(value)
        except ValueError:
            sizes[axis] = value.strip()
    return HybridMesh(**sizes)


def resolve_data_axis(text: str, num_devices: int | None) -> str:
    """`text` with `data=auto` replaced by the data replicas that fill `num_devices`
    devices (`num_devices // (pipe x tensor)`); other meshes are returned as they are. An
    elastic job's hybrid mesh says `data=auto`, so it follows the workers it has.

    Args:
        text: a mesh, e.g. "data=auto,pipe=2".
        num_devices: every device the run has; None reads `data=auto` as 1, to check the
            rest of the mesh before the devices are known.

    Raises:
        MeshError: `num_devices` is not a multiple of pipe x tensor.

    Example:
        >>> resolve_data_axis("data=auto,pipe=2", 8)
        'data=4,pipe=2'
    """
    parts = [part.strip() for part in str(text).split(",")]
    if "data=auto" not in parts:
        return text
    rest = ",".join(part for part in parts if part != "data=auto") or "data=1"
    per_replica = parse_mesh(rest).devices_per_replica
    if num_devices is None:
        data = 1
    elif num_devices % per_replica or num_devices < per_replica:
        raise MeshError(
            f"Mesh {text!r} fills the devices with replicas of pipe x tensor = {per_replica} "
            f"devices, but the run has {num_devices}; make pipe x tensor divide the device "
            "count, or give data a number."
        )
    else:
        data = num_devices // per_replica
    return ",".join(f"data={data}" if part == "data=auto" else part for part in parts)
