"""Hybrid start-up does not grow with the data axis: every data replica calls the stage
functions replica 0 traced, on its own variables, so a data=4 mesh traces each stage as often
as data=1 and its step's library holds as many stage functions (that training on the shared
traces is unchanged: test_hybrid_shared_schedule.py's data=4 run)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_graph_models import skip_model
from pipeline_runtime_models import (
    dense_stages,
    device_index,
    regression_batches,
    residual_stages,
)

from tfmulti.compat import tf_internals
from tfmulti.hybrid import HybridPipelineModel, build_hybrid_model_from_model
from tfmulti.pipeline.runtime import shared_traces, stage_functions
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names


@pytest.fixture
def traces(monkeypatch):
    """Counts the stage traces (`TracedStage`s) made while the test runs."""
    made = []

    class CountedTracedStage(stage_functions.TracedStage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(stage_functions, "TracedStage", CountedTracedStage)
    return made


def _hybrid(make_stages, mesh_text, schedule="1f1b", num_microbatches=4):
    mesh = parse_mesh(mesh_text)
    devices = logical_device_names("CPU")[: mesh.num_devices]
    model = HybridPipelineModel(
        make_stages, mesh.replica_devices(devices), num_microbatches, schedule
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_a_first_fit_with_metrics_traces_the_step_once():
    # Variables made in the first trace (replicas, metrics, optimizer slots) would make
    # tf.function trace the whole step again.
    model = _hybrid(lambda: dense_stages(2), "data=2,pipe=2")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    traces = []
    run = model._shared_schedule.run

    def counted(*args):
        traces.append(args[0])
        return run(*args)

    model._shared_schedule.run = counted
    x, y = regression_batches(1, 16)[0]
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    assert traces == [0, 1]  # one trace of the step: each replica's schedule once


def _stage_functions_in_step(model, batch) -> int:
    """Functions in the traced training step's library cut out of a stage's graph."""
    step = tf.function(model.train_step, autograph=False)
    library = step.get_concrete_function(batch).graph.as_graph_def().library
    return sum("piece" in function.signature.name for function in library.function)


# The split backward's schedule (one executor runs every schedule; a 1F1B mesh's copies
# trace no stage of their own: test_copies_of_a_user_model_share_replica_zero_traces).
@pytest.mark.parametrize("schedule", ["zb_h1"])
def test_a_data4_mesh_traces_each_stage_as_often_as_data1(traces, schedule):
    batch = regression_batches(1, 16)[0]
    counts = {}
    for mesh_text in ("data=1,pipe=2", "data=4,pipe=2"):
        traces.clear()
        model = _hybrid(lambda: residual_stages(2), mesh_text, schedule)
        model.train_on_batch(*batch)
        counts[mesh_text] = len(traces)
    assert counts["data=4,pipe=2"] == counts["data=1,pipe=2"] == 2


def test_a_data4_step_holds_as_many_stage_functions_as_data1():
    batch = tuple(tf.constant(part) for part in regression_batches(1, 16)[0])
    counts = {}
    for mesh_text in ("data=1,pipe=2", "data=4,pipe=2"):
        model = _hybrid(lambda: dense_stages(2), mesh_text)
        model(batch[0])
        counts[mesh_text] = _stage_functions_in_step(model, batch)
    assert counts["data=4,pipe=2"] == counts["data=1,pipe=2"] > 0


def test_copies_of_a_user_model_share_replica_zero_traces(traces):
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    y = np.random.default_rng(1).normal(size=(8, 2)).astype("float32")
    hybrid = build_hybrid_model_from_model(
        skip_model(), "data=2,pipe=2", 2, "1f1b", devices=logical_device_names("CPU")[:4]
    )
    hybrid.compile(optimizer="sgd", loss="mse")
    hybrid.train_on_batch(x, y)
    assert len(traces) == len(hybrid.replicas[0].stages)


def test_a_function_called_with_other_captures_reads_the_other_variable():
    first, second = tf.Variable(1.0), tf.Variable(5.0)
    concrete = tf.function(lambda scale: first * scale).get_concrete_function(
        tf.TensorSpec([], tf.float32)
    )
    captures = [second.handle if t is first.handle else t for t in concrete.captured_inputs]
    result = tf_internals.call_with_captures(concrete, [tf.constant(2.0)], captures)
    assert float(tf.nest.flatten(result)[0]) == 10.0


def test_stages_whose_variables_do_not_pair_up_trace_their_own():
    wide, narrow = keras.layers.Dense(4), keras.layers.Dense(3)
    wide.build((None, 2))
    narrow.build((None, 2))
    assert shared_traces.handle_map(wide, narrow) is None
    same = keras.layers.Dense(4)
    same.build((None, 2))
    assert shared_traces.handle_map(wide, same) is not None


def _call_traces(model) -> int:
    """Traces of every replica's plain stage calls (evaluation, prediction)."""
    return sum(
        function.experimental_get_tracing_count()
        for replica in model.replicas
        for functions in replica._executor.stage_functions
        for function in functions._calls.values()
    )


def test_a_data4_mesh_traces_each_stage_call_as_often_as_data1_and_predicts_the_same():
    x, y = regression_batches(1, 16)[0]
    counts, predictions, weights = {}, {}, None
    for mesh_text in ("data=1,pipe=2", "data=4,pipe=2"):
        model = _hybrid(lambda: dense_stages(2), mesh_text)
        model(x)
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        model.evaluate(x, y, batch_size=16, verbose=0)
        predictions[mesh_text] = model.predict(x, batch_size=16, verbose=0)
        counts[mesh_text] = _call_traces(model)
    assert counts["data=4,pipe=2"] == counts["data=1,pipe=2"] > 0
    np.testing.assert_allclose(
        predictions["data=4,pipe=2"], predictions["data=1,pipe=2"], atol=1e-6
    )


def test_the_optimizer_holds_and_updates_one_copy():
    batch = regression_batches(1, 16)[0]
    sizes = {}
    for mesh_text in ("data=1,pipe=2", "data=4,pipe=2"):
        model = _hybrid(lambda: dense_stages(2), mesh_text)
        model.train_on_batch(*batch)
        sizes[mesh_text] = len(model.optimizer.variables)
        assert len(model.trainable_variables) == len(model.replicas[0].trainable_variables)
    assert sizes["data=4,pipe=2"] == sizes["data=1,pipe=2"]


class _Wrapping(keras.layers.Layer):
    """A layer without a build of its own, holding a Dense it calls."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3)

    def call(self, inputs):
        return self.inner(inputs)


class _NoBuildConfig(_Wrapping):
    def get_build_config(self):
        return None


@pytest.mark.parametrize("layer, from_configs", [(_Wrapping, True), (_NoBuildConfig, False)])
def test_copies_build_from_build_configs_or_else_by_a_call(layer, from_configs, monkeypatch):
    built_by_call = []  # layers called symbolically, as building by a call does

    def call(self, inputs):
        if not tf.executing_eagerly():
            built_by_call.append(self)
        return self.inner(inputs)

    monkeypatch.setattr(layer, "call", call)
    x = np.ones((4, 2), "float32")
    model = _hybrid(lambda: [layer(), keras.layers.Dense(1)], "data=2,pipe=2")
    model(x)
    copy = model.replicas[1].stages[0]
    assert (copy not in built_by_call) is from_configs
    first_weights = model.replicas[0].stages[0].weights
    assert [v.shape for v in copy.weights] == [w.shape for w in first_weights]
    device = tf.DeviceSpec.from_string(model.replicas[1].stage_devices[0])
    assert {device_index(v) for v in copy.weights} == {(device.device_type, device.device_index)}
