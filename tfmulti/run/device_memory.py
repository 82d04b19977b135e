"""`metrics.json`'s `memory` section: the bytes of state each device of the job holds.

For every device the run trains on (every worker's, named as the chief sees them), the
bytes of model weights and of optimizer state stored there, read off where each variable
lives (a mirrored variable counts on each of its devices), and the allocator's peak where
it means one device: TensorFlow reports a CPU's peak only under its BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true`, tfmulti's default), and logical CPU devices share one
allocator, so a peak is given only for a process with one device of its type; null
otherwise. Serving workers post their peaks for the chief (`WorkerNotices.post_memory`).

Example:
    >>> memory_section(model)["/job:localhost/replica:0/task:0/device:CPU:1"]
    {'weights': 4544, 'optimizer': 9088, 'peak': None}
"""

from __future__ import annotations

from collections.abc import Iterable

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat.keras_internals import variable_storage
from tfmulti.platform.runtime.allocator_peaks import local_peaks
from tfmulti.platform.runtime.devices import full_device_name


def storage_variables(variables: Iterable) -> list[tf.Variable]:
    """The `tf.Variable`s holding `variables` (Keras or TensorFlow, mirrored ones split
    into their per-device components); a released Keras variable holds none."""
    held = []
    for variable in variables:
        storage = variable_storage(variable) if isinstance(variable, keras.Variable) else variable
        if storage is None:
            continue
        held.extend(getattr(storage, "values", (storage,)))
    return held


def bytes_by_device(variables: Iterable) -> dict[str, int]:
    """Bytes of `variables`' storage on each device, by canonical device name."""
    held: dict[str, int] = {}
    for storage in storage_variables(variables):
        name = full_device_name(storage.device)
        size = int(np.prod(storage.shape, dtype=np.int64)) * storage.dtype.size
        held[name] = held.get(name, 0) + size
    return held


def memory_section(
    model: keras.Model, devices: Iterable[str], peaks: dict[str, int | None] | None = None
) -> dict[str, dict]:
    """Weights, optimizer state and peak bytes on each of `devices` (and any other device
    holding the model's state).

    Args:
        model: the trained model; a model that stores weights itself (ZeRO's blocks and
            copies) names them with `weight_storage()`.
        devices: the devices the run trains on.
        peaks: allocator peaks by device (`local_peaks`, and the workers' posted ones).
    """
    weight_store = getattr(model, "weight_storage", None)
    weights = bytes_by_device(weight_store() if weight_store else model.variables)
    optimizer = model.optimizer
    optimizer_bytes = bytes_by_device(optimizer.variables if optimizer is not None else [])
    names = [full_device_name(d) for d in devices]
    names += sorted((set(weights) | set(optimizer_bytes)) - set(names))
    peaks = peaks or {}
    return {
        name: {
            "weights": weights.get(name, 0),
            "optimizer": optimizer_bytes.get(name, 0),
            "peak": peaks.get(name),
        }
        for name in names
    }


def job_memory(
    model: keras.Model,
    cluster=None,
    strategy: tf.distribute.Strategy | None = None,
    chief_drives: bool = False,
) -> dict[str, dict]:
    """`memory_section` of the whole job, as the chief records it.

    Args:
        model: the trained model.
        cluster: the run's `ClusterInfo`, None on one host.
        strategy: the run's strategy; under MultiWorkerMirroredStrategy every worker calls
            this, and the workers' figures are all-gathered (a collective).
        chief_drives: the chief drives the other workers' devices (their state is its
            variables); their peaks come from what they posted.
    """
    task = cluster.task() if cluster is not None else None
    peaks = local_peaks(task)
    if cluster is None:
        return memory_section(model, list(peaks), peaks)
    if chief_drives:
        from tfmulti.platform.runtime.connected_cluster import posted_worker_peaks

        peaks.update(posted_worker_peaks())
        return memory_section(model, list(peaks), peaks)
    own = memory_section(model, list(peaks), peaks)
    own = {name: held for name, held in own.items() if name in peaks}
    return _gathered_over_workers(own, strategy)


def _gathered_over_workers(own: dict[str, dict], strategy) -> dict[str, dict]:
    """Every worker's `own` section on every worker, all-gathered by `strategy`, one row
    per replica in replica order (worker by worker, device by device)."""
    names = list(own)
    rows = [
        [held["weights"], held["optimizer"], -1 if held["peak"] is None else held["peak"]]
        for held in own.values()
    ]
    local = tf.constant(rows, dtype=tf.int64)
    value = strategy.experimental_distribute_values_from_function(
        lambda context: local[context.replica_id_in_sync_group % len(names) :][:1]
    )
    gathered = strategy.gather(value, axis=0).numpy()
    section = {}
    for replica, (weights, optimizer, peak) in enumerate(gathered):
        task, index = divmod(replica, len(names))
        device = tf.DeviceSpec.from_string(names[index]).replace(task=task).to_string()
        section[device] = {
            "weights": int(weights),
            "optimizer": int(optimizer),
            "peak": int(peak) if peak >= 0 else None,
        }
    return section
