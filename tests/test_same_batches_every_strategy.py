"""Every strategy of `scripts/train.py` trains on the same global batches, in the same order.

Each run takes one step per epoch, so every epoch's loss in `metrics.json` is one step's
loss; a strategy that fed other rows, or the same rows in another order, would record
other losses than the one-device run of the same flags. Streamed data (a TFRecord file,
a user's tf.data datasets that reshuffle on each iteration) is where a strategy could
see other batches: arrays are covered by the strategies' own tests. The `user` runs are
also test_user_models_script.py's check that mirrored, model_parallel, hybrid and two
launched workers train a user's model like one device.
"""

import os
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from script_runner import launch_training, read_metrics, run_script

from tfmulti import data as data_lib
from tfmulti.data import write_tfrecord_examples

USER_MODULE = textwrap.dedent(
    """
    import keras
    import numpy as np
    import tensorflow as tf


    def build():
        seeded = lambda seed: keras.initializers.GlorotUniform(seed=seed)
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(32, activation="relu", kernel_initializer=seeded(1),
                               name="stem")(x)
        block = keras.layers.Dense(32, activation="relu", kernel_initializer=seeded(2),
                                   name="block")(x)
        x = keras.layers.Add(name="residual")([x, block])
        return keras.Model(inputs, keras.layers.Dense(10, kernel_initializer=seeded(3),
                                                      name="head")(x))


    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(360, 8, 8, 1)).astype("float32")
        y = x.reshape(360, -1)[:, :10].argmax(1).astype("int64")
        # Reshuffled on each iteration, as tf.data shuffles by default.
        train = tf.data.Dataset.from_tensor_slices((x[:288], y[:288])).shuffle(288, seed=7)
        return train, tf.data.Dataset.from_tensor_slices((x[288:], y[288:]))


    def layout_map(device_mesh):
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map["stem/kernel"] = (None, "model")
        layout_map["stem/bias"] = ("model",)
        layout_map["head/kernel"] = ("model", None)
        return layout_map
    """
)
STEPS = 6  # One pass over the 288 training rows is 4.5 batches: the runs cross into a second.
COMMON = (
    "--batch_size=64",
    "--steps_per_epoch=1",
    f"--epochs={STEPS}",
    "--validation_steps=1",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--seed=2",
    "--log_steps=0",
)
DATASETS = {
    "tfrecord": ("--model=mlp", "--dataset=tfrecord", "--layout_map=user_layouts:mlp_layout_map"),
    "user": (
        "--model=user_batches:build",
        "--dataset=user_batches:data",
        "--layout_map=user_batches:layout_map",
    ),
}
STRATEGIES = {
    "mirrored": ("--strategy=mirrored", "--virtual_devices=2"),
    "pipeline": (
        "--strategy=pipeline",
        "--virtual_devices=2",
        "--num_stages=2",
        "--microbatches=2",
    ),
    "model_parallel": ("--strategy=model_parallel", "--virtual_devices=2", "--num_stages=2"),
    "hybrid": (
        "--strategy=hybrid",
        "--mesh=data=2,pipe=2",
        "--virtual_devices=4",
        "--microbatches=2",
    ),
    "keras_model_parallel": ("--strategy=keras_model_parallel", "--virtual_devices=2"),
}


@pytest.fixture(scope="module")
def user_project(shared_dir):
    """A folder with the user's module and a TFRecord file of the documented format."""

    def fill(directory: str) -> None:
        with open(os.path.join(directory, "user_batches.py"), "w") as handle:
            handle.write(USER_MODULE)
        rng = np.random.default_rng(1)
        write_tfrecord_examples(
            os.path.join(directory, "examples.tfrecord"),
            rng.normal(size=(360, 8, 8, 1)),
            rng.integers(0, 10, size=360),
        )

    directory = shared_dir("same_batches-user_project", fill)
    return directory, os.path.join(directory, "examples.tfrecord")


def _train_args(user_project, dataset: str, model_dir: str) -> tuple[list[str], str]:
    _, records = user_project
    model, data, layout_map = DATASETS[dataset]
    args = [*COMMON, model, data, f"--model_dir={model_dir}"]
    if dataset == "tfrecord":
        args.append(f"--data_path={records}")
    return args, layout_map


def _environment(user_project) -> dict:
    directory, _ = user_project
    tests_user_code = os.path.join(os.path.dirname(__file__), "user_code")
    return {"PYTHONPATH": os.pathsep.join([str(directory), tests_user_code])}


def _step_losses(model_dir: str) -> list[float]:
    metrics = read_metrics(model_dir)
    assert metrics["status"] == "completed"
    return [epoch["loss"] for epoch in metrics["epochs"]]


@pytest.fixture(scope="module")
def one_device_losses(user_project, shared_dir):
    """`one_device_losses(dataset)`: per-step losses of the one-device run of that dataset."""

    def losses(dataset: str) -> list[float]:
        def fill(directory: str) -> None:
            args, _ = _train_args(user_project, dataset, f"{directory}/run")
            result = run_script(
                "train.py", *args, "--strategy=one_device", env=_environment(user_project)
            )
            assert result.returncode == 0, result.stderr[-3000:]
            assert "Traceback" not in result.stderr

        step_losses = _step_losses(f"{shared_dir(f'same_batches-one_device-{dataset}', fill)}/run")
        assert len(step_losses) == STEPS
        return step_losses

    return losses


