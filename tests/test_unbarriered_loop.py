"""`while_loop_without_barrier`: a loop whose rounds need not wait for each other.

The first test tells us when TensorFlow stops adding its end-of-round barrier (then the
workaround can go); the others that ours has none and that pipeline steps use it."""

import keras
import numpy as np
import tensorflow as tf
from pipeline_runtime_models import OUTPUTS, loops_in_step, regression_batches

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.pipeline.runtime.unbarriered_loop import while_loop_without_barrier
from tfmulti.platform.runtime.devices import logical_device_names


def _bodies_outputs_waiting(loop) -> tuple[int, int]:
    """How many values the loop body returns wait (by control) on something, of how many."""
    counter = tf.Variable(0.0)

    @tf.function(autograph=False)
    def stateful_stage(x):
        counter.assign_add(1.0)
        return x * 2.0

    @tf.function(autograph=False)
    def step(x):
        def body(index, value):
            return index + 1, stateful_stage(value)

        return loop(lambda index, _: index < 3, body, (tf.constant(0), x))

    graph = step.get_concrete_function(tf.constant(1.0)).graph.as_graph_def()
    bodies = [f for f in graph.library.function if f.signature.name.startswith("while_body")]
    assert len(bodies) == 1
    (body,) = bodies
    returned = {value.split(":")[0] for value in body.ret.values()}
    waiting = sum(
        1
        for node in body.node_def
        if node.name in returned and any(i.startswith("^") for i in node.input)
    )
    return waiting, len(returned)


def test_tensorflow_still_makes_loop_outputs_wait_for_the_rounds_stateful_calls():
    # When this fails, TensorFlow no longer adds the barrier: `unbarriered_loop` can go.
    waiting, _ = _bodies_outputs_waiting(tf.while_loop)
    assert waiting > 0


def test_a_loop_without_barrier_returns_values_that_wait_only_for_their_inputs():
    waiting, returned = _bodies_outputs_waiting(while_loop_without_barrier)
    assert waiting == 0 < returned


def _dropout_stages(devices):
    stages = []
    for index, device in enumerate(devices):
        with tf.device(device):  # Dropout's seed variable is made with the layer
            stages.append(
                keras.Sequential(
                    [
                        keras.layers.Dense(8 if index < len(devices) - 1 else OUTPUTS),
                        keras.layers.Dropout(0.5, seed=index),
                    ]
                )
            )
    return stages


def test_dropout_masks_follow_each_devices_order_in_loops_without_barrier():
    # A stage's seed variable moves on in every forward, a stateful op no loop round
    # waits for any more: rolled and unrolled steps must still draw the same masks in the
    # same order (each device's token also waits for its calls' stateful ops).
    batches = regression_batches(3, 32)
    x0 = batches[0][0]
    for schedule, loops in (("1f1b", 1), ("gpipe", 2)):
        weights = []
        for rolled in (None, False):
            keras.utils.set_random_seed(3)
            devices = logical_device_names("CPU")[:3]
            model = PipelineModel(_dropout_stages(devices), devices, 8, schedule, rolled=rolled)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model(x0)
            assert loops_in_step(model, *batches[0]) == (loops if rolled is None else 0)
            for x, y in batches:
                model.train_on_batch(x, y)
            weights.append(model.get_weights())
        for mine, theirs in zip(*weights, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)
