"""A factory for `tf.distribute` strategies, in the spirit of Model Garden's.

Users call `get_strategy(...)`, then build and compile their Keras model inside
`strategy.scope()` and call `fit` as usual.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.names import ALL_REDUCE_NAMES, STRATEGY_NAMES
from tfmulti.platform.runtime.devices import accelerator_type, logical_device_names


def cross_device_ops(all_reduce: str, device_type: str) -> tf.distribute.CrossDeviceOps:
    """Returns the cross-device all-reduce for `all_reduce` on `device_type` devices.

    "auto" picks NCCL on GPUs and reduce-to-one-device elsewhere (NCCL and
    hierarchical copy need GPUs).
    """
    if all_reduce not in ALL_REDUCE_NAMES:
        raise ValueError(
            f"all_reduce must be one of {ALL_REDUCE_NAMES}. Received: all_reduce={all_reduce!r}"
        )
    if all_reduce == "auto":
        all_reduce = "nccl" if device_type == "GPU" else "reduce_to_one_device"
    if all_reduce in ("nccl", "hierarchical_copy") and device_type != "GPU":
        raise ValueError(
            f"all_reduce={all_reduce!r} needs GPUs; on {device_type} devices use "
            "'reduce_to_one_device' or 'auto'."
        )
    if all_reduce == "nccl":
        return tf.distribute.NcclAllReduce()
    if all_reduce == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


def get_strategy(
    name: str,
    num_devices: int | None = None,
    all_reduce: str = "auto",
    **multi_worker_options,
) -> tf.distribute.Strategy:
    """Builds a `tf.distribute.Strategy` by name.

    Args:
        name: "one_device", "mirrored" or "multi_worker".
        num_devices: how many of the local accelerator (or logical CPU) devices
            to use; `None` means all of them ("one_device" always uses one).
        all_reduce: cross-device all-reduce for "mirrored": "auto", "nccl",
            "hierarchical_copy" or "reduce_to_one_device".
        **multi_worker_options: for "multi_worker": `worker_hosts` and `task_index`
            (else TF_CONFIG or SLURM decide, see
            `tfmulti.platform.runtime.cluster.resolve_cluster`),
            and `communication`, `timeout_seconds`, `connect_timeout_seconds` for
            `tfmulti.platform.runtime.cluster.build_multi_worker_strategy`.

    Returns:
        A strategy whose `scope()` the model is built and compiled in.

    Example:
        >>> strategy = get_strategy("mirrored", num_devices=4)
        >>> with strategy.scope():
        ...     model = build_model(); model.compile(...)
        >>> model.fit(dataset)
    """
    if name not in STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {STRATEGY_NAMES}. Received: strategy={name!r}")
    if name == "multi_worker":
        from tfmulti.platform.runtime.cluster import build_multi_worker_strategy, resolve_cluster

        cluster = resolve_cluster(
            multi_worker_options.pop("worker_hosts", None),
            multi_worker_options.pop("task_index", None),
        )
        return build_multi_worker_strategy(cluster, **multi_worker_options)

    device_type = accelerator_type()
    devices = logical_device_names(device_type)
    wanted = 1 if name == "one_device" else (num_devices or len(devices))
    if wanted > len(devices):
        raise ValueError(
            f"Asked for {wanted} devices but only {len(devices)} {device_type} device(s) "
            "exist. Lower num_devices or make more logical devices (--virtual_devices). "
            f"Received: num_devices={num_devices}"
        )
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(devices[0])
    return tf.distribute.MirroredStrategy(
        devices=devices[:wanted], cross_device_ops=cross_device_ops(all_reduce, device_type)
    )


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Returns the batch each replica sees; the global batch must split evenly."""
    if global_batch_size < 1 or global_batch_size % num_replicas:
        raise ValueError(
            f"The global batch size must be a positive multiple of the {num_replicas} "
            f"replicas. Received: batch_size={global_batch_size}; try "
            f"{max(1, global_batch_size // num_replicas) * num_replicas}."
        )
    return global_batch_size // num_replicas
