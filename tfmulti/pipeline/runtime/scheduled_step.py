"""Keras' train step for a model whose schedule computes its loss and gradients itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import keras
import tensorflow as tf

from tfmulti.compat import keras_internals


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

    A subclass answers `run_scheduled_step(x, y, sample_weight)` and may finish the step
    after the update in `after_update`; the loss tracker, optimizer and metrics are
    Keras' own, as in `keras.Model.train_step`.
    """

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
