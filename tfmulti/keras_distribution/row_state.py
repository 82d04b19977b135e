"""The Keras state a model's call changes, combined over the mesh rows as one call would.

When a batch is split over the rows of a mesh, the model's call runs once per row. Each
row's call runs in a `keras.StatelessScope`, which records the variable updates and the
losses it adds instead of applying them; after the last row, `RowState.apply` applies
each once:

- a float variable (BatchNorm's moving mean and variance) gets the rows' new values
  averaged, weighted by each row's share of the batch. Every row starts from the value
  before the step, so a moving average moves once per step, by the batch's mean
  statistics (the moving mean exactly as on one device; the moving variance by the
  rows' variances, as in data parallelism without synchronised BatchNorm);
- any other variable (a seed generator's state) is carried from row to row, so the rows
  draw different random numbers, and ends at the last row's value;
- each loss a layer adds (activity regularizers, divided by their row's size) is summed
  over the rows weighted by the rows' shares: the whole batch's value.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfmulti.compat import keras_internals


class RowState:
    """Collects the updates and losses of each row's call of `layer` (a built model)."""

    def __init__(self, layer):
        self._layer = layer
        self._variables = {id(variable): variable for variable in layer.variables}
        self._carried = {}  # variable id -> non-float value carried to the next row
        self._rows = []  # per row: (share of the batch, {variable id: value}, losses)

    @contextlib.contextmanager
    def row(self, share: tf.Tensor):
        """Records the updates and losses of the call made inside; `share` is the row's
        fraction of the batch (a float tensor)."""
        carried = [(self._variables[key], value) for key, value in self._carried.items()]
        with keras.StatelessScope(state_mapping=carried, collect_losses=True) as scope:
            yield
        updates = {
            key: value
            for key, value in scope.state_mapping.items()
            if self._carried.get(key) is not value
        }
        unknown = set(updates) - set(self._variables)
        if unknown:
            raise ValueError(
                "A call split over mesh rows assigned a variable its model does not track "
                f"({len(unknown)} of them); create state variables with the layer's "
                "add_weight so tfmulti can combine the rows' updates"
            )
        for key, value in updates.items():
            if not keras.backend.is_float_dtype(self._variables[key].dtype):
                self._carried[key] = value
        self._rows.append((share, updates, list(scope.losses)))

    def apply(self) -> None:
        """Assigns the combined updates and adds the combined losses to their layers."""
        updated = {key for _, updates, _ in self._rows for key in updates}
        for key in updated:
            variable = self._variables[key]
            if key in self._carried:
                variable.assign(self._carried[key])
                continue
            combined = [
                tf.cast(share, variable.dtype) * updates.get(key, variable.value)
                for share, updates, _ in self._rows
            ]
            variable.assign(tf.add_n(combined))
        self._add_losses()

    def _add_losses(self) -> None:
        counts = {len(losses) for _, _, losses in self._rows}
        if counts == {0}:
            return
        if len(counts) > 1:
            raise ValueError(
                "The rows of a mesh added different numbers of losses in one call; a layer "
                "that adds losses under a batch-split mesh must add the same ones for "
                f"every part of the batch. Received counts {sorted(counts)}"
            )
        owners = {
            loss_id: layer
            for layer in keras_internals.layers_within(self._layer)
            for loss_id in keras_internals.loss_ids(layer)
        }
        first_row_losses = self._rows[0][2]
        for index, first in enumerate(first_row_losses):
            combined = tf.add_n(
                [tf.cast(share, first.dtype) * losses[index] for share, _, losses in self._rows]
            )
            owners.get(id(first), self._layer).add_loss(combined)
