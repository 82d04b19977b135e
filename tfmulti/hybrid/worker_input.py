"""Each worker's share of every global batch, for hybrid runs across workers.

A hybrid run does not hand its input to a tf.distribute strategy, so every worker reads
the whole input in the same order (same seed) and keeps its own rows of each batch.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.cluster import ClusterInfo


def worker_rows(dataset: tf.data.Dataset, cluster: ClusterInfo) -> tf.data.Dataset:
    """Keeps this worker's contiguous 1/num_workers of the rows of each batch of `dataset`.

    Args:
        dataset: batches of the GLOBAL batch size, identical on every worker; the batch
            must divide by the number of workers (batch with `drop_remainder=True`).
        cluster: this worker's place in the cluster.

    Example:
        >>> train = worker_rows(dataset.batch(global_batch, drop_remainder=True), cluster)
    """
    num_workers, rank = cluster.num_workers, cluster.task_index

    def take_rows(*batch):
        rows = tf.shape(tf.nest.flatten(batch)[0])[0]
        tf.debugging.assert_equal(
            rows % num_workers,
            0,
            message=f"Each global batch must split into {num_workers} equal worker shares",
        )
        share = rows // num_workers
        rows_kept = tf.nest.map_structure(lambda t: t[rank * share : (rank + 1) * share], batch)
        return rows_kept if len(batch) > 1 else rows_kept[0]

    return dataset.map(take_rows)
