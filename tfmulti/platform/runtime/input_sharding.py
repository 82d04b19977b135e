"""How a tf.data input is split across workers under MultiWorkerMirroredStrategy.

Batch semantics: batch the dataset with the GLOBAL batch size (examples per
step over all replicas of all workers). `fit` distributes it: each global batch
is split into per-replica batches of global_batch / num_replicas_in_sync, and
each worker feeds its own replicas. With "data" sharding every worker reads the
whole input and keeps its share of each global batch (the order must then be
deterministic: same seed on every worker). With "file" sharding each worker
reads only its files, so there must be at least as many files as workers.
"""

from __future__ import annotations

SHARD_POLICIES = ("auto", "file", "data", "off")


class ShardingError(ValueError):
    """Raised when an input cannot be sharded as asked."""


def apply_shard_policy(dataset, policy: str):
    """Returns `dataset` with its auto-shard policy set to `policy`.

    Args:
        dataset: a `tf.data.Dataset`, batched with the global batch size.
        policy: "auto" (by file, else by data), "file", "data" or "off" (every
            worker reads everything: only for inputs already split per worker).

    Example:
        >>> dataset = apply_shard_policy(dataset.batch(global_batch_size), "data")
    """
    if policy not in SHARD_POLICIES:
        raise ShardingError(f"shard policy must be one of {SHARD_POLICIES}. Received: {policy!r}")
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy.upper()
    )
    return dataset.with_options(options)


def check_file_sharding(num_files: int, num_workers: int) -> None:
    """Raises when FILE sharding would leave a worker without input files.

    Args:
        num_files: how many input files the dataset reads.
        num_workers: workers in the cluster.

    Example:
        >>> check_file_sharding(num_files=8, num_workers=2)
    """
    if num_files < num_workers:
        raise ShardingError(
            f"file sharding needs at least one input file per worker. Received: "
            f"num_files={num_files}, num_workers={num_workers}. Use shard policy 'data', "
            f"or split the input into >= {num_workers} files."
        )
