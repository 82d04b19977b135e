"""Under tf.distribute strategies Keras 3 lets each replica keep its own copy of a layer's
non-trainable state (BatchNorm's moving statistics); tfmulti averages the replicas'
updates, so the copies stay equal and a moving mean follows the whole batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.layers.layer import Layer

from tfmulti.compat import keras_replica_state

ROWS = 16


def normalized_inputs_model(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    normalized = keras.layers.BatchNormalization(name="norm")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(normalized))


def data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(ROWS, 6)).astype("float32"),
        rng.normal(size=(ROWS, 4)).astype("float32"),
    )


def fit(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(*data(), batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model.get_layer("norm")


def two_replicas():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def test_upstream_keras_still_gives_layer_state_no_aggregation(monkeypatch):
    # Fails once Keras aggregates such state itself: then remove keras_replica_state.
    monkeypatch.setattr(Layer, "add_weight", keras_replica_state.original_add_weight())
    with two_replicas().scope():
        model = normalized_inputs_model()
    aggregation = model.get_layer("norm").moving_mean.value.aggregation
    assert aggregation == tf.VariableAggregation.NONE, (
        "upstream Keras aggregates non-trainable layer state under strategies now: remove "
        "tfmulti/compat/keras_replica_state.py"
    )


@pytest.mark.parametrize("how", ["mirrored", "keras_data_parallel"])
def test_moving_statistics_average_the_replicas_and_their_copies_stay_equal(how):
    assert "mean_aggregated_layer_state_under_strategies" in keras_replica_state.FIX_SET.apply()
    reference = fit(normalized_inputs_model())
    if how == "mirrored":
        strategy = two_replicas()
        with strategy.scope():
            model = normalized_inputs_model()
    else:
        devices = keras.distribution.list_devices("cpu")[:2]
        with keras.distribution.DataParallel(devices=devices).scope():
            model = normalized_inputs_model()
            strategy = tf.distribute.get_strategy()
    norm = fit(model)
    # The normalised inputs do not depend on the weights: one device's moving mean.
    np.testing.assert_allclose(norm.moving_mean, reference.moving_mean, rtol=1e-6, atol=1e-8)
    # The moving variance averages each replica's (biased) variance: closed form.
    inputs, _ = data()
    expected = np.ones(6)
    for _ in range(2):
        for batch in np.split(inputs, ROWS // 8):
            replica_variances = [half.var(axis=0) for half in np.split(batch, 2)]
            expected = 0.99 * expected + 0.01 * np.mean(replica_variances, axis=0)
    np.testing.assert_allclose(norm.moving_variance, expected, rtol=1e-5)
    for variable in (norm.moving_mean, norm.moving_variance):
        first, second = strategy.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy())


def test_state_outside_strategies_and_trainable_weights_keep_their_aggregation():
    model = normalized_inputs_model()
    assert model.get_layer("norm").moving_mean.aggregation == "none"
    with two_replicas().scope():
        model = normalized_inputs_model()
    norm = model.get_layer("norm")
    assert norm.moving_mean.aggregation == "mean"
    assert norm.gamma.aggregation == "none"