# Every strategy once, each dataset on its own paths: the user's data under mirrored,
# pipeline, model_parallel and hybrid (test_user_models_script.py counts on these), the
# TFRecord file under the two ways a batch is split over replicas, tf.distribute's
# (mirrored) and Keras's distribution (keras_model_parallel, the one run of it here).
# Hybrid splits rows itself, on the user's reshuffled data. A staged model (pipeline,
# model_parallel) takes the whole global batch whatever its source.
SWEEP = [
    *(("user", s) for s in ("hybrid", "mirrored", "model_parallel", "pipeline")),
    *(("tfrecord", s) for s in ("keras_model_parallel", "mirrored")),
]


@pytest.mark.parametrize("dataset, strategy", SWEEP)
def test_every_strategy_trains_on_the_one_device_batches_step_by_step(
    tmp_path, user_project, one_device_losses, dataset, strategy
):
    model_dir = str(tmp_path / "run")
    args, layout_map = _train_args(user_project, dataset, model_dir)
    if strategy == "keras_model_parallel":
        args.append(layout_map)
    result = run_script("train.py", *args, *STRATEGIES[strategy], env=_environment(user_project))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert _step_losses(model_dir) == pytest.approx(one_device_losses(dataset), rel=1e-4)


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_two_launched_workers_train_on_the_one_device_batches_step_by_step(
    tmp_path, user_project, one_device_losses, dataset, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", _environment(user_project)["PYTHONPATH"])
    model_dir = str(tmp_path / "run")
    args, _ = _train_args(user_project, dataset, model_dir)
    code, output = launch_training(*args, "--strategy=multi_worker", devices_per_worker=1)
    assert code == 0, output[-3000:]
    assert _step_losses(model_dir) == pytest.approx(one_device_losses(dataset), rel=1e-4)


def _reshuffled_rows() -> tf.data.Dataset:
    rows = np.arange(32, dtype="float32").reshape(16, 2)
    return tf.data.Dataset.from_tensor_slices((rows, rows[:, :1])).shuffle(16, seed=3).batch(4)


def _first_step_rows(strategy) -> np.ndarray:
    """The rows of `fit`'s first step, under `strategy` (None: no strategy)."""
    seen = []

    class RecordRows(keras.Model):
        def train_step(self, data):
            tf.py_function(lambda x: seen.append(x.numpy()), [data[0]], [])
            return super().train_step(data)

    def build():
        inputs = keras.Input((2,))
        model = RecordRows(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
        return model

    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.fit(_reshuffled_rows(), steps_per_epoch=1, epochs=1, verbose=0)
    return seen[0]


def test_fit_under_a_strategy_starts_on_the_batch_it_starts_on_without_one():
    expected = _first_step_rows(None)
    np.testing.assert_array_equal(
        _first_step_rows(tf.distribute.OneDeviceStrategy("/cpu:0")), expected
    )


def test_a_validation_set_of_unknown_size_is_evaluated_every_epoch_under_a_strategy():
    x = np.ones((12, 2), "float32")
    # `filter` hides the size from Keras, as a split read from files does.
    validation = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).filter(lambda *_: True)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    train = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4).repeat()
    history = model.fit(
        train,
        steps_per_epoch=2,
        epochs=3,
        validation_data=validation.batch(4),
        validation_steps=3,
        verbose=0,
    )
    assert len(history.history["val_loss"]) == 3


def test_a_training_set_that_runs_out_ends_with_keras_warning():
    x = np.ones((8, 2), "float32")
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    train = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(train.filter(lambda *_: True), steps_per_epoch=2, epochs=3, verbose=0)
        model.fit(train.take(0), steps_per_epoch=2, epochs=1, verbose=0)
    assert any("ran out of data" in str(warning.message) for warning in caught)


def _streamed_train(**options) -> tf.data.Dataset:
    """Training batches of 8 of 20 streamed rows whose first column is 0, 2, ..., 38."""
    rows = np.arange(40, dtype="float32").reshape(20, 2)
    labels = rows[:, 0].astype("int64")
    source = data_lib.StreamData(
        tf.data.Dataset.from_tensor_slices((rows, labels)),
        tf.data.Dataset.from_tensor_slices((rows[:8], labels[:8])),
        data_lib.DataInfo(
            name="rows",
            task="regression",
            input_shape=(2,),
            num_classes=0,
            num_train_examples=20,
            num_validation_examples=8,
            x_dtype="float32",
        ),
    )
    return data_lib.make_datasets_from_source(source, 8, seed=5, **options).train


def _labels(train: tf.data.Dataset, steps: int = 6) -> list[list[int]]:
    return [labels.numpy().tolist() for _, labels in train.take(steps)]


def test_streamed_batches_are_the_same_on_every_new_iterator(tmp_path):
    train = _streamed_train()
    assert _labels(train) == _labels(train)
    records = str(tmp_path / "rows.tfrecord")
    write_tfrecord_examples(records, np.zeros((50, 2)), np.arange(50))
    source = data_lib.load_source("tfrecord", data_path=records)
    train = data_lib.make_datasets_from_source(source, 8, seed=5).train
    assert _labels(train) == _labels(train)


def test_streamed_batches_resume_at_start_step_and_reshuffle_each_pass():
    labels = _labels(_streamed_train())
    assert _labels(_streamed_train(start_step=3), steps=3) == labels[3:]
    flat = sum(labels, [])
    assert sorted(flat[:20]) == sorted(flat[20:40]) == list(range(0, 40, 2))
    assert flat[:20] != flat[20:40]
