"""Fixes that let Keras 3 `fit`/`evaluate`/`predict` run under MultiWorkerMirroredStrategy.

The symbolic-build fix also holds under every other tf.distribute strategy: the model is
built from the input's spec, not from a batch drawn before training, so a run sees the
same batches with a strategy as without one.

Upstream: keras-team/keras#20585. Each fix replaces one named Keras function,
delegates to the original wherever the original works, and applies only to the
Keras versions known to need it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tensorflow_trainer
from keras.src.callbacks import callback_list
from keras.src.trainers.data_adapters import tf_dataset_adapter

from tfmulti.compat import worker_paths
from tfmulti.compat.fixes import Fix, FixSet

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/20585"


def is_multi_worker(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether `strategy` is a MultiWorkerMirroredStrategy spanning more than one worker."""
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def _first_local_value(strategy: tf.distribute.Strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def symbolic_batch(iterator):
    """Placeholders shaped like a batch of the epoch's tf.data input, or None.

    None when the input is not a tf.data dataset of dense batches of known rank
    (asking another input for its spec could cost a copy of the data).
    """
    adapter = getattr(iterator, "data_adapter", None)
    if not isinstance(adapter, tf_dataset_adapter.TFDatasetAdapter):
        return None
    return placeholders_like(adapter.get_tf_dataset().element_spec)


def placeholders_like(element_spec):
    """KerasTensors (any batch size) matching a dataset's `element_spec`, or None unless
    every element is a dense tensor of known rank."""
    specs = tree.flatten(element_spec)
    if not all(isinstance(spec, tf.TensorSpec) and spec.shape.rank for spec in specs):
        return None
    return tree.pack_sequence_as(
        element_spec,
        [keras.KerasTensor((None, *spec.shape[1:]), spec.dtype.name) for spec in specs],
    )


def _build_from_one_replica(original: Callable) -> Callable:
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or strategy is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        # Building needs shapes and dtypes only. Upstream draws a batch through a
        # throwaway iterator under any strategy (none without one), so a dataset that
        # reshuffles on each new iterator, or a generator, trains on other batches than
        # without a strategy; and the draw fails on a finite validation set that the
        # last evaluation used up (a bare StopIteration).
        placeholders = symbolic_batch(iterator)
        if placeholders is not None:
            return original(self, data_batch=placeholders)
        if not is_multi_worker(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        # Upstream averages the batch over replicas with `strategy.reduce`, which under
        # this strategy tries to convert the nested PerReplica batch to one tensor and fails.
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = tree.map_structure(lambda v: _first_local_value(strategy, v), batch)
            break
        return original(self, data_batch=data_batch)

    return _maybe_symbolic_build


def _mean_over_replicas_elementwise(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
            return original(values, strategy, reduction)
        # Upstream passes axis=0, which also reduces inside each replica's value and
        # fails on scalar metrics. Averaging across replicas only is what the
        # single-worker path computes (tf.reduce_mean over local results, axis=0).
        return tree.map_structure(lambda value: strategy.reduce("MEAN", value, axis=None), values)

    return reduce_per_replica


def _callback_paths_per_worker(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_model(self, model):
        strategy = getattr(model, "_distribute_strategy", None)
        if is_multi_worker(strategy) and not strategy.extended.should_checkpoint:
            worker_paths.redirect_to_scratch(self.callbacks, worker_paths.scratch_dir())
        return original(self, model)

    return set_model


def _steps_in_a_plain_loop(original: Callable) -> Callable:
    @functools.wraps(original)
    def _make_function(self, step_function):
        if (
            self.steps_per_execution == 1
            or self.run_eagerly
            or not is_multi_worker(self._distribute_strategy)
        ):
            return original(self, step_function)
        # Upstream runs each execution's steps in a tf.while_loop whose body takes the
        # next batch as an Optional inside a tf.cond; under this strategy that graph fails
        # ("You must feed a value for placeholder ... while/cond/Placeholder"). Here the
        # loop takes `get_next()` batches with no cond: every worker runs the same number
        # of steps, and a worker out of data ends the epoch (OutOfRangeError) as upstream.
        strategy = self._distribute_strategy

        def one_step_on_data(data):
            outputs = strategy.run(step_function, args=(data,))
            return tensorflow_trainer.reduce_per_replica(outputs, strategy, reduction="auto")

        one_step_on_data = self._autoconvert_optionals(
            tf.function(one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile)
        )

        @tf.function(reduce_retracing=True)
        def steps_on_iterator(iterator):
            outputs = one_step_on_data(iterator.get_next())
            _, outputs = tf.while_loop(
                lambda step, _: step < self.steps_per_execution,
                lambda step, _: (step + 1, one_step_on_data(iterator.get_next())),
                (tf.constant(1), outputs),
            )
            return outputs

        def function(iterator):
            if isinstance(iterator, tf.data.Iterator | tf.distribute.DistributedIterator):
                return steps_on_iterator(iterator)
            for _, data in zip(range(self.steps_per_execution), iterator, strict=False):
                outputs = one_step_on_data(data)
            return outputs

        return function

    return _make_function


FIXES = (
    Fix(
        name="symbolic_build_from_one_replica",
        owner=tensorflow_trainer.TensorFlowTrainer,
        attribute="_maybe_symbolic_build",
        make_replacement=_build_from_one_replica,
    ),
    Fix(
        name="reduce_metrics_across_replicas_only",
        owner=tensorflow_trainer,
        attribute="reduce_per_replica",
        make_replacement=_mean_over_replicas_elementwise,
    ),
    Fix(
        name="steps_per_execution_in_a_plain_loop",
        owner=tensorflow_trainer.TensorFlowTrainer,
        attribute="_make_function",
        make_replacement=_steps_in_a_plain_loop,
    ),
    Fix(
        name="non_chief_callbacks_write_to_scratch",
        owner=callback_list.CallbackList,
        attribute="set_model",
        make_replacement=_callback_paths_per_worker,
    ),
)


FIX_SET = FixSet(FIXES)


def original_function(name: str) -> Callable:
    """The unpatched Keras function behind fix `name` (to check whether upstream still needs it)."""
    return FIX_SET.original(name)
