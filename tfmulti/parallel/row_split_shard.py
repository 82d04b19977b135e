"""A weight shard split again over a mesh's rows (FSDP-style), gathered where it is used."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np


@dataclasses.dataclass
class RowSplitShard:
    """One shard of a weight, split again along `axis` over a mesh's rows: piece r on row r.

    `read()` inside a computation gathers the whole shard where that computation runs;
    the gradient flows back to each piece (summed over the rows that read it).
    """

    pieces: list
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.pieces[0].shape)
        shape[self.axis] *= len(self.pieces)
        return tuple(shape)

    @property
    def dtype(self):
        return self.pieces[0].dtype

    @property
    def value(self):
        return self.read()

    def read(self):
        """The whole shard, joined under the current device scope."""
        return keras.ops.concatenate([piece.value for piece in self.pieces], self.axis)

    def numpy(self) -> np.ndarray:
        return np.concatenate(
            [keras.ops.convert_to_numpy(piece) for piece in self.pieces], self.axis
        )

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def assign(self, value) -> None:
        pieces = np.split(np.asarray(value), len(self.pieces), self.axis)
        for piece, piece_value in zip(self.pieces, pieces, strict=True):
            piece.assign(piece_value)


def shard_value(shard):
    """What a computation reads of a shard: the variable, or a row-split shard gathered."""
    return shard.read() if isinstance(shard, RowSplitShard) else shard


def shard_variables(shard) -> list:
    """The variables holding a shard."""
    return list(shard.pieces) if isinstance(shard, RowSplitShard) else [shard]
