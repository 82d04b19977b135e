"""A weight shard split again over a mesh's rows (FSDP-style), gathered where it is used."""

from __future__ import annotations

import dataclasses

import keras

from tfmulti.tensor_parallel.sharded_layer import ShardedWeight


@dataclasses.dataclass(eq=False, repr=False)
class RowSplitShard(ShardedWeight):
    """One shard of a weight, split again along `axis` over a mesh's rows: piece r on row r.

    `read()` inside a computation gathers the whole shard where that computation runs;
    the gradient flows back to each piece (summed over the rows that read it).
    """

    @property
    def value(self):
        return self.read()

    def read(self):
        """The whole shard, joined under the current device scope."""
        return keras.ops.concatenate([piece.value for piece in self.shards], self.axis)


def shard_value(shard):
    """What a computation reads of a shard: the variable, or a row-split shard gathered."""
    return shard.read() if isinstance(shard, RowSplitShard) else shard


def shard_variables(shard) -> list:
    """The variables holding a shard."""
    return list(shard.shards) if isinstance(shard, RowSplitShard) else [shard]
