"""A model's trainable weights as ZeRO keeps them: row blocks owned by the data-parallel devices.

Device j owns block j of every weight (`owned[k][j]`), which only the optimizer updates.
Under stages 1 and 2 every device also keeps a copy of the blocks it does not own, so it
holds whole weights; the copies take the owners' new values after each update (the
all-gather). Under stage 3 a device holds its own blocks only and gathers whole weights
into the step that uses them.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat.keras_internals import variable_storage
from tfmulti.zero.layout import ShardLayout


class ShardedWeights:
    """The trainable weights of a model as blocks over `devices`, and the step's reads of them.

    Args:
        variables: the model's trainable Keras variables, in their order.
        devices: the data-parallel devices; device j owns block j of each weight.
        keep_whole_copies: True under stages 1 and 2 (each device holds whole weights).
    """

    def __init__(self, variables: list, devices: tuple[str, ...], keep_whole_copies: bool):
        self.variables = list(variables)
        self.devices = tuple(devices)
        self.keep_whole_copies = keep_whole_copies
        self.layouts = [ShardLayout(tuple(v.shape), len(devices)) for v in self.variables]
        self._index = {id(variable): k for k, variable in enumerate(self.variables)}
        self.owned: list[list[keras.Variable]] = []
        # copies[i][k][j]: device i's copy of block j of weight k (None where i owns it).
        self.copies: list[list[list[tf.Variable | None]]] = []
        with tf.init_scope():
            for variable, layout in zip(self.variables, self.layouts, strict=True):
                pieces = layout.split(keras.ops.convert_to_numpy(variable.value))
                self.owned.append(
                    [
                        _new_block(variable, piece, f"{variable.name}_zero_block_{j}", device)
                        for j, (device, piece) in enumerate(zip(self.devices, pieces, strict=True))
                    ]
                )
            if keep_whole_copies:
                self.copies = [
                    [
                        [
                            None if i == j else _copy_of(block, device)
                            for j, block in enumerate(blocks)
                        ]
                        for blocks in self.owned
                    ]
                    for i, device in enumerate(self.devices)
                ]

    @property
    def owned_variables(self) -> list[keras.Variable]:
        """Every block, weight by weight, device by device: what the optimizer updates."""
        return [block for blocks in self.owned for block in blocks]

    def index_of(self, variable) -> int | None:
        """Which weight `variable` is (its place in `variables`), None if not sharded here."""
        return self._index.get(id(variable))

    def block_reads(self, weight: int) -> list[tf.Tensor]:
        """Weight `weight`'s blocks, each read on its owner (a tape records the reads)."""
        return [self._read(block, owner) for owner, block in enumerate(self.owned[weight])]

    def join(self, weight: int, blocks: list[tf.Tensor]) -> tf.Tensor:
        """Weight `weight` whole from its blocks, made under the caller's device scope."""
        layout = self.layouts[weight]
        joined = tf.concat(blocks, axis=0)
        return tf.reshape(joined[: layout.rows], layout.shape)

    def split(self, weight: int, whole: tf.Tensor) -> list[tf.Tensor]:
        """A whole-weight tensor (a gradient) cut into its padded blocks, on the caller's device."""
        return tf.split(_padded(whole, self.layouts[weight]), len(self.devices))

    def reduce_blocks(
        self, gradients: list[list[tf.Tensor | None]], weights: list[tf.Tensor]
    ) -> list[tf.Tensor]:
        """Each block's gradient summed over replicas on its owner (a reduce-scatter of
        gradients already cut into blocks on each replica's device).

        Args:
            gradients: gradients[i][b], replica i's gradient of `owned_variables[b]`, on
                device i (None where the replica's step did not use that weight).
            weights: weights[i], replica i's share of the batch.
        """
        reduced = []
        for index, block in enumerate(self.owned_variables):
            owner = index % len(self.devices)
            pieces = []
            for replica, device in enumerate(self.devices):
                gradient = gradients[replica][index]
                if gradient is None:
                    continue
                with tf.device(device):
                    pieces.append(_weighted(tf.convert_to_tensor(gradient), weights[replica]))
            with tf.device(self.devices[owner]):
                reduced.append(tf.add_n(pieces) if pieces else tf.zeros(block.shape, block.dtype))
        return reduced

    def whole_values(self, replica: int) -> list[tf.Tensor]:
        """Every weight whole on device `replica` from the blocks it holds (stages 1-2: its
        own block and its copies of the others, so no traffic); call inside its device scope.
        """
        values = []
        for k, blocks in enumerate(self.owned):
            held = self.copies[replica][k]
            reads = [
                self._read(block if copy is None else copy, j)
                for j, (block, copy) in enumerate(zip(blocks, held, strict=True))
            ]
            values.append(self.join(k, reads))
        return values

    def _read(self, variable, owner: int) -> tf.Tensor:
        """`variable`'s value read where it lives: device `owner` for a block, the
        holding device for a copy; the caller's device receives it."""
        if isinstance(variable, keras.Variable):
            device = self.devices[owner]
            # Its storage, not `value`: a mixed-precision caller's autocast would read only
            # this replica's own block in the compute dtype.
            storage = variable_storage(variable)
            variable = variable if storage is None else storage
        else:
            device = variable.device
        with tf.device(device):
            return tf.convert_to_tensor(variable)

    def reduce_scatter(
        self, gradients: list[list[tf.Tensor]], weights: list[tf.Tensor]
    ) -> list[tf.Tensor]:
        """Each block's gradient summed over replicas, on its owner: a reduce-scatter.

        Args:
            gradients: gradients[i][k], replica i's gradient of weight k (whole), on device i.
            weights: weights[i], replica i's share of the batch (its rows over all rows).

        Returns:
            The gradients of `owned_variables`, in their order.
        """
        pieces = []  # pieces[i][k][j]: replica i's part of block j of weight k, on device i
        for i, device in enumerate(self.devices):
            with tf.device(device):
                pieces.append(
                    [
                        tf.split(
                            _weighted(_padded(gradient, layout), weights[i]), len(self.devices)
                        )
                        for gradient, layout in zip(gradients[i], self.layouts, strict=True)
                    ]
                )
        reduced = []
        for k in range(len(self.variables)):
            for j, device in enumerate(self.devices):
                with tf.device(device):
                    reduced.append(tf.add_n([pieces[i][k][j] for i in range(len(self.devices))]))
        return reduced

    def all_gather_updates(self) -> list:
        """Copies each owner's new block to the other devices (stages 1-2): the all-gather."""
        updates = []
        for i, device in enumerate(self.devices):
            with tf.device(device):
                for held, blocks in zip(self.copies[i], self.owned, strict=True):
                    for owner, (copy, block) in enumerate(zip(held, blocks, strict=True)):
                        if copy is not None:
                            updates.append(copy.assign(self._read(block, owner)))
        return updates

    def whole_numpy(self) -> list[np.ndarray]:
        """Every weight whole, as NumPy arrays (from the owned blocks)."""
        return [
            layout.join([keras.ops.convert_to_numpy(block.value) for block in blocks])
            for layout, blocks in zip(self.layouts, self.owned, strict=True)
        ]

    def assign_whole(self, values: list[np.ndarray]) -> None:
        """Splits whole weights into the blocks (and every device's copies)."""
        for k, (layout, value) in enumerate(zip(self.layouts, values, strict=True)):
            pieces = layout.split(value)
            for j, piece in enumerate(pieces):
                self.owned[k][j].assign(piece)
                for held in self.copies:
                    if held[k][j] is not None:
                        held[k][j].assign(piece)

    def storage(self) -> list:
        """Every variable holding weight blocks or copies of them."""
        copies = [copy for held in self.copies for row in held for copy in row if copy is not None]
        return [*self.owned_variables, *copies]


def _new_block(variable, piece: np.ndarray, name: str, device: str) -> keras.Variable:
    with tf.device(device):
        return keras.Variable(
            piece.astype(variable.dtype), dtype=variable.dtype, trainable=True, name=name
        )


def _copy_of(block: keras.Variable, device: str) -> tf.Variable:
    with tf.device(device):
        return tf.Variable(tf.identity(block.value), trainable=False, name=f"{block.name}_copy")


def _padded(gradient: tf.Tensor, layout: ShardLayout) -> tf.Tensor:
    gradient = tf.reshape(tf.convert_to_tensor(gradient), (layout.rows, *layout.shard_shape[1:]))
    if not layout.padding_rows:
        return gradient
    return tf.pad(gradient, [[0, layout.padding_rows]] + [[0, 0]] * (len(layout.shard_shape) - 1))


def _weighted(gradient: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    # A replica with no rows has a NaN mean loss; its gradient, weighted 0, counts as zero.
    return tf.math.multiply_no_nan(gradient, tf.cast(weight, gradient.dtype))
