"""Pipelines take any batch: a partial last batch, a batch that does not divide into
micro-batches, or fewer rows than micro-batches or replicas train, evaluate and predict like
one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import (
    FEATURES,
    OUTPUTS,
    Chain,
    dense_stages,
    max_weight_difference,
)

from tfmulti.hybrid import HybridPipelineModel, worker_rows
from tfmulti.parallel import place
from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.pipeline.runtime.microbatches import (
    concat_microbatches,
    even_sizes,
    microbatch_sizes,
    split_microbatches,
    split_padded_microbatches,
    trim_microbatches,
)
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.cluster import resolve_cluster
from tfmulti.platform.runtime.devices import logical_device_names
from tfmulti.strategies import check_batch_splits

ROWS = 100


def _data(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.normal(size=(rows, OUTPUTS)).astype("float32")
    weights = rng.uniform(0.0, 2.0, size=rows).astype("float32")
    return x, y, weights


def _optimizer(name):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def _reference_like(model, num_stages, x):
    """A one-device chain of the same layers, starting from `model`'s weights."""
    reference = Chain(dense_stages(num_stages))
    reference(x[:1])
    reference.set_weights(model.get_weights())
    return reference


def _fit_both(model, reference, optimizer, loss, x, y, weights, batch_size):
    histories = []
    for trained in (reference, model):
        trained.compile(optimizer=_optimizer(optimizer), loss=loss)
        history = trained.fit(
            x, y, sample_weight=weights, batch_size=batch_size, shuffle=False, verbose=0
        )
        histories.append(history.history["loss"])
    return histories


def _assert_trained_like(model, reference, initial, histories):
    moved = max(np.abs(a - b).max() for a, b in zip(initial, model.get_weights(), strict=True))
    assert moved > 1e-3
    assert max_weight_difference(reference, model) < 1e-5
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)


@pytest.mark.parametrize("rows, num_parts", [(30, 4), (4, 8), (0, 3), (17, 1), (64, 8)])
def test_even_sizes_differ_by_at_most_one_row_and_cover_the_batch(rows, num_parts):
    sizes = even_sizes(rows, num_parts)
    assert len(sizes) == num_parts and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    np.testing.assert_array_equal(even_sizes(tf.constant(rows), num_parts).numpy(), sizes)


def test_split_then_concat_returns_every_row_once_in_order():
    x = tf.reshape(tf.range(15 * 2), (15, 2))
    parts = split_microbatches((x, None), microbatch_sizes(x, 4))
    assert [int(part[0].shape[0]) for part in parts] == [4, 4, 4, 3]
    assert all(part[1] is None for part in parts)
    np.testing.assert_array_equal(concat_microbatches([p[0] for p in parts]).numpy(), x.numpy())


# Every schedule once, the awkward batches in rotation: 100 rows in batches of 32 with 8
# micro-batches (the last batch has 4 rows, so half its micro-batches are empty) and
# batches of 30 with 4 micro-batches (8, 8, 7, 7 rows; the last batch 10 rows). Each
# batching runs with SGD and with Adam, with sample weights and without.
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1)]
UNEVEN_BATCHES = [(32, 8), (30, 4)]
OPTIONS = [("sgd", True), ("sgd", False), ("adam", False), ("adam", True)]
GRID = [
    (schedule, chunks, *UNEVEN_BATCHES[index % 2], *OPTIONS[index % 4])
    for index, (schedule, chunks) in enumerate(SCHEDULES)
]


@pytest.mark.parametrize(
    "schedule, chunks, batch_size, num_microbatches, optimizer, weighted", GRID
)
def test_fit_on_uneven_batches_matches_one_device_training(
    schedule, chunks, batch_size, num_microbatches, optimizer, weighted
):
    x, y, weights = _data()
    model = PipelineModel(
        dense_stages(2 * chunks), logical_device_names("CPU")[:2], num_microbatches, schedule
    )
    model(x[:1])
    reference = _reference_like(model, 2 * chunks, x)
    initial = model.get_weights()
    histories = _fit_both(
        model, reference, optimizer, "mse", x, y, weights if weighted else None, batch_size
    )
    _assert_trained_like(model, reference, initial, histories)


def test_a_batch_with_fewer_rows_than_microbatches_trains_like_one_device():
    x, y, _ = _data(3)
    model = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 8, "zb_h1")
    model(x)
    reference = _reference_like(model, 2, x)
    initial = model.get_weights()
    losses = []
    for trained in (reference, model):
        trained.compile(optimizer=_optimizer("sgd"), loss="mse")
        losses.append([trained.train_on_batch(x, y) for _ in range(2)])
    _assert_trained_like(model, reference, initial, losses)


