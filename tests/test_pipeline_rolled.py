"""Rolled pipeline steps (the steady state as a loop) train exactly like unrolled ones and
like one device, for every rollable schedule."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import (
    Chain,
    dense_stages,
    loops_in_step,
    max_weight_difference,
    regression_batches,
    token_transformer_and_stages,
)

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.runtime.devices import logical_device_names

STEPS = 2
BATCH_SIZE = 32


def _pipeline(make_stages, num_devices, chunks, num_microbatches, schedule, rolled, **kwargs):
    devices = logical_device_names("CPU")[:num_devices]
    stages = make_stages(num_devices * chunks)
    return PipelineModel(stages, devices, num_microbatches, schedule, rolled=rolled, **kwargs)


@pytest.mark.parametrize(
    "schedule, num_devices, chunks, num_microbatches",
    [
        ("1f1b", 4, 1, 8),
        ("zb_h1", 2, 1, 16),
        ("zb_h2", 4, 1, 8),
        ("interleaved_1f1b", 2, 2, 8),
        ("gpipe", 4, 1, 8),
    ],
)
def test_rolled_pipeline_trains_like_unrolled_and_like_one_device(
    schedule, num_devices, chunks, num_microbatches
):
    batches = regression_batches(STEPS, BATCH_SIZE)
    x0, y0 = batches[0]
    models = {}
    for rolled in (None, False):
        model = _pipeline(dense_stages, num_devices, chunks, num_microbatches, schedule, rolled)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model(x0)
        # GPipe runs as two loops (forwards, then backwards), the others as one.
        loops = 2 if schedule == "gpipe" else 1
        assert loops_in_step(model, x0, y0) == (loops if rolled is None else 0)
        models[rolled] = model
    reference = Chain(dense_stages(num_devices * chunks))
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    reference(x0)
    for x, y in batches:
        losses = [model.train_on_batch(x, y) for model in (*models.values(), reference)]
    rolled_model, unrolled_model = models[None], models[False]
    # The same functions run in the same order on each device: the same numbers.
    for mine, theirs in zip(rolled_model.get_weights(), unrolled_model.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)
    assert max_weight_difference(reference, rolled_model) < 1e-5
    np.testing.assert_allclose(losses[0], losses[2], rtol=1e-5)


# One loop: GPipe's two loops are held by the dense sweep above.
@pytest.mark.parametrize("schedule, loops", [("1f1b", 1)])
def test_rolled_transformer_with_sparse_embedding_gradients_and_remat_trains_like_the_model(
    schedule, loops
):
    (x, y), loss, whole, stages = token_transformer_and_stages(num_layers=2, num_stages=2)
    whole.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    pipeline = PipelineModel(
        stages, logical_device_names("CPU")[:2], 8, schedule, remat=[True, False]
    )
    pipeline.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    pipeline(x)
    assert loops_in_step(pipeline, x, y) == loops
    for _ in range(STEPS):
        whole_loss = whole.train_on_batch(x, y)
        pipeline_loss = pipeline.train_on_batch(x, y)
    np.testing.assert_allclose(pipeline_loss, whole_loss, rtol=1e-5)
    for a, b in zip(whole.get_weights(), pipeline.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_batch_that_does_not_split_evenly_runs_unrolled_and_stays_exact():
    x, y = regression_batches(1, 30)[0]  # 30 rows in 8 micro-batches: 4 or 3 rows each
    pipeline = _pipeline(dense_stages, 2, 1, 8, "1f1b", None)
    pipeline.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    pipeline(x)
    assert loops_in_step(pipeline, x, y) == 0
    reference = Chain(dense_stages(2))
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference(x)
    pipeline.train_on_batch(x, y)
    reference.train_on_batch(x, y)
    assert max_weight_difference(reference, pipeline) < 1e-5


class _RecordingStage(keras.layers.Layer):
    """A dense layer whose forward and backward each hold the device a few milliseconds and
    record when they ran."""

    def __init__(self, index, intervals, **kwargs):
        super().__init__(**kwargs)
        # A bound method: Keras would track (and copy) a list attribute.
        self.index, self.record = index, intervals.append
        self.dense = keras.layers.Dense(4)

    def _held(self, tensor, kind):
        def record(value):
            start = time.perf_counter()
            time.sleep(0.004)
            self.record((self.index, kind, start, time.perf_counter()))
            return value

        held = tf.numpy_function(record, [tensor], tensor.dtype, stateful=False)
        held.set_shape(tensor.shape)
        return held

    def call(self, inputs):
        @tf.custom_gradient
        def through(x):
            return self._held(x, "F"), lambda dy: self._held(dy, "B")

        return self.dense(through(inputs))


@pytest.mark.parametrize(
    "schedule, num_devices", [("1f1b", 2), ("zb_h1", 2), ("1f1b", 3), ("1f1b", 4)]
)
@pytest.mark.parametrize("rolled", [None, False])
def test_each_device_runs_one_action_at_a_time(schedule, num_devices, rolled):
    # Each action waits for the previous one on its device. Waiting by control on a stage
    # function's outputs waited only for its stateful ops once TensorFlow inlined the call;
    # a guarded round's tf.cond keeps outside control inputs only on its predicate; and a
    # call whose inputs were unpacked inside the wait did not itself wait (middle stages of
    # a loop overlapped in every step at p=3, in half the steps at p=4).
    intervals = []
    stages = [_RecordingStage(i, intervals, name=f"recording{i}") for i in range(num_devices)]
    devices = logical_device_names("CPU")[:num_devices]
    model = PipelineModel(stages, devices, 8, schedule, rolled=rolled)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 4), "float32"), np.ones((16, 4), "float32")
    model(x)
    model.train_on_batch(x, y)
    assert rolled is False or model._executor.rolled.guarded
    for _ in range(3):
        intervals.clear()
        model.train_on_batch(x, y)
        assert len(intervals) == 8 * (2 * num_devices - 1)  # the first stage has no B to hold
        for stage in range(num_devices):
            mine = sorted((start, end) for index, _, start, end in intervals if index == stage)
            overlaps = [(a, b) for a, b in zip(mine, mine[1:], strict=False) if b[0] < a[1]]
            assert overlaps == [], (stage, overlaps)
