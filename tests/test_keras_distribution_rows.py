"""keras.distribution meshes with a batch axis: ModelParallel on a (batch, model) mesh splits
each batch over the rows, shards weights over the model axis and, where the layout names
the batch axis too, over the rows as well (FSDP), and trains like one device."""

import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from test_keras_distribution import (
    assert_same_weights,
    compile_and_fit,
    llama,
    token_batches,
)

from tfmulti.keras_distribution.layer_sharding import sharded_views
from tfmulti.keras_distribution.mesh_layout import ShardPlan, UnsupportedLayout, plan_for_layout
from tfmulti.keras_distribution.mesh_rows import MeshRows, call_by_rows
from tfmulti.parallel import (
    LayoutNotHonouredWarning,
    shard,
    variable_bytes_per_device,
)


def device_mesh(rows, columns):
    devices = keras.distribution.list_devices("cpu")[: rows * columns]
    return keras.distribution.DeviceMesh((rows, columns), ("batch", "model"), devices)


def cpu(index):
    return f"/device:CPU:{index}"


def test_a_layout_naming_the_batch_axis_splits_each_shard_over_the_rows():
    mesh = device_mesh(2, 4)
    assert plan_for_layout(("model", "batch"), (8, 6), mesh, "batch") == ShardPlan(
        0,
        tuple(cpu(k) for k in range(4)),
        row_axis=1,
        row_devices=tuple((cpu(k), cpu(4 + k)) for k in range(4)),
    )
    assert plan_for_layout((None, "model"), (8, 6 * 4), mesh, "batch") == ShardPlan(
        1, tuple(cpu(k) for k in range(4))
    )
    with pytest.raises(UnsupportedLayout, match="only along the batch axis"):
        plan_for_layout(("batch", None), (8, 6), mesh, "batch")
    with pytest.raises(UnsupportedLayout, match="does not divide into 2 row pieces"):
        plan_for_layout(("model", "batch"), (8, 5), mesh, "batch")


def assert_each_device_holds_its_share(model, whole, num_devices):
    """Every device holds 1/num_devices of each sharded weight; the first also the rest."""
    sharded_bytes = sum(int(np.prod(view.shape)) * 4 for view in sharded_views(model))
    whole_bytes = sum(int(np.prod(variable.shape)) * 4 for variable in whole.weights)
    assert variable_bytes_per_device(model) == {
        cpu(index): sharded_bytes // num_devices + (whole_bytes - sharded_bytes) * (index == 0)
        for index in range(num_devices)
    }


@pytest.mark.parametrize(
    "build, backbone_class, rows, columns, optimizer_name",
    [(llama, keras_hub.models.LlamaBackbone, 2, 2, "adam")],
    ids=["llama-2x2-adam"],
)
def test_keras_hub_layout_on_a_batch_by_model_mesh_trains_to_unsharded_weights(
    build, backbone_class, rows, columns, optimizer_name
):
    reference = build()
    reference_history = compile_and_fit(reference, optimizer_name)
    layout_map = backbone_class.get_layout_map(device_mesh(rows, columns))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutNotHonouredWarning)
        with keras.distribution.ModelParallel(layout_map=layout_map).scope():
            model = build()
    # KerasHub's maps split weights along "model" and "batch": 1/4 of each on every device.
    assert_each_device_holds_its_share(model, reference, rows * columns)
    history = compile_and_fit(model, optimizer_name)
    np.testing.assert_allclose(history.history["loss"], reference_history.history["loss"], 1e-5)
    assert_same_weights(reference, model, 1e-4)
    if optimizer_name == "adam":  # two slots beside each piece, on its own device
        optimizer_bytes = variable_bytes_per_device(model, part="optimizer")
        for device, weight_bytes in variable_bytes_per_device(model).items():
            if device != cpu(0):
                assert optimizer_bytes[device] == 2 * weight_bytes
    inputs, targets = token_batches()
    np.testing.assert_allclose(
        model.predict(inputs, batch_size=4, verbose=0),
        reference.predict(inputs, batch_size=4, verbose=0),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        model.evaluate(inputs, targets, batch_size=4, verbose=0),
        reference.evaluate(inputs, targets, batch_size=4, verbose=0),
        rtol=1e-5,
    )


class DeviceProbe(keras.layers.Layer):
    """Passes its input on, recording where it runs and where the step's matrix products run."""

    seen_devices: list = []
    product_devices: set = set()

    def call(self, inputs):
        if not tf.executing_eagerly():
            graph = tf.compat.v1.get_default_graph()
            DeviceProbe.seen_devices.append(tf.DeviceSpec.from_string(inputs.device).device_index)
            DeviceProbe.product_devices.update(
                tf.DeviceSpec.from_string(op.device).device_index
                for op in graph.get_operations()
                if op.type in ("Einsum", "MatMul", "BatchMatMulV2")
            )
        return inputs


