"""Everything a model's first training step would create, built before that step is traced.

Keras builds a model that has no distribution strategy (tfmulti's pipeline, hybrid and
placed models drive their devices themselves) inside the first trace of its step: the
compiled metrics and loss, the optimizer's slots, and for a pipeline its stages. A
variable made during a trace makes tf.function trace the whole step a second time, and a
pipeline's step, every micro-batch's forward and backward, is the costliest trace there
is. `tfmulti/compat/keras_build_ahead.py` has Keras call `build_ahead_of_tracing` before
`fit`, `evaluate` and `*_on_batch` make their functions, which builds all of it from the
batch's shapes instead.
"""

from __future__ import annotations

import keras
from keras import tree

from tfmulti.compat import keras_internals


class BuildsAheadOfTracing:
    """Mixin, before `keras.Model`: builds what the first step would, before it is traced.

    A subclass may answer `build_parts(x)` (build the parts that hold weights),
    `output_spec(x)` (the outputs' KerasTensors for inputs like `x`, where known: the
    compiled metrics and loss then build without a symbolic call of the model) and
    `optimizer_variable_order()`.
    """

    def build_parts(self, x) -> None:
        """Builds the parts holding weights for batches like `x` (KerasTensors); nothing by
        default."""

    def output_spec(self, x):
        """KerasTensors like the model's outputs for inputs like `x` (KerasTensors), where
        known without a symbolic call of the model; else None."""
        return None

    def optimizer_variable_order(self) -> list:
        """The trainable variables in the order steps hand them to the optimizer."""
        return self.trainable_variables

    def build_ahead_of_tracing(self, data_batch) -> None:
        """Builds the parts, optimizer, compiled metrics and loss for batches like
        `data_batch` ((x, y, sample_weight) of tensors, arrays or KerasTensors; a tensor's
        or array's whole shape counts, as in a trace of a step on it)."""
        data_batch = tree.map_structure(_placeholder, data_batch)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
        self.build_parts(x)
        optimizer = self.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.optimizer_variable_order())
        y_pred = self.output_spec(x)
        if y_pred is None:
            # Keras computes the outputs' spec by a symbolic call of the model.
            keras_internals.symbolic_build(self, data_batch)
        else:
            keras_internals.build_compiled_metrics_and_loss(self, x, y, y_pred, sample_weight)


def _placeholder(value):
    """`value` if a KerasTensor (or None), else a KerasTensor shaped like it."""
    if value is None or isinstance(value, keras.KerasTensor):
        return value
    return keras.KerasTensor(tuple(value.shape), dtype=keras.backend.standardize_dtype(value.dtype))
