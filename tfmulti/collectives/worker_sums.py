"""Sums over workers with TensorFlow's collective runtime, one group per local device.

A hybrid run keeps each pipeline on one worker, so the gradient of stage s lives on the
same local device index on every worker; summing it needs only the workers, not the
other local devices. MultiWorkerMirroredStrategy's all-reduce always spans all of its
replicas, so these sums call the collective ops directly: one collective group per local
device, instance keys the caller chooses, the same on every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfmulti.collectives.key_ranges import WORKER_SUM_KEYS
from tfmulti.compat import tf_internals
from tfmulti.platform.runtime.cluster import COMMUNICATIONS

_DEVICE_TYPE_OFFSET = {"CPU": 0, "GPU": 1 << 16}


def _group_key(device: str) -> int:
    spec = tf.DeviceSpec.from_string(device)
    device_type = (spec.device_type or "CPU").upper()
    if device_type not in _DEVICE_TYPE_OFFSET:
        raise ValueError(
            f"Cross-worker sums run on CPU or GPU devices. Received: device={device!r}"
        )
    return WORKER_SUM_KEYS.start + _DEVICE_TYPE_OFFSET[device_type] + (spec.device_index or 0)


class WorkerCollectives:
    """Sums tensors over all workers, each on its own local device.

    Needs the collective runtime: build it first with
    `tfmulti.platform.runtime.cluster.build_multi_worker_strategy` (before any other
    TensorFlow work).

    Args:
        num_workers: workers in the cluster.
        task_index: this worker's rank; 0 is the chief.
        communication: "auto", "ring" or "nccl".
        timeout_seconds: a sum that waits longer fails instead of hanging; None waits.

    Example:
        >>> collectives = WorkerCollectives(num_workers=2, task_index=0)
        >>> total, = collectives.sum([gradient], ["/device:CPU:1"], keys=[1])  # in a tf.function
    """

    def __init__(
        self,
        num_workers: int,
        task_index: int,
        communication: str = "auto",
        timeout_seconds: float | None = None,
    ):
        if communication not in COMMUNICATIONS:
            raise ValueError(
                f"communication must be one of {COMMUNICATIONS}. Received: {communication!r}"
            )
        if num_workers < 1 or not 0 <= task_index < num_workers:
            raise ValueError(
                f"task_index must be in 0..{num_workers - 1}. Received: "
                f"num_workers={num_workers}, task_index={task_index}"
            )
        self.num_workers = num_workers
        self.task_index = task_index
        self.communication = communication
        self.timeout_seconds = timeout_seconds or 0

    @property
    def is_chief(self) -> bool:
        return self.task_index == 0

    def sum(
        self, tensors: Sequence[tf.Tensor], devices: Sequence[str], keys: Sequence[int]
    ) -> list[tf.Tensor]:
        """Each of `tensors` summed over the workers, computed on its device.

        Args:
            tensors: dense tensors.
            devices: where each sum runs; every worker passes the same local devices.
            keys: an instance key per tensor (>= 1), unique within this worker's sums on
                one device and the same on every worker.

        Sums on one device run in the given order (each waits for the previous), so no
        worker can start them in an order another worker cannot match.
        """
        if not len(tensors) == len(devices) == len(keys):
            raise ValueError(
                f"sum needs one device and one key per tensor. Received: {len(tensors)} "
                f"tensors, {len(devices)} devices, {len(keys)} keys"
            )
        previous = {}
        sums = []
        for tensor, device, key in zip(tensors, devices, keys, strict=True):
            group_key = _group_key(device)
            with tf.device(device), tf.control_dependencies(previous.get(group_key, [])):
                total = tf_internals.all_reduce_v2(
                    tf.identity(tensor),
                    group_size=self.num_workers,
                    group_key=group_key,
                    instance_key=key,
                    communication_hint=self.communication,
                    timeout=self.timeout_seconds,
                )
            previous[group_key] = [total]
            sums.append(total)
        return sums

    def broadcast_from_chief(
        self, tensors: Sequence[tf.Tensor], devices: Sequence[str], keys: Sequence[int]
    ) -> list[tf.Tensor]:
        """The chief's value of each of `tensors`, on every worker (a sum of the chief's
        value and zeros elsewhere); arguments as for `sum`."""
        contributions = [t if self.is_chief else tf.zeros_like(t) for t in tensors]
        return self.sum(contributions, devices, keys)
