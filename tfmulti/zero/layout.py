"""How ZeRO cuts one weight into equal row blocks, one per data-parallel device.

Pure Python and NumPy: no TensorFlow. A weight of shape (rows, ...) is padded with zero
rows up to a multiple of the devices, so every shard has the same shape (a scalar counts
as one row). Padding rows hold zeros, receive zero gradients, and stay zero under every
elementwise optimizer (Adam, AdamW, SGD with momentum, RMSprop, an EMA of weights).

Example:
    >>> layout = ShardLayout((10, 3), 4)
    >>> layout.rows_per_shard, layout.padding_rows
    (3, 2)
    >>> [piece.shape for piece in layout.split(np.ones((10, 3)))]
    [(3, 3), (3, 3), (3, 3), (3, 3)]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The row blocks of one weight of `shape` over `num_shards` devices.

    Args:
        shape: the whole weight's shape.
        num_shards: how many devices hold a block each.
    """

    shape: tuple[int, ...]
    num_shards: int

    def __post_init__(self):
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be at least 1. Received: {self.num_shards}")

    @property
    def rows(self) -> int:
        """Rows of the whole weight (1 for a scalar)."""
        return int(self.shape[0]) if self.shape else 1

    @property
    def row_size(self) -> int:
        """Scalars in one row."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) if self.shape else 1

    @property
    def rows_per_shard(self) -> int:
        return math.ceil(self.rows / self.num_shards)

    @property
    def padding_rows(self) -> int:
        """Zero rows added so the rows divide by the devices."""
        return self.rows_per_shard * self.num_shards - self.rows

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows_per_shard, *self.shape[1:]) if self.shape else (self.rows_per_shard,)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.rows_per_shard * self.num_shards, *self.shard_shape[1:])

    @property
    def size(self) -> int:
        """Scalars in the whole weight."""
        return self.rows * self.row_size

    @property
    def shard_size(self) -> int:
        """Scalars in one shard, padding included."""
        return self.rows_per_shard * self.row_size

    def split(self, value: np.ndarray) -> list[np.ndarray]:
        """The whole `value` as `num_shards` equal blocks of rows, zero-padded at the end."""
        value = np.asarray(value).reshape(self.shape or (1,))
        padding = [(0, self.padding_rows)] + [(0, 0)] * (value.ndim - 1)
        return np.split(np.pad(value, padding), self.num_shards)

    def join(self, pieces: list[np.ndarray]) -> np.ndarray:
        """The whole value from its blocks, padding dropped: the inverse of `split`."""
        if len(pieces) != self.num_shards:
            raise ValueError(
                f"A weight of shape {self.shape} has {self.num_shards} shards. "
                f"Received: {len(pieces)} pieces"
            )
        return np.concatenate([np.asarray(p) for p in pieces])[: self.rows].reshape(self.shape)


def padded_weights(layouts: dict[str, ShardLayout]) -> dict[str, int]:
    """Each padded weight's name and its padding rows, for the run's record and logs."""
    return {name: layout.padding_rows for name, layout in layouts.items() if layout.padding_rows}
