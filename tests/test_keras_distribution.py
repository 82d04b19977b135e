"""keras.distribution on TensorFlow: KerasHub models sharded by their own layout maps train
to the weights of the unsharded model, with each sharded weight's bytes split over devices."""

import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfmulti  # noqa: F401  (hooks keras.distribution into the TensorFlow backend)
from tfmulti.keras_distribution.layer_sharding import sharded_views
from tfmulti.parallel import (
    LayoutNotHonouredWarning,
    shard,
    unsplit_weights,
    variable_bytes_per_device,
)

VOCABULARY = 64
SEQUENCE = 8
BATCH = 4
STEPS = 2


TINY_DECODER = {
    "vocabulary_size": VOCABULARY,
    "num_layers": 1,
    "num_query_heads": 4,
    "num_key_value_heads": 4,
    "hidden_dim": 16,
    "intermediate_dim": 32,
}


def causal_lm(backbone_class, model_class, seed, **options):
    keras.utils.set_random_seed(seed)
    backbone = backbone_class(**TINY_DECODER, **options)
    return model_class(backbone=backbone, preprocessor=None)


def llama(seed=1):
    return causal_lm(keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM, seed)


def gemma(seed=1):
    return causal_lm(
        keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM, seed, head_dim=4
    )


def token_batches():
    rng = np.random.default_rng(0)
    shape = (BATCH * STEPS, SEQUENCE)
    inputs = {
        "token_ids": rng.integers(0, VOCABULARY, shape).astype("int32"),
        "padding_mask": np.ones(shape, "int32"),
    }
    return inputs, rng.integers(0, VOCABULARY, shape).astype("int32")


def compile_and_fit(model, optimizer_name):
    optimizer = {"sgd": keras.optimizers.SGD(0.5), "adam": keras.optimizers.Adam(0.01)}
    model.compile(
        optimizer=optimizer[optimizer_name],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    inputs, targets = token_batches()
    return model.fit(inputs, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def model_mesh(num_devices):
    devices = keras.distribution.list_devices("cpu")[:num_devices]
    return keras.distribution.DeviceMesh((1, num_devices), ("batch", "model"), devices)


def assert_same_weights(reference, sharded_model, tolerance):
    expected = reference.get_weights()
    received = unsplit_weights(sharded_model)
    assert len(received) == len(expected)
    for want, got in zip(expected, received, strict=True):
        np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)


def assert_each_shard_holds_its_share(model, num_devices):
    views = sharded_views(model)
    assert views, "the layout map sharded nothing"
    for view in views:
        whole_bytes = int(np.prod(view.shape)) * 4
        devices = [shard.value.device for shard in view.shards]
        assert len(set(devices)) == num_devices, view.path
        for shard_variable in view.shards:
            assert int(np.prod(shard_variable.shape)) * 4 == whole_bytes // num_devices


# One KerasHub case per way in: Gemma's layout map here, under the distribution's scope, on
# four devices with SGD; Llama's map through `shard` (Adam, two devices) in the test below.
@pytest.mark.parametrize(
    "build, backbone_class, num_devices, optimizer_name",
    [(gemma, keras_hub.models.GemmaBackbone, 4, "sgd")],
    ids=["gemma-4-sgd"],
)
def test_model_parallel_with_keras_hub_layout_trains_to_unsharded_weights(
    build, backbone_class, num_devices, optimizer_name
):
    reference = build()
    reference_history = compile_and_fit(reference, optimizer_name)
    layout_map = backbone_class.get_layout_map(model_mesh(num_devices))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutNotHonouredWarning)
        with keras.distribution.ModelParallel(layout_map=layout_map).scope():
            model = build()
    assert_each_shard_holds_its_share(model, num_devices)
    assert_bytes_per_device_fall_by_the_share(model, reference, num_devices)
    history = compile_and_fit(model, optimizer_name)
    np.testing.assert_allclose(history.history["loss"], reference_history.history["loss"], 1e-5)
    assert_same_weights(reference, model, 1e-4)
    assert_optimizer_state_beside_shards(model, SLOTS_PER_WEIGHT[optimizer_name])


SLOTS_PER_WEIGHT = {"sgd": 0, "adam": 2}