def test_predict_and_evaluate_take_any_batch_and_keep_every_row_in_order():
    x, y, weights = _data(37)
    model = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 8, "1f1b")
    model(x[:1])
    reference = _reference_like(model, 2, x)
    for compiled in (model, reference):
        compiled.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    predictions = model.predict(x, batch_size=16, verbose=0)
    assert predictions.shape == (37, OUTPUTS)
    np.testing.assert_allclose(
        predictions, reference.predict(x, batch_size=16, verbose=0), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        model.evaluate(x, y, sample_weight=weights, batch_size=16, verbose=0),
        reference.evaluate(x, y, sample_weight=weights, batch_size=16, verbose=0),
        rtol=1e-6,
    )


def test_a_mean_with_sample_weight_loss_weights_microbatches_by_their_sample_weights():
    x, y, weights = _data()
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    model = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 4, "gpipe")
    model(x[:1])
    reference = _reference_like(model, 2, x)
    initial = model.get_weights()
    histories = _fit_both(model, reference, "sgd", loss, x, y, weights, 30)
    _assert_trained_like(model, reference, initial, histories)


def _batch_mean_squared_error(y_true, y_pred):
    # One mean over the whole batch: 0/0 = NaN on an empty micro-batch.
    return tf.reduce_mean(tf.square(y_true - y_pred))


def test_empty_microbatches_add_no_nan_when_the_loss_is_a_mean_over_no_rows():
    x, y, _ = _data()
    model = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 8, "1f1b")
    model(x[:1])
    reference = _reference_like(model, 2, x)
    initial = model.get_weights()
    histories = _fit_both(model, reference, "sgd", _batch_mean_squared_error, x, y, None, 32)
    assert np.isfinite(histories[1]).all()
    _assert_trained_like(model, reference, initial, histories)


def test_padded_split_gives_rowless_parts_a_padding_row_that_trimming_removes():
    x = tf.reshape(tf.range(3 * 2), (3, 2))
    for sizes in (even_sizes(3, 5), even_sizes(tf.constant(3), 5)):
        parts = split_padded_microbatches((x, None), sizes)
        assert [int(tf.shape(part[0])[0]) for part in parts] == [1, 1, 1, 1, 1]
        assert all(part[1] is None for part in parts)
        trimmed = trim_microbatches([part[0] for part in parts], sizes)
        np.testing.assert_array_equal(concat_microbatches(trimmed).numpy(), x.numpy())


def _batch_norm_pipeline(num_microbatches):
    keras.utils.set_random_seed(3)
    stages = [
        keras.Sequential([keras.layers.Dense(4), keras.layers.BatchNormalization()]),
        keras.Sequential([keras.layers.Dense(OUTPUTS)]),
    ]
    model = PipelineModel(stages, logical_device_names("CPU")[:2], num_microbatches, "1f1b")
    model.compile(optimizer=_optimizer("adam"), loss="mse")
    return model


def test_batch_norm_trains_on_a_batch_with_fewer_rows_than_microbatches():
    # 2 rows in 4 micro-batches: two run on one row each, two on a padding row. The padding
    # adds nothing: the weights equal 2 micro-batches of one row (BatchNorm normalizes each
    # micro-batch alone, so both pipelines see the same statistics). Before the padding,
    # BatchNorm's mean over no rows made the weights NaN.
    x, y, _ = _data(2)
    padded, exact = _batch_norm_pipeline(4), _batch_norm_pipeline(2)
    exact(x[:1])
    padded(x[:1])
    padded.set_weights(exact.get_weights())
    initial = exact.get_weights()
    for model in (padded, exact):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for stage_padded, stage_exact in zip(padded.stages, exact.stages, strict=True):
        for a, b in zip(stage_padded.trainable_weights, stage_exact.trainable_weights, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(w).all() for w in padded.get_weights())
    trained = exact.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(initial, trained, strict=True)) > 1e-3


def test_a_summed_loss_is_refused_in_one_line_naming_the_reduction():
    x, y, _ = _data(8)
    model = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 4, "1f1b")
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(ValueError, match=r"Received: loss reductions=\['sum'\]; use"):
        model.train_on_batch(x, y)


