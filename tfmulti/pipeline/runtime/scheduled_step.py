"""Keras' train step for a model whose schedule computes its loss and gradients itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import keras
import tensorflow as tf
from keras import tree

from tfmulti.compat import keras_internals
from tfmulti.compat.keras_multi_worker import placeholders_like


@dataclasses.dataclass
class ScheduledStep:
    """What one schedule run gives the train step.

    Args:
        loss: the batch's loss (sum of the micro-batches' shares).
        rows: rows (or sample-weight sum) the loss averages over, for the loss tracker.
        gradients_and_variables: (gradient, variable) pairs for the optimizer.
        predictions: the batch's outputs, for the compiled metrics.
    """

    loss: tf.Tensor
    rows: tf.Tensor
    gradients_and_variables: Iterable
    predictions: tf.Tensor


class ScheduledTrainStep:
    """Mixin, before `keras.Model`: `train_step` from `run_scheduled_step`.

    A subclass answers `run_scheduled_step(x, y, sample_weight)` and `build_parts(x)`, and
    may finish the step after the update in `after_update`; the loss tracker, optimizer
    and metrics are Keras' own, as in `keras.Model.train_step`.

    Everything a step would create (the parts, compiled metrics and loss, optimizer slots)
    is built before the step is first traced: a variable made during that trace makes
    tf.function trace the whole scheduled step a second time.
    """

    def build_parts(self, x) -> None:
        """Builds the parts holding weights for batches like `x` (tensors or KerasTensors)."""
        raise NotImplementedError

    def optimizer_variable_order(self) -> list:
        """The trainable variables in the order steps hand them to the optimizer."""
        return self.trainable_variables

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras' hook before `fit`, `evaluate` and `*_on_batch` make their functions; it
        # builds nothing for a model without a distribution strategy, as these are.
        if self._distribute_strategy is None:
            if data_batch is None and iterator is not None:
                dataset = keras_internals.epoch_dataset(iterator)
                if isinstance(dataset, tf.data.Dataset):
                    data_batch = placeholders_like(dataset.element_spec)
            if data_batch is not None:
                self.build_ahead_of_tracing(data_batch)
                return None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def output_spec(self):
        """KerasTensors like the model's outputs, once `build_parts` knows them; else None."""
        return None

    def build_ahead_of_tracing(self, data_batch) -> None:
        """Builds the parts, optimizer, compiled metrics and loss for batches like
        `data_batch` ((x, y, sample_weight) of tensors or KerasTensors)."""
        data_batch = tree.map_structure(_placeholder, data_batch)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
        self.build_parts(x)
        optimizer = self.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.optimizer_variable_order())
        y_pred = self.output_spec()
        if y_pred is None:
            # Keras computes the outputs' spec by a symbolic call through the parts.
            keras_internals.symbolic_build(self, data_batch)
        else:
            keras_internals.build_compiled_metrics_and_loss(self, x, y, y_pred, sample_weight)

    def run_scheduled_step(self, x, y, sample_weight) -> ScheduledStep:
        raise NotImplementedError

    def after_update(self) -> None:
        """Runs after the optimizer's update (nothing by default)."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self.run_scheduled_step(x, y, sample_weight)
        keras_internals.track_loss(self, step.loss, sample_weight=step.rows)
        self.optimizer.apply_gradients(step.gradients_and_variables)
        self.after_update()
        return self.compute_metrics(x, y, step.predictions, sample_weight=sample_weight)


def _placeholder(value):
    """A KerasTensor (any batch size) like `value`, a tensor, array or KerasTensor."""
    if value is None:
        return None
    dtype = keras.backend.standardize_dtype(value.dtype)
    return keras.KerasTensor((None, *value.shape[1:]), dtype=dtype)