def two_dense(seed=3, activity_regularizer=None, normalize_inputs=False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization(name="norm")(inputs) if normalize_inputs else inputs
    hidden = keras.layers.Dense(
        8, activation="relu", name="up", activity_regularizer=activity_regularizer
    )(hidden)
    outputs = keras.layers.Dense(4, name="down")(hidden)
    return keras.Model(inputs, DeviceProbe(name="probe")(outputs))


def ten_rows():
    rng = np.random.default_rng(4)
    return rng.normal(size=(10, 6)).astype("float32"), rng.normal(size=(10, 4)).astype("float32")


def fit_ten_rows(model):
    inputs, targets = ten_rows()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # Batches of 4, 4 and 2: each split over two rows, the last one 1 + 1.
    history = model.fit(inputs, targets, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return history, model.predict(inputs, batch_size=3, verbose=0)


def column_then_row_layout(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return layout_map


def test_each_row_of_the_mesh_computes_its_part_of_every_batch_with_weights_held_once():
    reference = two_dense()
    reference_history, reference_predictions = fit_ten_rows(reference)
    distribution = keras.distribution.ModelParallel(
        layout_map=column_then_row_layout(device_mesh(2, 2))
    )
    with distribution.scope():
        model = two_dense()
    DeviceProbe.seen_devices.clear()  # what the symbolic build recorded
    DeviceProbe.product_devices.clear()
    history, predictions = fit_ten_rows(model)
    np.testing.assert_allclose(history.history["loss"], reference_history.history["loss"], 1e-5)
    assert_same_weights(reference, model, 1e-5)
    np.testing.assert_allclose(predictions, reference_predictions, atol=1e-5)
    # Rows start at devices 0 and 2 (fit, then predict); the shards computed on all four.
    assert set(DeviceProbe.seen_devices) == {0, 2}
    assert DeviceProbe.product_devices == {0, 1, 2, 3}
    # The weights live once, on the first row.
    held = variable_bytes_per_device(model)
    assert held[cpu(0)] > 0 and held[cpu(1)] > 0 and cpu(2) not in held and cpu(3) not in held


def test_losses_a_layer_adds_in_its_call_count_the_whole_batch_once():
    reference = two_dense(activity_regularizer="l2")
    reference_history, _ = fit_ten_rows(reference)
    distribution = keras.distribution.ModelParallel(
        layout_map=column_then_row_layout(device_mesh(2, 2))
    )
    with distribution.scope():
        model = two_dense(activity_regularizer="l2")
    history, _ = fit_ten_rows(model)
    # Each row's activity loss is divided by the row's size: weighted by the rows' shares
    # they sum to the whole batch's (added per row, they counted twice).
    np.testing.assert_allclose(history.history["loss"], reference_history.history["loss"], 1e-5)
    assert_same_weights(reference, model, 1e-5)


def test_moving_statistics_move_once_per_step_by_the_rows_statistics():
    reference = two_dense(normalize_inputs=True)
    fit_ten_rows(reference)
    distribution = keras.distribution.ModelParallel(
        layout_map=column_then_row_layout(device_mesh(2, 2))
    )
    with distribution.scope():
        model = two_dense(normalize_inputs=True)
    fit_ten_rows(model)
    norm = model.get_layer("norm")
    # The normalised inputs do not depend on the weights: the moving mean is one device's.
    np.testing.assert_allclose(norm.moving_mean, reference.get_layer("norm").moving_mean, 1e-6)
    # The moving variance follows the rows' own (biased) variances, averaged: closed form.
    inputs, _ = ten_rows()
    expected_variance = np.ones(6)
    for _ in range(2):  # epochs of batches 4, 4, 2, each split over two rows
        for start, size in [(0, 4), (4, 4), (8, 2)]:
            halves = np.split(inputs[start : start + size], 2)
            row_variance = np.mean([half.var(axis=0) for half in halves], axis=0)
            expected_variance = 0.99 * expected_variance + 0.01 * row_variance
    np.testing.assert_allclose(norm.moving_variance, expected_variance, rtol=1e-5)


def test_each_row_draws_its_own_random_numbers():
    keras.utils.set_random_seed(8)
    inputs = keras.Input((64,))
    model = keras.Model(inputs, keras.layers.Dropout(0.5)(inputs))
    rows = MeshRows.of_device_mesh(device_mesh(2, 2), "batch")

    @tf.function
    def dropped(batch):
        return call_by_rows(
            model.call, rows, (batch,), {"training": True}, lambda parts: tf.concat(parts, 0), model
        )

    outputs = dropped(tf.ones((4, 64))).numpy()
    assert set(np.unique(outputs)) == {0.0, 2.0}
    # Row 1 starts from the seed state row 0 left: its masks differ from row 0's.
    assert not np.array_equal(outputs[:2], outputs[2:])


def test_shard_a_built_model_over_a_batch_by_model_mesh_predicts_and_trains_as_one_device():
    model = two_dense(seed=5)
    reference = two_dense(seed=5)
    inputs = np.random.default_rng(6).normal(size=(5, 6)).astype("float32")
    before = model.predict(inputs, verbose=0)
    layout_map = keras.distribution.LayoutMap(device_mesh(2, 2))
    layout_map["up/kernel"] = ("batch", "model")
    layout_map["down/kernel"] = ("model", "batch")

    shard(model, layout_map)

    assert [len(view.shards[0].shards) for view in sharded_views(model)] == [2, 2]
    np.testing.assert_allclose(model.predict(inputs, batch_size=5, verbose=0), before, atol=1e-6)
    fit_ten_rows(model)
    fit_ten_rows(reference)
    assert_same_weights(reference, model, 1e-5)


def test_a_mesh_with_two_model_axes_is_refused_in_one_line_naming_it():
    devices = keras.distribution.list_devices("cpu")[:8]
    mesh = keras.distribution.DeviceMesh((2, 2, 2), ("batch", "model", "expert"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        with pytest.raises(ValueError, match=r"Received: mesh shape=\(2, 2, 2\)") as error:
            two_dense()
    assert "\n" not in str(error.value) and "'expert'" in str(error.value)


class PartsTrainStep(keras.Model):
    """A model whose own train_step never calls the model itself: it calls its inner
    network (`how="network"`), the network's layers one by one (`"layers"`), or only a
    layer of its own that takes a second tensor of another first dimension beside the
    batch (`"unsplit"`)."""

    def __init__(self, network, how="network", **kwargs):
        super().__init__(**kwargs)
        self.network = network
        self.scaled = ScaledBy()
        self.how = how

    def call(self, inputs, training=None):
        return self.network(inputs, training=training)

    def train_step(self, data):
        inputs, targets = data
        with tf.GradientTape() as tape:
            if self.how == "network":
                predictions = self.network(inputs, training=True)
            elif self.how == "layers":
                predictions = inputs
                for name in ("up", "down"):
                    predictions = self.network.get_layer(name)(predictions)
            else:
                predictions = self.scaled(inputs, tf.ones((1,)))
            loss = self.compute_loss(x=inputs, y=targets, y_pred=predictions)
        variables = self.trainable_variables
        if self.how == "unsplit":
            variables = self.scaled.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


class ScaledBy(keras.layers.Layer):
    """A (6, 4) projection of `inputs` times `scale`, recording where it runs."""

    def build(self, inputs_shape, scale_shape):
        self.kernel = self.add_weight((6, 4), initializer="glorot_uniform", name="kernel")

    def call(self, inputs, scale):
        return DeviceProbe()(keras.ops.matmul(inputs, self.kernel) * scale)


def parts_train_step_model(how="network"):
    model = PartsTrainStep(two_dense(), how=how)
    model.build((None, 6))
    return model


def _fit_on_mesh_recording_warnings(how: str):
    distribution = keras.distribution.ModelParallel(
        layout_map=column_then_row_layout(device_mesh(2, 2))
    )
    with distribution.scope():
        model = parts_train_step_model(how)
    DeviceProbe.seen_devices.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_ten_rows(model)
    return model, [str(w.message) for w in caught if w.category is LayoutNotHonouredWarning]


@pytest.mark.parametrize("how", ["network", "layers"])
def test_a_train_step_calling_the_models_layers_splits_each_call_over_the_rows(how):
    reference = parts_train_step_model(how)
    fit_ten_rows(reference)
    model, messages = _fit_on_mesh_recording_warnings(how)
    assert messages == []
    # The training calls ran on both rows (devices 0 and 2), as the model's would (the
    # probe ends the network; called layer by layer, the step leaves it out).
    if how == "network":
        assert set(DeviceProbe.seen_devices) == {0, 2}
    assert_same_weights(reference, model, 1e-5)


def test_a_train_step_whose_calls_share_no_batch_axis_warns_once_and_trains_on_the_first_row():
    reference = parts_train_step_model("unsplit")
    fit_ten_rows(reference)
    model, messages = _fit_on_mesh_recording_warnings("unsplit")
    assert len(messages) == 1, messages
    assert "calls neither the model nor one of its layers on tensors that share" in messages[0]
    assert "first of the mesh's 2 rows" in messages[0]
    assert_same_weights(reference, model, 1e-5)


def test_a_layer_is_split_only_when_its_tensors_share_one_batch_axis():
    from tfmulti.keras_distribution.row_split_steps import _one_batch_axis

    batch = tf.TensorSpec((None, 6))
    assert _one_batch_axis((tf.zeros((4, 6)), tf.zeros((4,))), {"scale": 2.0})
    # Position ids (or a table) beside the batch: its first axis is not the batch's.
    assert not _one_batch_axis((tf.zeros((4, 6)),), {"positions": tf.range(6)})
    with tf.Graph().as_default():
        unknown = tf.compat.v1.placeholder(batch.dtype, batch.shape)
        assert _one_batch_axis((unknown, unknown), {})
        assert not _one_batch_axis((unknown, tf.zeros((4,))), {})