def assert_bytes_per_device_fall_by_the_share(model, whole, num_devices):
    sharded_bytes = sum(int(np.prod(view.shape)) * 4 for view in sharded_views(model))
    whole_bytes = sum(int(np.prod(variable.shape)) * 4 for variable in whole.weights)
    assert variable_bytes_per_device(model) == {
        f"/device:CPU:{index}": sharded_bytes // num_devices
        + (whole_bytes - sharded_bytes if index == 0 else 0)
        for index in range(num_devices)
    }
    assert variable_bytes_per_device(whole) == {"/device:CPU:0": whole_bytes}


def assert_optimizer_state_beside_shards(model, slots_per_weight):
    weight_bytes = variable_bytes_per_device(model)
    optimizer_bytes = variable_bytes_per_device(model, part="optimizer")
    for device in list(weight_bytes)[1:]:  # only shards live off the first device
        assert optimizer_bytes.get(device, 0) == slots_per_weight * weight_bytes[device]
    assert variable_bytes_per_device(model, part="all") == {
        device: weight_bytes[device] + optimizer_bytes.get(device, 0) for device in weight_bytes
    }


def llama_unlike_a_new_one(seed):
    """A llama each of whose weights differs from `llama()`'s, as a trained one's would
    (norm scales too), without the cost of training it: its seed's, moved by noise."""
    model = llama(seed)
    rng = np.random.default_rng(seed)
    model.set_weights(
        [w + rng.normal(0, 0.01, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def test_shard_on_a_model_with_loaded_weights_predicts_and_trains_as_unsharded(tmp_path):
    trained = llama_unlike_a_new_one(seed=7)
    weights_file = str(tmp_path / "llama.weights.h5")
    trained.save_weights(weights_file)
    reference, model = llama(), llama()
    reference.load_weights(weights_file)
    model.load_weights(weights_file)
    inputs, _ = token_batches()
    before = model.predict(inputs, verbose=0)

    shard(model, keras_hub.models.LlamaBackbone.get_layout_map(model_mesh(2)))

    assert_each_shard_holds_its_share(model, 2)
    np.testing.assert_allclose(model.predict(inputs, verbose=0), before, atol=1e-5)
    assert_bytes_per_device_fall_by_the_share(model, reference, 2)
    compile_and_fit(reference, "adam")
    compile_and_fit(model, "adam")
    assert_same_weights(reference, model, 1e-4)
    assert_optimizer_state_beside_shards(model, SLOTS_PER_WEIGHT["adam"])
    # Saved weights keep the unsharded layout: an unsharded model loads them.
    model.save_weights(weights_file)
    reloaded = llama()
    reloaded.load_weights(weights_file)
    assert_same_weights(reloaded, model, 0)


def dense_then_conv(seed=2):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 4))
    hidden = keras.layers.Dense(8, activation="relu", name="dense")(inputs)
    outputs = keras.layers.Conv1D(4, 3, name="conv")(hidden)
    return keras.Model(inputs, outputs)


def regression_data(rows, seed, target_steps=4):
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(rows, 6, 4)).astype("float32")
    return inputs, rng.normal(size=(rows, target_steps, 4)).astype("float32")


def fit_regression(model, data, batch_size):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(*data, batch_size=batch_size, shuffle=False, verbose=0)


def test_layout_for_a_layer_kind_not_sharded_warns_once_naming_it_and_trains_correctly():
    data = regression_data(8, seed=1)
    reference = dense_then_conv()
    fit_regression(reference, data, batch_size=4)
    layout_map = keras.distribution.LayoutMap(model_mesh(2))
    layout_map["dense/kernel"] = (None, "model")
    layout_map["conv/kernel"] = (None, None, "model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with keras.distribution.ModelParallel(layout_map=layout_map).scope():
            model = dense_then_conv()
            fit_regression(model, data, batch_size=4)  # as Keras' guide: fit in the scope
    messages = [str(w.message) for w in caught if w.category is LayoutNotHonouredWarning]
    assert len(messages) == 1, messages
    assert "'conv/kernel'" in messages[0] and "Conv1D" in messages[0]
    assert [view.path for view in sharded_views(model)] == ["dense/kernel"]
    assert_same_weights(reference, model, 1e-5)


@pytest.mark.parametrize("how", ["scope", "set_distribution"])
def test_data_parallel_replicates_and_trains_to_one_device_weights(how):
    data = regression_data(16, seed=2)
    reference = dense_then_conv()
    fit_regression(reference, data, batch_size=8)
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")[:2]
    )
    if how == "scope":
        with distribution.scope():
            model = dense_then_conv()
            fit_regression(model, data, batch_size=8)
    else:
        keras.distribution.set_distribution(distribution)
        try:
            model = dense_then_conv()
            fit_regression(model, data, batch_size=8)
        finally:
            keras.distribution.set_distribution(None)
    assert not tf.distribute.has_strategy()
    assert model.distribute_strategy.num_replicas_in_sync == 2
    assert_same_weights(reference, model, 1e-5)


