"""Every data replica of a hybrid mesh runs the schedule replica 0 traced, moved onto its own
devices and variables: a data=4 step traces the schedule once per batch-shard signature,
each copy's ops run on that copy's devices, and training equals one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import (
    Chain,
    max_weight_difference,
    regression_batches,
    residual_stages,
)

from tfmulti.compat.remapped_functions import DeviceMap, UnmovableFunction
from tfmulti.hybrid import HybridPipelineModel
from tfmulti.pipeline.runtime.pipeline_model import PipelineModel
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names


@pytest.fixture
def schedule_traces(monkeypatch):
    """The pipelines whose `run_schedule` was traced while the test ran, once per trace."""
    traced = []
    original = PipelineModel.run_schedule

    def counted(self, *args, **kwargs):
        traced.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PipelineModel, "run_schedule", counted)
    return traced


def _hybrid(mesh_text, schedule="1f1b", optimizer="adam", num_stages=2):
    mesh = parse_mesh(mesh_text)
    devices = logical_device_names("CPU")[: mesh.num_devices]
    model = HybridPipelineModel(
        lambda: residual_stages(num_stages), mesh.replica_devices(devices), 4, schedule
    )
    model.compile(optimizer=keras.optimizers.get(optimizer), loss="mse")
    return model


# ZB-H1's trace count: test_copies_running_replica_zeros_schedule_train_to_one_device_weights.
@pytest.mark.parametrize("schedule, num_stages", [("1f1b", 2), ("interleaved_1f1b", 4)])
def test_a_data4_step_traces_the_schedule_as_often_as_data1(schedule_traces, schedule, num_stages):
    # Interleaved: two stages on each device, so a device moves once for both.
    batch = regression_batches(1, 32)[0]
    for mesh_text in ("data=1,pipe=2", "data=4,pipe=2"):
        schedule_traces.clear()
        model = _hybrid(mesh_text, schedule, num_stages=num_stages)
        model.train_on_batch(*batch)
        assert schedule_traces == [model.replicas[0]], mesh_text


def test_each_copy_runs_on_its_own_devices():
    model = _hybrid("data=4,pipe=2")
    batch = tuple(tf.constant(part) for part in regression_batches(1, 16)[0])
    model(batch[0])
    step = tf.function(model.train_step, autograph=False)
    library = step.get_concrete_function(batch).graph.as_graph_def().library
    for index, replica in enumerate(model.replicas[1:], start=1):
        own = {tf.DeviceSpec.from_string(d).device_index for d in replica.stage_devices}
        copies = [f for f in library.function if f.signature.name.endswith(f"_{index}")]
        copies = [f for f in copies if f"data_replica_{index}" in f.signature.name]
        placed = {
            tf.DeviceSpec.from_string(node.device).device_index
            for function in copies
            for node in function.node_def
            if node.device
        }
        assert copies and placed == own, (index, placed, own)


def test_copies_running_replica_zeros_schedule_train_to_one_device_weights(schedule_traces):
    optimizer = "adam"
    # Uneven shards and a partial last batch.
    batches = regression_batches(3, 18) + regression_batches(1, 7, seed=3)
    reference = Chain(residual_stages(2))
    reference.compile(optimizer=keras.optimizers.get(optimizer), loss="mse")
    hybrid = _hybrid("data=4,pipe=2", "zb_h1", optimizer)
    reference(batches[0][0])
    hybrid(batches[0][0])
    for index, batch in enumerate(batches):
        expected = reference.train_on_batch(*batch)
        np.testing.assert_allclose(hybrid.train_on_batch(*batch), expected, rtol=1e-5)
        if index == 0:
            # 18 rows over 4 replicas: shards of 5, 5, 4 and 4 rows, one trace per shape.
            assert schedule_traces == [hybrid.replicas[0], hybrid.replicas[0]]
    assert max_weight_difference(reference, hybrid.replicas[0]) < 1e-5
    first = hybrid.replicas[0].get_weights()
    for replica in hybrid.replicas[1:]:
        for expected, actual in zip(first, replica.get_weights(), strict=True):
            np.testing.assert_array_equal(actual, expected)


def test_device_map_moves_full_and_partial_names():
    devices = DeviceMap([("/device:CPU:0", "/device:CPU:2"), ("/device:CPU:1", "/device:CPU:3")])
    assert devices.move("") == ""
    moved = devices.move("/job:localhost/replica:0/task:0/device:CPU:1")
    assert moved == "/job:localhost/replica:0/task:0/device:CPU:3"
    assert devices.move("/device:CPU:5") is None
    # A name that matches both devices (no index) cannot be moved.
    assert devices.move("/device:CPU:*") is None or devices.move("/job:localhost") is None


def test_a_device_cannot_move_to_two_places():
    with pytest.raises(UnmovableFunction, match="CPU:0"):
        DeviceMap([("/device:CPU:0", "/device:CPU:2"), ("/device:CPU:0", "/device:CPU:3")])


def test_evaluation_and_prediction_trace_the_forward_once_and_match_data1(monkeypatch):
    traced = []
    original = PipelineModel.call

    def counted(self, *args, **kwargs):
        traced.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PipelineModel, "call", counted)
    x, y = regression_batches(1, 32)[0]
    results = {}
    weights = None
    for mesh_text in ("data=1,pipe=2", "data=4,pipe=2"):
        model = _hybrid(mesh_text)
        model(x)
        weights = model.get_weights() if weights is None else weights
        model.set_weights(weights)
        traced.clear()
        loss = model.evaluate(x, y, batch_size=32, verbose=0)
        predictions = model.predict(x, batch_size=32, verbose=0)
        results[mesh_text] = (loss, predictions)
        # Only replica 0's forward is traced (evaluation and prediction share its trace).
        assert traced == [model.replicas[0]], mesh_text
    np.testing.assert_allclose(results["data=4,pipe=2"][0], results["data=1,pipe=2"][0], 1e-6)
    np.testing.assert_allclose(results["data=4,pipe=2"][1], results["data=1,pipe=2"][1], atol=1e-6)
