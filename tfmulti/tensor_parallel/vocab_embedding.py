"""A token embedding whose vocabulary rows are split over devices."""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import ops

from tfmulti.collectives.placed_steps import fan_out, reduce_partial_sums
from tfmulti.tensor_parallel.shard_devices import check_divisible
from tfmulti.tensor_parallel.sharded_layer import TensorParallelLayer
from tfmulti.tensor_parallel.transfer_bytes import fan_out_bytes, reduction_bytes


def lookup_in_row_shard(table_shard, ids, first_row: int, dtype):
    """Rows of `ids` from a shard holding rows [first_row, first_row + len(shard)); zeros elsewhere.

    Summing this over all shards of a table gives the whole table's lookup: each id's row
    comes from exactly one shard.
    """
    rows_in_shard = table_shard.shape[0]
    local_ids = ids - first_row
    in_shard = ops.logical_and(local_ids >= 0, local_ids < rows_in_shard)
    rows = ops.cast(ops.take(table_shard, ops.where(in_shard, local_ids, 0), axis=0), dtype)
    return rows * ops.cast(in_shard, rows.dtype)[..., None]


@keras.saving.register_keras_serializable(package="tfmulti")
class VocabParallelEmbedding(TensorParallelLayer):
    """An embedding whose rows are split over devices: device k holds ids [k V/K, (k+1) V/K).

    Every device looks up all ids, gives zeros for the ids outside its range, and the K
    partial embeddings are summed on the home device: each id's row comes from exactly
    one device.

    Args:
        input_dim: vocabulary size V; must be divisible by K.
        output_dim: embedding width.
        devices: one device per shard (K = len(devices)).
        embeddings_initializer: as for keras.layers.Embedding.

    Example:
        >>> embedding = VocabParallelEmbedding(16, 4, ["/CPU:0", "/CPU:1"])
        >>> embedding(keras.ops.zeros((2, 5), "int32")).shape
        TensorShape([2, 5, 4])
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        devices: Sequence[str],
        embeddings_initializer="uniform",
        **kwargs,
    ):
        super().__init__(devices, **kwargs)
        check_divisible("input_dim (vocabulary size)", input_dim, self.num_shards)
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape=None):
        self.embedding_shards = self.add_sharded_weight(
            "embeddings", (self.input_dim, self.output_dim), 0, self.embeddings_initializer
        )

    def _shard_lookup(self, index, ids):
        rows_per_shard = self.input_dim // self.num_shards
        return lookup_in_row_shard(
            self.embedding_shards[index], ids, index * rows_per_shard, self.compute_dtype
        )

    def call(self, inputs):
        ids = ops.cast(inputs, "int32")
        partials = self.on_each_shard(self._shard_lookup, fan_out(ids, self.devices))
        return reduce_partial_sums(partials, self.devices)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def communication_bytes(self, input_shape):
        """Forward: the int32 ids out to K-1 devices and the partial embeddings all-reduced
        home. Backward: the output gradient back out (ids have no gradient)."""
        output_shape = (*input_shape, self.output_dim)
        return fan_out_bytes(input_shape, "int32", self.num_shards) + reduction_bytes(
            output_shape, self.compute_dtype, self.num_shards
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            input_dim=self.input_dim,
            output_dim=self.output_dim,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config