def test_model_built_under_model_parallel_loads_unsharded_weights(tmp_path):
    trained = llama_unlike_a_new_one(seed=5)
    weights_file = str(tmp_path / "trained.weights.h5")
    trained.save_weights(weights_file)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(model_mesh(2))
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        model = llama()
        model.load_weights(weights_file)  # as KerasHub's from_preset does
    assert_same_weights(trained, model, 0)
    inputs, _ = token_batches()
    np.testing.assert_allclose(
        model.predict(inputs, verbose=0), trained.predict(inputs, verbose=0), atol=1e-5
    )


class LazyBlock(keras.layers.Layer):
    """Builds its Dense only when first called, inside the model's symbolic call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, activation="relu", name="inner")

    def call(self, inputs):
        return self.inner(inputs)


def lazy_block_model(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 4))
    hidden = LazyBlock(name="block")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))


def test_layer_built_inside_a_symbolic_call_is_sharded_once_its_variables_exist():
    data = regression_data(8, seed=3, target_steps=6)
    reference = lazy_block_model()
    fit_regression(reference, data, batch_size=4)
    layout_map = keras.distribution.LayoutMap(model_mesh(2))
    layout_map["block/inner/kernel"] = (None, "model")
    layout_map["head/kernel"] = ("model", None)
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        model = lazy_block_model()
    assert [view.path for view in sharded_views(model)] == ["block/inner/kernel", "head/kernel"]
    fit_regression(model, data, batch_size=4)
    assert_same_weights(reference, model, 1e-5)


def test_mixed_float16_sharded_layers_train_like_unsharded():
    data = regression_data(8, seed=4)
    layout_map = keras.distribution.LayoutMap(model_mesh(2))
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/bias"] = ("model",)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference = dense_then_conv()
        fit_regression(reference, data, batch_size=4)
        with keras.distribution.ModelParallel(layout_map=layout_map).scope():
            model = dense_then_conv()
        fit_regression(model, data, batch_size=4)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert len(sharded_views(model)) == 2
    assert_same_weights(reference, model, 1e-3)


def test_layer_first_built_inside_fit_stays_whole_with_a_warning_and_trains_correctly():
    def unbuilt_sequential():
        keras.utils.set_random_seed(6)
        return keras.Sequential([keras.layers.Dense(8, name="up"), keras.layers.Dense(4)])

    data = regression_data(8, seed=6, target_steps=6)
    reference = unbuilt_sequential()
    fit_regression(reference, data, batch_size=4)
    layout_map = keras.distribution.LayoutMap(model_mesh(2))
    layout_map[".*up/kernel"] = (None, "model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with keras.distribution.ModelParallel(layout_map=layout_map).scope():
            model = unbuilt_sequential()
            fit_regression(model, data, batch_size=4)
    messages = [str(w.message) for w in caught if w.category is LayoutNotHonouredWarning]
    assert len(messages) == 1 and "up/kernel" in messages[0], messages
    assert "build the model before fit" in messages[0]
    assert_same_weights(reference, model, 1e-6)


def test_shard_refuses_an_unbuilt_or_already_trained_model_in_one_line():
    layout_map = keras.distribution.LayoutMap(model_mesh(2))
    layout_map["dense/kernel"] = (None, "model")
    unbuilt = keras.Sequential([keras.layers.Dense(4, name="dense")])
    with pytest.raises(ValueError, match="needs a built model") as error:
        shard(unbuilt, layout_map)
    assert "\n" not in str(error.value)
    trained = dense_then_conv()
    fit_regression(trained, regression_data(4, seed=0), batch_size=4)
    with pytest.raises(ValueError, match="must run before training"):
        shard(trained, layout_map)
    assert not sharded_views(trained)
