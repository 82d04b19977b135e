"""PipelineModel as a Keras model: placement, fit with callbacks, evaluate, predict, weights,
recomputation, mixed precision and errors."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import (
    FEATURES,
    MIXED_PRECISION_POLICIES,
    Chain,
    dense_stages,
    device_index,
    max_weight_difference,
    mixed_precision_sgd,
    mixed_precision_stages,
    regression_batches,
    residual_stages,
)

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.runtime.devices import logical_device_names


def _devices(count):
    return logical_device_names("CPU")[:count]


def test_stage_variables_and_optimizer_slots_live_on_the_stage_device():
    devices = _devices(2)
    model = PipelineModel(dense_stages(4), devices, 4, "interleaved_1f1b")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = regression_batches(1, 8)[0]
    model.train_on_batch(x, y)
    optimizer = model.optimizer
    for stage_index, stage in enumerate(model.stages):
        expected = device_index_of_name(devices[stage_index % 2])
        for variable in stage.trainable_variables:
            assert device_index(variable) == expected, variable.path
            slot_index = optimizer._get_variable_index(variable)
            for slots in (optimizer._momentums, optimizer._velocities):
                assert device_index(slots[slot_index]) == expected, slots[slot_index].path


def device_index_of_name(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


def test_fit_with_keras_callbacks_matches_one_device_history(tmp_path):
    # Two epochs of two steps each: enough for EarlyStopping, checkpoints and a backup to
    # act at an epoch boundary; every more step only traces and writes the same again.
    (x, y), (x_val, y_val) = regression_batches(2, 32, seed=3)
    reference = Chain(residual_stages(2))
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    model = PipelineModel(residual_stages(2), _devices(2), 4, "1f1b")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.h5"), save_weights_only=True),
        keras.callbacks.EarlyStopping(monitor="loss", patience=1),
        keras.callbacks.TensorBoard(str(tmp_path / "tensorboard")),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
    ]
    model(x[:16])  # BackupAndRestore, as for any subclassed Keras model, needs a built model.
    # Keras builds compiled metrics ("mae") at their first update: inside the first trace of
    # the training step, which tf.function then traces again (a function that made variables
    # is traced twice), the whole pipeline step twice. Evaluating first builds them in the
    # (cheaper) evaluation step, traced once for the validation too, and checks it.
    np.testing.assert_allclose(
        model.evaluate(x_val, y_val, batch_size=16, verbose=0),
        reference.evaluate(x_val, y_val, batch_size=16, verbose=0),
        rtol=1e-5,
    )
    fit_args = dict(batch_size=16, epochs=2, validation_data=(x_val, y_val), shuffle=False)
    history = model.fit(x, y, callbacks=callbacks, verbose=0, **fit_args)
    reference_history = reference.fit(x, y, verbose=0, **fit_args)
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(history.history[key], reference_history.history[key], rtol=1e-5)
    assert os.path.exists(tmp_path / "best.weights.h5")
    assert os.listdir(tmp_path / "tensorboard" / "train")


def test_evaluate_and_predict_match_one_device_model_with_the_same_weights():
    (x, y), _ = regression_batches(2, 24)
    model = PipelineModel(residual_stages(4), _devices(4), 4, "1f1b")
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    reference = Chain(residual_stages(4, seed=7))
    reference.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model(x[:4])
    reference(x[:4])
    reference.set_weights(model.get_weights())
    # 24 rows in batches of 16: the last batch of 8 is split, other sizes run whole.
    np.testing.assert_allclose(
        model.predict(x, batch_size=16, verbose=0),
        reference.predict(x, batch_size=16, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=12, verbose=0),
        reference.evaluate(x, y, batch_size=12, verbose=0),
        rtol=1e-5,
    )


def test_saved_weights_reload_into_a_new_pipeline_model(tmp_path):
    x, y = regression_batches(1, 16)[0]
    model = PipelineModel(dense_stages(2, seed=1), _devices(2), 2, "gpipe")
    model.compile(optimizer="adam", loss="mse")
    model.train_on_batch(x, y)
    path = str(tmp_path / "pipeline.weights.h5")
    model.save_weights(path)
    reloaded = PipelineModel(dense_stages(2, seed=2), _devices(2), 2, "gpipe")
    reloaded(x)
    assert max_weight_difference(model, reloaded) > 1e-3
    reloaded.load_weights(path)
    assert max_weight_difference(model, reloaded) == 0.0
    np.testing.assert_array_equal(model.predict(x, verbose=0), reloaded.predict(x, verbose=0))


def _sgd_gradients(model, x, y):
    """One SGD step with learning rate 1: the weight change is minus the gradient."""
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    model(x)
    before = model.get_weights()
    model.train_on_batch(x, y)
    return [b - a for a, b in zip(model.get_weights(), before, strict=True)]


@pytest.mark.parametrize(
    "schedule, remat", [("1f1b", True), ("zb_h1", True), ("gpipe", [True, False, True, False])]
)
def test_recomputation_gives_the_same_gradients_as_stored_activations(schedule, remat):
    x, y = regression_batches(1, 16)[0]
    stored = _sgd_gradients(PipelineModel(residual_stages(4), _devices(4), 4, schedule), x, y)
    recomputed = _sgd_gradients(
        PipelineModel(residual_stages(4), _devices(4), 4, schedule, remat=remat), x, y
    )
    assert max(np.abs(g).max() for g in stored) > 1e-4
    for first, second in zip(stored, recomputed, strict=True):
        np.testing.assert_allclose(first, second, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy, tolerance", MIXED_PRECISION_POLICIES)
def test_mixed_precision_trains_like_one_device_mixed_precision(policy, tolerance):
    batches = regression_batches(2, 16)
    model = PipelineModel(mixed_precision_stages(2, policy), _devices(2), 4, "1f1b")
    model.compile(optimizer=mixed_precision_sgd(policy), loss="mse")
    reference = Chain(mixed_precision_stages(2, policy))
    reference.compile(optimizer=mixed_precision_sgd(policy), loss="mse")
    for x, y in batches:
        loss = model.train_on_batch(x, y)
        reference.train_on_batch(x, y)
    assert np.isfinite(loss)
    assert model.stages[0].compute_dtype == policy.removeprefix("mixed_")
    assert max_weight_difference(model, reference) < tolerance


def test_model_parallel_runs_the_whole_batch_through_the_stages_in_turn():
    x, y = regression_batches(1, 16)[0]
    model = PipelineModel(dense_stages(4), _devices(2), 1, "model_parallel")
    reference = Chain(dense_stages(4))
    for m in (model, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.train_on_batch(x, y)
    assert model.schedule.stage_devices == (0, 1, 0, 1)
    assert max_weight_difference(model, reference) < 1e-6


@pytest.mark.parametrize(
    "num_stages, num_devices, num_microbatches, schedule, message",
    [
        (3, 2, 4, "1f1b", "multiple of the number of devices"),
        (2, 2, 4, "interleaved_1f1b", "is for 4 stages on 2 devices"),
        (4, 2, 4, "1f1b", "chunks must be 1"),
        (2, 2, 4, "pipedream", "Unknown schedule"),
        (2, 2, 4, "model_parallel", "num_microbatches must be 1"),
    ],
)
def test_error_names_stage_count_schedule_mismatch(
    num_stages, num_devices, num_microbatches, schedule, message
):
    with pytest.raises(ValueError, match=message):
        PipelineModel(dense_stages(num_stages), _devices(num_devices), num_microbatches, schedule)


def test_error_names_an_unknown_device():
    with pytest.raises(ValueError, match="Unknown device '/device:CPU:99'"):
        PipelineModel(dense_stages(2), ["/device:CPU:0", "/device:CPU:99"], 2)


def test_a_stage_built_off_its_device_is_moved_there():
    stages = dense_stages(2)
    with tf.device(_devices(2)[1]):
        stages[0].build((None, FEATURES))
    PipelineModel(stages, _devices(2), 2)
    assert {device_index(variable) for variable in stages[0].variables} == {("CPU", 0)}