def _hybrid(num_microbatches, schedule):
    mesh = parse_mesh("data=2,pipe=2")
    devices = logical_device_names("CPU")[: mesh.num_devices]
    return HybridPipelineModel(
        lambda: dense_stages(2), mesh.replica_devices(devices), num_microbatches, schedule
    )


def _assert_replicas_identical(hybrid):
    first = hybrid.replicas[0].get_weights()
    for replica in hybrid.replicas[1:]:
        for expected, actual in zip(first, replica.get_weights(), strict=True):
            np.testing.assert_array_equal(actual, expected)


def test_hybrid_fit_with_a_partial_last_batch_matches_one_device_training():
    # Batches of 30 rows: 15 per replica in micro-batches of 4, 4, 4, 3; the last batch
    # of 10 rows gives each replica 5, in micro-batches of 2, 1, 1, 1.
    x, y, weights = _data()
    hybrid = _hybrid(4, "1f1b")
    hybrid(x[:2])
    reference = _reference_like(hybrid.replicas[0], 2, x)
    initial = hybrid.replicas[0].get_weights()
    histories = _fit_both(hybrid, reference, "adam", "mse", x, y, weights, 30)
    _assert_trained_like(hybrid.replicas[0], reference, initial, histories)
    _assert_replicas_identical(hybrid)


def test_hybrid_batch_with_fewer_rows_than_replicas_trains_like_one_device():
    x, y, _ = _data(1)
    hybrid = _hybrid(2, "zb_h1")
    hybrid(x)
    reference = _reference_like(hybrid.replicas[0], 2, x)
    initial = hybrid.replicas[0].get_weights()
    losses = []
    for trained in (reference, hybrid):
        trained.compile(optimizer=_optimizer("sgd"), loss="mse")
        losses.append([trained.train_on_batch(x, y) for _ in range(2)])
    _assert_trained_like(hybrid.replicas[0], reference, initial, losses)
    _assert_replicas_identical(hybrid)


def test_hybrid_predict_and_evaluate_take_any_batch():
    x, y, _ = _data(37)
    hybrid = _hybrid(2, "gpipe")
    hybrid(x[:2])
    reference = _reference_like(hybrid.replicas[0], 2, x)
    for compiled in (hybrid, reference):
        compiled.compile(optimizer="sgd", loss="mse")
    predictions = hybrid.predict(x, batch_size=16, verbose=0)
    assert predictions.shape == (37, OUTPUTS)
    np.testing.assert_allclose(
        predictions, reference.predict(x, batch_size=16, verbose=0), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        hybrid.evaluate(x, y, batch_size=16, verbose=0),
        reference.evaluate(x, y, batch_size=16, verbose=0),
        rtol=1e-6,
    )


def _functional_model():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(
        8, "tanh", kernel_initializer=keras.initializers.GlorotUniform(1), name="hidden"
    )(inputs)
    outputs = keras.layers.Dense(
        OUTPUTS, kernel_initializer=keras.initializers.GlorotUniform(2), name="head"
    )(hidden)
    return keras.Model(inputs, outputs)


def test_placed_model_fits_a_partial_last_batch_like_the_unplaced_model():
    x, y, weights = _data()
    reference = _functional_model()
    placed = place(_functional_model(), {"hidden": 0, "head": 1}, devices=[0, 1], print_fn=None)
    initial = placed.get_weights()
    histories = _fit_both(placed, reference, "adam", "mse", x, y, weights, 32)
    _assert_trained_like(placed, reference, initial, histories)
    np.testing.assert_allclose(
        placed.predict(x[:37], batch_size=16, verbose=0),
        reference.predict(x[:37], batch_size=16, verbose=0),
        rtol=1e-6,
        atol=1e-7,
    )


def test_flag_check_refuses_only_a_batch_that_leaves_a_microbatch_without_rows():
    check_batch_splits(30, 4, "4 micro-batches (--microbatches)")
    with pytest.raises(ValueError, match=r"Received: batch_size=3; use at least 4\.$"):
        check_batch_splits(3, 4, "4 micro-batches (--microbatches)")


def test_workers_share_a_partial_batch_as_evenly_as_possible_without_losing_a_row():
    x = np.arange(15, dtype="float32").reshape(15, 1)
    dataset = tf.data.Dataset.from_tensor_slices((x, -x)).batch(8)
    shares = [
        [bx.numpy().ravel().tolist() for bx, _ in worker_rows(dataset, cluster)]
        for cluster in (resolve_cluster(["h:1", "h:2"], task_index=rank) for rank in (0, 1))
    ]
    assert shares == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14]]]
