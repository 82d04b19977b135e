"""Promises of the datasets: shapes, fixed splits, exact file round trips, global batches."""

import numpy as np
import pytest
import tensorflow as tf
from sklearn.linear_model import LogisticRegression

from tfmulti.data import (
    TOKEN_RULE_PROBABILITY,
    first_training_examples,
    load_source,
    make_datasets,
    make_datasets_from_source,
    write_tfrecord_examples,
)
from tfmulti.data.info import make_array_data


def _batches(dataset, count):
    return [(x.numpy(), y.numpy()) for x, y in dataset.take(count)]


def _sorted_rows(x, y):
    """Examples and labels in a canonical order, to compare splits as sets."""
    flat = x.reshape(len(x), -1)
    order = np.lexsort(flat.T[::-1])
    return flat[order], y[order]


def test_digits_are_8x8x1_images_in_unit_range_with_10_classes():
    data = load_source("digits")
    assert data.x_train.shape == (1438, 8, 8, 1)
    assert data.x_validation.shape == (359, 8, 8, 1)
    assert data.x_train.dtype == np.float32
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    assert set(np.unique(data.y_train)) == set(range(10))
    assert data.info.num_classes == 10 and data.info.task == "classification"


def test_digits_read_from_the_bundled_file_equal_scikit_learns_load_digits():
    from sklearn.datasets import load_digits

    from tfmulti.data.digits import bundled_digits

    images, labels = bundled_digits()
    expected = load_digits()
    np.testing.assert_array_equal(images, expected.images)
    np.testing.assert_array_equal(labels, expected.target)


def test_digits_split_is_the_same_on_every_load():
    first, second = load_source("digits"), load_source("digits")
    np.testing.assert_array_equal(first.x_validation, second.x_validation)
    np.testing.assert_array_equal(first.y_train, second.y_train)


def test_synthetic_data_depends_only_on_its_seed():
    first = load_source("synthetic", seed=4, num_examples=64, input_shape=(3, 2))
    second = load_source("synthetic", seed=4, num_examples=64, input_shape=(3, 2))
    other = load_source("synthetic", seed=5, num_examples=64, input_shape=(3, 2))
    np.testing.assert_array_equal(first.x_train, second.x_train)
    np.testing.assert_array_equal(first.y_train, second.y_train)
    assert not np.array_equal(first.x_train, other.x_train)
    assert first.info.input_shape == (3, 2) and first.info.num_train_examples == 51


def test_synthetic_labels_are_learnable_by_a_linear_model():
    data = load_source("synthetic", num_examples=2000, input_shape=(16,), num_classes=4)
    classifier = LogisticRegression(max_iter=500).fit(data.x_train, data.y_train)
    # Chance is 0.25; the labels come from a linear teacher.
    assert classifier.score(data.x_validation, data.y_validation) > 0.8


def test_token_targets_are_the_inputs_shifted_by_one():
    data = load_source("tokens", num_examples=32, sequence_length=12, vocab_size=20)
    np.testing.assert_array_equal(data.x_train[:, 1:], data.y_train[:, :-1])
    assert data.info.task == "language_model" and data.info.input_shape == (12,)
    assert data.x_train.dtype == np.int32 and data.x_train.max() < 20


def test_next_token_is_predictable_from_the_training_bigrams():
    data = load_source("tokens", num_examples=400, sequence_length=16, vocab_size=16, seed=3)
    counts = np.zeros((16, 16), dtype=np.int64)
    np.add.at(counts, (data.x_train.ravel(), data.y_train.ravel()), 1)
    predicted = counts.argmax(axis=1)[data.x_validation]
    accuracy = (predicted == data.y_validation).mean()
    # The rule's own rate, plus the chance that a random token hits the successor.
    expected = TOKEN_RULE_PROBABILITY + (1 - TOKEN_RULE_PROBABILITY) / 16
    assert abs(accuracy - expected) < 0.03


