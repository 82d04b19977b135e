"""Hybrid data x pipeline parallelism on one host: weights equal one-device training with the
same global batch, copies stay identical, each copy lives on its mesh devices, clear errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import (
    Chain,
    dense_stages,
    device_index,
    max_weight_difference,
    regression_batches,
    residual_stages,
)

from tfmulti.hybrid import HybridPipelineModel, build_hybrid_model
from tfmulti.platform.mesh import MeshError, parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names

STEPS = 2
GLOBAL_BATCH = 16


def _optimizer(name):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def _hybrid(make_stages, mesh_text, num_microbatches, schedule):
    mesh = parse_mesh(mesh_text)
    devices = logical_device_names("CPU")[: mesh.num_devices]
    return HybridPipelineModel(
        make_stages, mesh.replica_devices(devices), num_microbatches, schedule
    )


def _train_both(make_stages, mesh_text, num_microbatches, schedule, optimizer, batches):
    reference = Chain(make_stages())
    reference.compile(optimizer=_optimizer(optimizer), loss="mse")
    hybrid = _hybrid(make_stages, mesh_text, num_microbatches, schedule)
    hybrid.compile(optimizer=_optimizer(optimizer), loss="mse")
    reference(batches[0][0])
    hybrid(batches[0][0])
    initial = [w.copy() for w in hybrid.replicas[0].get_weights()]
    for batch in batches:
        reference_loss = reference.train_on_batch(*batch)
        hybrid_loss = hybrid.train_on_batch(*batch)
    return reference, hybrid, initial, reference_loss, hybrid_loss


def _assert_replicas_identical(hybrid):
    first = hybrid.replicas[0].get_weights()
    for replica in hybrid.replicas[1:]:
        for expected, actual in zip(first, replica.get_weights(), strict=True):
            np.testing.assert_array_equal(actual, expected)


# Each schedule once, each optimizer on some (one executor runs every schedule).
@pytest.mark.parametrize(
    "schedule, chunks, optimizer",
    [
        ("gpipe", 1, "adam"),
        ("1f1b", 1, "sgd"),
        ("zb_h1", 1, "adam"),
        ("zb_h2", 1, "sgd"),
        ("interleaved_1f1b", 2, "adam"),
    ],
)
def test_data2_pipe2_weights_match_one_device_training_for_every_schedule(
    schedule, chunks, optimizer
):
    reference, hybrid, initial, reference_loss, hybrid_loss = _train_both(
        lambda: dense_stages(2 * chunks),
        "data=2,pipe=2",
        4,
        schedule,
        optimizer,
        regression_batches(STEPS, GLOBAL_BATCH),
    )
    trained = hybrid.replicas[0].get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(initial, trained, strict=True)) > 1e-3
    assert max_weight_difference(reference, hybrid.replicas[0]) < 1e-5
    _assert_replicas_identical(hybrid)
    np.testing.assert_allclose(hybrid_loss, reference_loss, rtol=1e-5)


def test_data4_pipe2_with_residual_norm_blocks_matches_one_device_training():
    reference, hybrid, _, reference_loss, hybrid_loss = _train_both(
        lambda: residual_stages(2),
        "data=4,pipe=2",
        2,
        "1f1b",
        "adam",
        regression_batches(STEPS, GLOBAL_BATCH),
    )
    assert len(hybrid.replicas) == 4
    assert max_weight_difference(reference, hybrid.replicas[0]) < 1e-5
    _assert_replicas_identical(hybrid)
    np.testing.assert_allclose(hybrid_loss, reference_loss, rtol=1e-5)


VOCABULARY = 12


def _embedding_stages():
    initializer = keras.initializers.RandomNormal(seed=3)
    return [
        keras.Sequential(
            [
                keras.layers.Embedding(VOCABULARY, 4, embeddings_initializer=initializer),
                keras.layers.GlobalAveragePooling1D(),
            ]
        ),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(4)),
    ]


def test_sparse_embedding_gradients_average_like_one_device_training():
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.integers(0, VOCABULARY, size=(GLOBAL_BATCH, 5)).astype("int32"),
            rng.normal(size=(GLOBAL_BATCH, 2)).astype("float32"),
        )
        for _ in range(STEPS)
    ]
    reference, hybrid, _, reference_loss, hybrid_loss = _train_both(
        _embedding_stages, "data=2,pipe=2", 2, "zb_h1", "adam", batches
    )
    assert max_weight_difference(reference, hybrid.replicas[0]) < 1e-5
    _assert_replicas_identical(hybrid)
    np.testing.assert_allclose(hybrid_loss, reference_loss, rtol=1e-5)


def test_fit_with_sample_weights_matches_one_device_fit():
    batches = regression_batches(STEPS, GLOBAL_BATCH)
    x = np.concatenate([x for x, _ in batches])
    y = np.concatenate([y for _, y in batches])
    weights = np.random.default_rng(1).uniform(0.0, 2.0, size=len(x)).astype("float32")
    reference = Chain(dense_stages(2))
    hybrid = _hybrid(lambda: dense_stages(2), "data=2,pipe=2", 2, "1f1b")
    histories = []
    for model in (reference, hybrid):
        model.compile(optimizer=_optimizer("adam"), loss="mse")
        histories.append(
            model.fit(
                x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0
            )
        )
    assert max_weight_difference(reference, hybrid.replicas[0]) < 1e-5
    np.testing.assert_allclose(
        histories[1].history["loss"], histories[0].history["loss"], rtol=1e-5
    )


def _batch_norm_stages():
    return [
        keras.Sequential(
            [
                keras.layers.Dense(8, kernel_initializer=keras.initializers.GlorotUniform(5)),
                keras.layers.BatchNormalization(),
            ]
        ),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(6)),
    ]


def test_batch_norm_moving_mean_is_averaged_over_replicas_so_copies_stay_identical():
    # One step with one micro-batch: the mean of the replicas' batch means is the global
    # batch mean, so the moving mean equals one-device training's.
    reference, hybrid, _, _, _ = _train_both(
        _batch_norm_stages, "data=2,pipe=2", 1, "1f1b", "sgd", regression_batches(1, 16)
    )
    _assert_replicas_identical(hybrid)
    norm = hybrid.replicas[0].stages[0].layers[1]
    reference_norm = reference.chained[0].layers[1]
    assert np.abs(norm.moving_mean.numpy()).max() > 1e-4
    np.testing.assert_allclose(
        norm.moving_mean.numpy(), reference_norm.moving_mean.numpy(), rtol=1e-5, atol=1e-7
    )


def test_predict_and_evaluate_split_the_batch_over_replicas_like_one_model():
    x, y = regression_batches(1, GLOBAL_BATCH)[0]
    reference = Chain(dense_stages(2))
    hybrid = _hybrid(lambda: dense_stages(2), "data=2,pipe=2", 2, "1f1b")
    for model in (reference, hybrid):
        model.compile(optimizer="sgd", loss="mse")
    np.testing.assert_allclose(
        hybrid.predict(x, batch_size=8, verbose=0),
        reference.predict(x, batch_size=8, verbose=0),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        hybrid.evaluate(x, y, batch_size=8, verbose=0),
        reference.evaluate(x, y, batch_size=8, verbose=0),
        rtol=1e-6,
    )


def test_replica_r_stage_s_variables_live_on_device_r_times_pipe_plus_s_slots_with_replica_0():
    devices = logical_device_names("CPU")[:6]
    hybrid = build_hybrid_model(
        lambda: dense_stages(2), "data=3,pipe=2", 2, "1f1b", devices=devices
    )
    hybrid.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    hybrid.train_on_batch(*regression_batches(1, 12)[0])
    optimizer = hybrid.optimizer
    for replica_index, replica in enumerate(hybrid.replicas):
        for stage_index, stage in enumerate(replica.stages):
            expected = tf.DeviceSpec.from_string(devices[replica_index * 2 + stage_index])
            for variable in stage.trainable_variables:
                assert device_index(variable) == ("CPU", expected.device_index), variable.path
                if replica_index:
                    # The other copies take replica 0's updated values: no slots of their own.
                    with pytest.raises(KeyError):
                        optimizer._get_variable_index(variable)
                    continue
                slot = optimizer._get_variable_index(variable)
                for slots in (optimizer._momentums, optimizer._velocities):
                    assert device_index(slots[slot]) == ("CPU", expected.device_index)


def test_copies_start_from_replica_zero_weights_even_from_unseeded_layers():
    hybrid = _hybrid(
        lambda: [keras.layers.Dense(8), keras.layers.Dense(2)], "data=2,pipe=2", 1, "gpipe"
    )
    hybrid(regression_batches(1, 4)[0][0])
    _assert_replicas_identical(hybrid)


@pytest.mark.parametrize(
    "mesh_text, message",
    [
        ("data=2,pipe=2", r"needs data x pipe x tensor = 4 devices, but 1 worker\(s\) x 6"),
        ("data=3,pipe=2,tensor=1,pipe=1", "names axis 'pipe' twice"),
        ("data=3,pipe=1,tensor=2", r"needs a model built from split layers .*use tensor=1"),
    ],
)
def test_a_mesh_that_does_not_fit_the_devices_gives_one_clear_error(mesh_text, message):
    with pytest.raises(MeshError, match=message):
        build_hybrid_model(
            lambda: dense_stages(2),
            mesh_text,
            2,
            devices=logical_device_names("CPU")[:6],
        )


def test_wrong_number_of_partition_boundaries_names_the_stage_count():
    with pytest.raises(ValueError, match=r"makes 4 stages, which need 3 boundaries"):
        build_hybrid_model(
            lambda: dense_stages(4),
            "data=2,pipe=2",
            4,
            "interleaved_1f1b",
            chunks=2,
            partition_boundaries=[2],
            devices=logical_device_names("CPU")[:4],
        )


def test_global_clipnorm_clips_one_copys_gradients_as_on_one_device():
    # The optimizer holds one copy: a global norm over every copy's gradients would be
    # sqrt(2) times too large, and clip differently from one device.
    batches = regression_batches(STEPS, GLOBAL_BATCH)
    models = [Chain(dense_stages(2)), _hybrid(lambda: dense_stages(2), "data=2,pipe=2", 2, "1f1b")]
    for model in models:
        model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.05), loss="mse")
        model(batches[0][0])
    for batch in batches:
        for model in models:
            model.train_on_batch(*batch)
    reference, hybrid = models
    assert len(hybrid.optimizer.variables) == len(reference.optimizer.variables)
    assert max_weight_difference(reference, hybrid.replicas[0]) < 1e-6
    _assert_replicas_identical(hybrid)
