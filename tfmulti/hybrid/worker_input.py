"""Each worker's share of every global batch, for hybrid runs across workers.

A hybrid run does not hand its input to a tf.distribute strategy, so every worker reads
the whole input in the same order (same seed) and keeps its own rows of each batch.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.pipeline.runtime.microbatches import batch_rows, even_sizes
from tfmulti.platform.runtime.cluster import ClusterInfo


def worker_rows(dataset: tf.data.Dataset, cluster: ClusterInfo) -> tf.data.Dataset:
    """Keeps this worker's contiguous share of the rows of each batch of `dataset`.

    Shares differ by at most one row, so any batch splits (a partial last one too); a
    `HybridPipelineModel` weights each worker's rows by their share of the whole batch.

    Args:
        dataset: batches of the GLOBAL batch size, identical on every worker.
        cluster: this worker's place in the cluster.

    Example:
        >>> train = worker_rows(dataset.batch(global_batch), cluster)
    """
    num_workers, rank = cluster.num_workers, cluster.task_index

    def take_rows(*batch):
        sizes = even_sizes(batch_rows(batch), num_workers)
        start = tf.reduce_sum(sizes[:rank])
        rows_kept = tf.nest.map_structure(lambda t: t[start : start + sizes[rank]], batch)
        return rows_kept if len(batch) > 1 else rows_kept[0]

    return dataset.map(take_rows)