def test_npz_round_trip_keeps_given_validation_arrays_exactly(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.random((20, 4, 3), dtype=np.float32), rng.integers(5, size=20)
    x_val, y_val = rng.random((6, 4, 3), dtype=np.float32), rng.integers(5, size=6)
    np.savez(tmp_path / "data.npz", x=x, y=y, x_val=x_val, y_val=y_val)
    data = load_source("npz", data_path=str(tmp_path / "data.npz"))
    np.testing.assert_array_equal(data.x_train, x)
    np.testing.assert_array_equal(data.y_train, y)
    np.testing.assert_array_equal(data.x_validation, x_val)
    np.testing.assert_array_equal(data.y_validation, y_val)
    assert data.info.input_shape == (4, 3) and data.info.num_classes == 5


def test_npz_without_validation_is_split_into_disjoint_parts_covering_all(tmp_path):
    x = np.arange(50, dtype=np.float32).reshape(25, 2)
    y = np.arange(25) % 3
    np.savez(tmp_path / "data.npz", x=x, y=y)
    data = load_source("npz", data_path=str(tmp_path / "data.npz"))
    assert data.info.num_train_examples == 20 and data.info.num_validation_examples == 5
    joined = _sorted_rows(
        np.concatenate([data.x_train, data.x_validation]),
        np.concatenate([data.y_train, data.y_validation]),
    )
    np.testing.assert_array_equal(joined[0], x)
    np.testing.assert_array_equal(joined[1], y)


def test_npz_with_integer_sequences_and_shifted_targets_is_a_language_model(tmp_path):
    tokens = np.arange(60).reshape(10, 6) % 7
    np.savez(tmp_path / "tokens.npz", x=tokens[:, :-1], y=tokens[:, 1:])
    data = load_source("npz", data_path=str(tmp_path / "tokens.npz"))
    assert data.info.task == "language_model"
    assert data.info.num_classes == 7 and data.info.x_dtype == "int32"


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((4, 2))}, r"lacks \['y'\]"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3, int)}, r"x.shape=\(4, 2\), y.shape=\(3,\)"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4, int), "x_val": np.zeros((2, 2))}, "neither"),
        (
            {
                "x": np.zeros((6, 2)),
                "y": np.zeros(6, int),
                "x_val": np.zeros((2, 3)),
                "y_val": np.zeros(2, int),
            },
            r"x_val.shape=\(2, 3\)",
        ),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4)}, "y.dtype=float64"),
    ],
)
def test_invalid_npz_contents_are_named_in_a_one_line_error(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=message) as error:
        load_source("npz", data_path=str(tmp_path / "bad.npz"))
    assert "\n" not in str(error.value)


def test_missing_npz_file_is_named_in_the_error(tmp_path):
    with pytest.raises(ValueError, match="missing.npz"):
        load_source("npz", data_path=str(tmp_path / "missing.npz"))
    with pytest.raises(ValueError, match="pass data_path"):
        load_source("npz")


def test_tfrecord_round_trip_reads_back_the_written_values(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.random((30, 3, 2), dtype=np.float32), rng.integers(4, size=30)
    write_tfrecord_examples(str(tmp_path / "a.tfrecord"), x[:12], y[:12])
    write_tfrecord_examples(str(tmp_path / "b.tfrecord"), x[12:], y[12:])
    for data_path in (str(tmp_path / "*.tfrecord"), f"{tmp_path}/b.tfrecord,{tmp_path}/a.tfrecord"):
        source = load_source("tfrecord", data_path=data_path)
        assert source.info.input_shape == (3, 2) and source.info.num_classes == 4
        assert source.info.num_train_examples == 24 and source.info.num_validation_examples == 6
        read = [(xs.numpy(), ys.numpy()) for xs, ys in source.train.concatenate(source.validation)]
        read_x = np.stack([example for example, _ in read])
        read_y = np.array([label for _, label in read])
        np.testing.assert_array_equal(_sorted_rows(read_x, read_y)[0], _sorted_rows(x, y)[0])
        np.testing.assert_array_equal(_sorted_rows(read_x, read_y)[1], _sorted_rows(x, y)[1])


def test_tfrecord_files_with_different_shapes_are_rejected(tmp_path):
    write_tfrecord_examples(str(tmp_path / "a.tfrecord"), np.zeros((3, 2)), np.zeros(3, int))
    write_tfrecord_examples(str(tmp_path / "b.tfrecord"), np.zeros((3, 4)), np.zeros(3, int))
    with pytest.raises(ValueError, match="share one shape"):
        load_source("tfrecord", data_path=str(tmp_path / "*.tfrecord"))


def test_tfrecord_pattern_matching_nothing_is_named_in_the_error(tmp_path):
    with pytest.raises(ValueError, match="nothing-here"):
        load_source("tfrecord", data_path=str(tmp_path / "nothing-here*.tfrecord"))


def test_tfrecord_training_batches_have_the_global_batch_size(tmp_path):
    x, y = np.arange(80, dtype=np.float32).reshape(40, 2), np.arange(40) % 2
    write_tfrecord_examples(str(tmp_path / "data.tfrecord"), x, y)
    data = make_datasets("tfrecord", 8, data_path=str(tmp_path / "data.tfrecord"))
    assert all(batch_x.shape == (8, 2) for batch_x, _ in _batches(data.train, 10))
    assert data.steps_per_epoch == 4 and data.validation_steps == 1


def test_training_batches_are_the_global_batch_across_epochs_and_validation_drops_the_rest():
    data = make_datasets("digits", 64, seed=0)
    assert data.steps_per_epoch == 1438 // 64
    train = _batches(data.train, 2 * data.steps_per_epoch + 1)
    assert all(x.shape == (64, 8, 8, 1) and y.shape == (64,) for x, y in train)
    validation = _batches(data.validation, 100)
    assert len(validation) == data.validation_steps == 359 // 64
    assert all(x.shape == (64, 8, 8, 1) for x, _ in validation)


def test_training_order_depends_only_on_the_seed():
    tf.random.set_seed(1)
    first = _batches(make_datasets("digits", 32, seed=7).train, 3)
    tf.random.set_seed(2)
    second = _batches(make_datasets("digits", 32, seed=7).train, 3)
    other = _batches(make_datasets("digits", 32, seed=8).train, 3)
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(first[0][0], other[0][0])


def test_each_pass_over_the_stream_holds_every_example_once_in_a_new_order():
    x = np.arange(12, dtype=np.float32)[:, None]
    arrays = make_array_data("ids", "classification", x, np.zeros(12, np.int32), x[:4], x[:4, 0], 2)
    data = make_datasets_from_source(arrays, 4, seed=0)
    ids = np.concatenate([batch_x[:, 0] for batch_x, _ in _batches(data.train, 6)])
    first_pass, second_pass = ids[:12], ids[12:]
    np.testing.assert_array_equal(np.sort(first_pass), np.arange(12))
    np.testing.assert_array_equal(np.sort(second_pass), np.arange(12))
    assert not np.array_equal(first_pass, second_pass)


def test_start_step_resumes_the_stream_where_it_left_off():
    uninterrupted = _batches(make_datasets("digits", 100, seed=3).train, 20)
    resumed = _batches(make_datasets("digits", 100, seed=3, start_step=15).train, 5)
    for (x1, y1), (x2, y2) in zip(uninterrupted[15:], resumed, strict=True):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


def test_shard_policy_is_set_on_both_datasets():
    data = make_datasets("digits", 32, shard_policy="data")
    for dataset in (data.train, data.validation):
        policy = dataset.options().experimental_distribute.auto_shard_policy
        assert policy == tf.data.experimental.AutoShardPolicy.DATA
    with pytest.raises(ValueError, match="'rows'"):
        make_datasets("digits", 32, shard_policy="rows")


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"Received: 'mnist'") as error:
        make_datasets("mnist", 32)
    assert "digits" in str(error.value)


