"""Tracing cost: each stage's forward and backward are traced once, whatever the micro-batches.

The step's graph holds one call per action, so its size grows with micro-batches by a few
nodes per action, not by a copy of every stage's forward and backward.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import FEATURES, OUTPUTS, Chain, regression_batches

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.runtime.devices import logical_device_names

NUM_DEVICES = 2
BATCH_SIZE = 16
TRACES = collections.Counter()


class CountingStage(keras.layers.Layer):
    """Three dense layers whose forward and backward count how often Python traces them."""

    def __init__(self, units, seed, **kwargs):
        super().__init__(**kwargs)
        self.denses = [
            keras.layers.Dense(
                units,
                activation="gelu",
                kernel_initializer=keras.initializers.GlorotUniform(seed + i),
            )
            for i in range(3)
        ]

    def call(self, inputs):
        TRACES[("forward", self.name)] += 1
        outputs = inputs
        for dense in self.denses:
            outputs = dense(outputs)
        return self._counted_backward(outputs)

    def _counted_backward(self, outputs):
        @tf.custom_gradient
        def identity(tensor):
            def gradient(upstream):
                TRACES[("backward", self.name)] += 1
                return upstream

            return tf.identity(tensor), gradient

        return identity(outputs)


def _stages(num_stages):
    units = [8] * (num_stages - 1) + [OUTPUTS]
    return [CountingStage(u, 10 * i, name=f"stage{i}") for i, u in enumerate(units)]


def _built_pipeline(num_microbatches, schedule, jit_compile=False, rolled=None):
    devices = logical_device_names("CPU")[:NUM_DEVICES]
    pipeline = PipelineModel(
        _stages(NUM_DEVICES), devices, num_microbatches, schedule, rolled=rolled
    )
    pipeline.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit_compile)
    pipeline(np.zeros((BATCH_SIZE, FEATURES), "float32"))
    return pipeline


def _traces_of_one_training_step(num_microbatches, schedule):
    pipeline = _built_pipeline(num_microbatches, schedule)
    TRACES.clear()
    x, y = regression_batches(1, BATCH_SIZE)[0]
    pipeline.train_on_batch(x, y)
    return dict(TRACES)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "gpipe"])
def test_each_stage_forward_and_backward_traced_once_whatever_the_microbatches(schedule):
    few = _traces_of_one_training_step(2, schedule)
    many = _traces_of_one_training_step(8, schedule)
    assert few == many
    expected = {(part, f"stage{i}"): 1 for part in ("forward", "backward") for i in (0, 1)}
    assert many == expected


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_a_first_fit_with_metrics_traces_the_step_once(source):
    # Keras builds a model without a strategy in its first step's trace; variables made
    # there (stages, metrics, loss, optimizer slots) made tf.function trace the step twice.
    devices = logical_device_names("CPU")[:NUM_DEVICES]
    pipeline = PipelineModel(_stages(NUM_DEVICES), devices, 4, "1f1b")
    pipeline.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    schedule_traces = []
    run_schedule = pipeline.run_schedule

    def counted(*args, **kwargs):
        schedule_traces.append(args)
        return run_schedule(*args, **kwargs)

    pipeline.run_schedule = counted
    x, y = regression_batches(1, 2 * BATCH_SIZE)[0]
    if source == "arrays":
        history = pipeline.fit(x, y, batch_size=BATCH_SIZE, epochs=2, verbose=0)
    else:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)
        history = pipeline.fit(data, epochs=2, verbose=0)
    assert len(schedule_traces) == 1
    assert np.isfinite(history.history["mae"]).all()


def _traces_of_evaluation(num_microbatches):
    pipeline = _built_pipeline(num_microbatches, "1f1b")
    TRACES.clear()
    x, y = regression_batches(1, BATCH_SIZE)[0]
    pipeline.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0)
    return dict(TRACES)


def test_evaluation_traces_each_stage_once_whatever_the_microbatches():
    assert (
        _traces_of_evaluation(2)
        == _traces_of_evaluation(8)
        == {
            ("forward", "stage0"): 1,
            ("forward", "stage1"): 1,
        }
    )


def _step_graph(num_microbatches, rolled=False, schedule="1f1b", batch_size=BATCH_SIZE):
    pipeline = _built_pipeline(num_microbatches, schedule, rolled=rolled)
    x, y = regression_batches(1, batch_size)[0]

    @tf.function(autograph=False)
    def gradients(x, y):
        return pipeline.run_schedule(x, y).gradients

    return gradients.get_concrete_function(x, y).graph.as_graph_def()


def test_unrolled_step_graph_grows_by_a_few_nodes_per_action_not_a_copy_of_the_stages():
    few, many = _step_graph(2), _step_graph(8)
    actions_added = 2 * NUM_DEVICES * (8 - 2)
    nodes_per_action = (len(many.node) - len(few.node)) / actions_added
    # Copying each stage's forward and backward into the step adds ~60 nodes per action
    # here; a call, the gradient sums, the hand-over identities and the last stage's loss
    # add ~17, whatever the stage's depth.
    assert nodes_per_action < 25, nodes_per_action
    assert len(many.library.function) == len(few.library.function)


def _graph_size(graph_def) -> int:
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def _while_loops(graph_def) -> int:
    return sum(node.op in ("While", "StatelessWhile") for node in graph_def.node)


# One loop (zb_h1's round loop also holds 1F1B's F and B) and GPipe's two loops.
@pytest.mark.parametrize("schedule, loops", [("zb_h1", 1), ("gpipe", 2)])
def test_rolled_step_graph_is_the_same_size_whatever_the_microbatches(schedule, loops):
    # GPipe runs as two loops (every forward, then every backward), the others as one.
    sizes = {}
    for num_microbatches in (8, 16, 32):
        graph = _step_graph(num_microbatches, rolled=None, schedule=schedule, batch_size=64)
        assert _while_loops(graph) == loops
        sizes[num_microbatches] = _graph_size(graph)
    # Only the reads of each looped micro-batch's loss and outputs grow with m.
    assert sizes[32] - sizes[16] == 2 * (sizes[16] - sizes[8]), sizes
    per_microbatch = (sizes[32] - sizes[8]) / 24
    assert per_microbatch < 12, sizes
    unrolled = _graph_size(_step_graph(32, rolled=False, schedule=schedule, batch_size=64))
    assert sizes[32] < unrolled / 2, (sizes, unrolled)


def _stage_calls(graph_def) -> int:
    """Calls of a stage's cut functions (F, B, I, W) anywhere in the step."""
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(
        node.op in ("PartitionedCall", "StatefulPartitionedCall")
        and node.attr["f"].func.name.startswith("__inference_piece")
        for node in nodes
    )


@pytest.mark.parametrize("schedule, calls", [("1f1b", 2 * NUM_DEVICES), ("zb_h1", 3 * NUM_DEVICES)])
def test_a_guarded_loop_calls_each_stage_function_once_in_the_whole_step(schedule, calls):
    # Warm-up and cool-down run in the loop too, skipped action by action: the step holds
    # one call per stage function (F and B, or F, I and W), at any m; the steady-state loop
    # also traced its prologue and epilogue, action by action.
    for num_microbatches in (4, 16):
        graph = _step_graph(num_microbatches, rolled=None, schedule=schedule)
        assert _stage_calls(graph) == calls, num_microbatches
        assert _while_loops(graph) == 1
    assert _stage_calls(_step_graph(16, rolled=False, schedule=schedule)) == calls * 16


def test_stage_functions_train_like_one_device():
    x, y = regression_batches(1, BATCH_SIZE)[0]
    pipeline = _built_pipeline(4, "zb_h1")
    reference = Chain(_stages(NUM_DEVICES))
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    reference(x)
    for _ in range(2):
        pipeline.train_on_batch(x, y)
        reference.train_on_batch(x, y)
    for mine, theirs in zip(pipeline.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
