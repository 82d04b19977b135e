"""Keras builds a model that has no distribution strategy inside its first step's trace.

Before `fit`, `evaluate` and `*_on_batch` make their functions, Keras builds a model under
a strategy symbolically (`_maybe_symbolic_build`); one without a strategy it leaves to the
first trace of the step, which then makes the compiled metrics and loss, the optimizer's
slots and any unbuilt layer. A variable made during a trace makes tf.function trace the
step a second time. tfmulti's pipeline, hybrid and placed models have no strategy (they
drive their devices themselves), and a pipeline's step, every micro-batch's forward and
backward, is the costliest trace there is.

The fix calls a model's `build_ahead_of_tracing(data_batch)` there, for a model without a
strategy that has one (tfmulti's `BuildsAheadOfTracing`), with the batch `*_on_batch`
was given or KerasTensors shaped like the epoch input's batches (its tf.data spec: no batch
is drawn). Other models build as before. Measured: a 2-stage 1F1B pipeline's first `fit`
traced its schedule twice, now once (`tests/test_pipeline_runtime_tracing.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tensorflow_trainer

from tfmulti.compat import keras_internals
from tfmulti.compat.fixes import Fix, FixSet
from tfmulti.compat.keras_multi_worker import placeholders_like


def _building_ahead(original: Callable) -> Callable:
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        build_ahead = getattr(self, "build_ahead_of_tracing", None)
        if build_ahead is not None and self._distribute_strategy is None:
            if data_batch is None and iterator is not None:
                data_batch = _epoch_placeholders(iterator)
            if data_batch is not None:
                build_ahead(data_batch)
                return None
        return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def _epoch_placeholders(iterator):
    """KerasTensors like a batch of the tf.data dataset a `TFEpochIterator` made from its
    input (arrays, a dataset or a generator), or None."""
    dataset = keras_internals.epoch_dataset(iterator)
    if isinstance(dataset, tf.data.Dataset):
        return placeholders_like(dataset.element_spec)
    return None


FIXES = (
    Fix(
        name="build_ahead_of_the_first_trace_without_a_strategy",
        owner=tensorflow_trainer.TensorFlowTrainer,
        attribute="_maybe_symbolic_build",
        make_replacement=_building_ahead,
    ),
)

FIX_SET = FixSet(FIXES)