def test_batch_larger_than_a_split_is_rejected_with_the_limit():
    with pytest.raises(ValueError, match="at most 359.*global_batch_size=512"):
        make_datasets("digits", 512)


def test_options_a_dataset_does_not_use_are_rejected():
    with pytest.raises(ValueError, match=r"does not use \['vocab_size'\]"):
        make_datasets("digits", 32, vocab_size=10)


@pytest.mark.parametrize(
    "name, write, message",
    [
        ("data.json", lambda path: path.write_text('{"x": [1]}'), "is not a .npz file"),
        ("one.npy", lambda path: np.save(path, np.zeros(3)), "holds one array"),
        ("empty.npz", lambda path: path.write_bytes(b""), "is not a .npz file"),
    ],
)
def test_a_file_that_is_not_an_npz_is_named_in_a_one_line_error(tmp_path, name, write, message):
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError, match=message) as error:
        load_source("npz", data_path=str(path))
    assert "\n" not in str(error.value) and "np.savez" in str(error.value)


USER_DATASETS = """
import numpy as np
import tensorflow as tf

X = np.arange(60, dtype="float32").reshape(20, 3)
Y = np.arange(20, dtype="int64") % 4


def pair():
    return (
        tf.data.Dataset.from_tensor_slices((X[:15], Y[:15])),
        tf.data.Dataset.from_tensor_slices((X[15:], Y[15:])),
    )


def one():
    return tf.data.Dataset.from_tensor_slices((X, Y))


def arrays():
    return (X[:15], Y[:15]), (X[15:], Y[15:])
"""


def test_first_training_examples_come_in_order_from_every_form_train_py_takes(
    tmp_path, monkeypatch
):
    (tmp_path / "user_datasets.py").write_text(USER_DATASETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    x = np.arange(60, dtype="float32").reshape(20, 3)
    y = np.arange(20) % 4
    # A pair and arrays train on their first part; one dataset holds its first tenth out.
    for function, first in (("pair", 0), ("arrays", 0), ("one", 2)):
        examples, labels = first_training_examples(load_source(f"user_datasets:{function}"), 8)
        np.testing.assert_array_equal(examples, x[first : first + 8])
        np.testing.assert_array_equal(labels, y[first : first + 8])
    # Fewer than asked: all there are.
    examples, _ = first_training_examples(load_source("user_datasets:pair"), 64)
    assert len(examples) == 15
    write_tfrecord_examples(str(tmp_path / "a.tfrecord"), x, y)
    record_examples, record_labels = first_training_examples(
        load_source("tfrecord", data_path=str(tmp_path / "a.tfrecord")), 3
    )
    # TFRecord holds every fifth record out, the first among them.
    np.testing.assert_array_equal(record_examples, x[[1, 2, 3]])
    np.testing.assert_array_equal(record_labels, y[[1, 2, 3]])
