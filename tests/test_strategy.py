"""Data parallelism on one host trains to the same weights as one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.platform.runtime.distribute_strategy import get_strategy, per_replica_batch_size

GLOBAL_BATCH = 32
STEPS = 6


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 12)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32") + 2 * (x[:, 4] > 0).astype("int32")
    return x, y


def _train_weights(strategy) -> list[np.ndarray]:
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(4),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(dataset, epochs=1, verbose=0)
    return [np.array(w) for w in model.get_weights()]


@pytest.mark.parametrize("num_devices", [2, 4])
def test_mirrored_trains_to_the_same_weights_as_one_device(num_devices):
    reference = _train_weights(get_strategy("one_device"))
    mirrored = _train_weights(get_strategy("mirrored", num_devices=num_devices))
    initial_model_changed = any(np.abs(w).sum() > 0 for w in reference)
    assert initial_model_changed
    for expected, actual in zip(reference, mirrored, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_mirrored_uses_the_requested_number_of_replicas():
    assert get_strategy("mirrored", num_devices=4).num_replicas_in_sync == 4
    assert get_strategy("mirrored", num_devices=2).num_replicas_in_sync == 2


def test_asking_for_more_devices_than_exist_names_the_fix():
    with pytest.raises(ValueError, match="--virtual_devices"):
        get_strategy("mirrored", num_devices=64)


def test_nccl_on_cpu_is_rejected_with_the_working_choice():
    with pytest.raises(ValueError, match="reduce_to_one_device"):
        get_strategy("mirrored", num_devices=2, all_reduce="nccl")


def test_global_batch_must_split_evenly_over_replicas():
    assert per_replica_batch_size(64, 4) == 16
    with pytest.raises(ValueError, match="batch_size=30"):
        per_replica_batch_size(30, 4)


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="one_device"):
        get_strategy("parameter_server")
