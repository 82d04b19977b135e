"""`scripts/train.py --model=module:function --dataset=module:function`: your model and data.

The user's module is written by the test into a temporary directory on PYTHONPATH, as a
user's project would be. Every strategy that takes the user's model must train it to the
one-device losses; bad modules are one line each and leave --model_dir untouched.
Mirrored, model_parallel and hybrid (with the flags used here) and two launched workers
train a user's model and data like one device, step by step, in
test_same_batches_every_strategy.py; here are the pipeline's own ways of splitting it. The
chunked schedules (ZB-V, DualPipeV) take the same path from the script as 1F1B: the script
runs them on the reference model (test_zbv.py, test_dualpipev.py) and a whole user model
trains under each in process (`test_a_whole_model_from_model_trains_to_the_weights_of_one_device`
in test_zbv.py).
"""

import os
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from script_runner import (
    assert_same_training,
    assert_split_recorded,
    last_line,
    read_metrics,
    run_script,
    user_module_environment,
)

USER_MODULE = textwrap.dedent(
    """
    import keras
    import numpy as np
    import tensorflow as tf


    def small_mlp(width=32):
        seeded = lambda seed: keras.initializers.GlorotUniform(seed=seed)
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(width, activation="relu", kernel_initializer=seeded(1),
                               name="hidden_1")(x)
        x = keras.layers.Dense(width, activation="relu", kernel_initializer=seeded(2),
                               name="hidden_2")(x)
        return keras.Model(inputs, keras.layers.Dense(10, kernel_initializer=seeded(3))(x))


    def compiled_regressor():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model


    def arrays():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(400, 8, 8, 1)).astype("float32")
        return x, x.reshape(400, -1)[:, :10].argmax(1).astype("int64")


    def regression_arrays():
        x, y = arrays()
        return x, y.astype("float32")


    def dataset_pair():
        x, y = arrays()
        return (tf.data.Dataset.from_tensor_slices((x[:300], y[:300])),
                tf.data.Dataset.from_tensor_slices((x[300:], y[300:])))


    def not_a_model(width=16):
        return {"layers": 3, "width": width}


    def not_data():
        return "digits"


    def sixty_labels():
        x, y = arrays()
        return x, y + 50
    """
)
STEPS_PER_EPOCH = 2
RUN = (
    "--dataset=user_models:arrays",
    "--batch_size=32",
    f"--steps_per_epoch={STEPS_PER_EPOCH}",
    "--epochs=2",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--log_steps=0",
)
MLP = ("--model=user_models:small_mlp", "--model_option=width=16", *RUN)


@pytest.fixture(scope="module")
def user_env(shared_dir):
    """Environment with the user's module on PYTHONPATH."""
    return user_module_environment(shared_dir, "user_models", USER_MODULE)


@pytest.fixture(scope="module")
def one_device_user_metrics(user_env, shared_dir):
    """metrics.json of the user's model and data on one device, trained once per session."""

    def fill(directory: str) -> None:
        result = run_script(
            "train.py", *MLP, "--strategy=one_device", f"--model_dir={directory}/run", env=user_env
        )
        assert result.returncode == 0, result.stderr[-3000:]

    return read_metrics(f"{shared_dir('user_models-one_device', fill)}/run")


@pytest.mark.parametrize(
    "strategy_flags",
    [
        ("--strategy=pipeline", "--virtual_devices=2", "--microbatches=4", "--schedule=1f1b"),
        (
            "--strategy=pipeline",
            "--virtual_devices=2",
            "--microbatches=2",
            "--schedule=gpipe",
            "--partition=layers:hidden_2",
        ),
    ],
    ids=["pipeline", "pipeline_named"],
)
def test_user_model_trains_like_one_device(
    tmp_path, user_env, one_device_user_metrics, strategy_flags
):
    model_dir = str(tmp_path / "run")
    result = run_script("train.py", *MLP, *strategy_flags, f"--model_dir={model_dir}", env=user_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(read_metrics(model_dir), one_device_user_metrics)
    if "--partition=layers:hidden_2" in strategy_flags:
        split = assert_split_recorded(result, read_metrics(model_dir), num_stages=2)
        assert split["stages"][1]["blocks"][0] == "hidden_2"


def test_user_model_reaches_the_losses_of_the_same_model_trained_in_process(
    one_device_user_metrics, user_env
):
    """The script's one-device run equals plain Keras fit on the same batches."""
    sys.path.insert(0, user_env["PYTHONPATH"].split(os.pathsep)[0])
    try:
        import keras
        import user_models

        from tfmulti import data as data_lib

        keras.utils.set_random_seed(0)
        source = data_lib.load_source("user_models:arrays", seed=0)
        data = data_lib.make_datasets_from_source(
            source, 32, seed=0, steps_per_epoch=STEPS_PER_EPOCH
        )
        model = user_models.small_mlp(width=16)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(data.train, steps_per_epoch=STEPS_PER_EPOCH, epochs=2, verbose=0)
        loss = model.evaluate(data.validation, verbose=0)
    finally:
        sys.path.pop(0)
        sys.modules.pop("user_models", None)
    assert one_device_user_metrics["final"]["loss"] == pytest.approx(loss, rel=1e-4)


def test_compiled_user_model_keeps_its_own_loss_and_metrics(tmp_path, user_env):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        "--model=user_models:compiled_regressor",
        *RUN,
        "--dataset=user_models:regression_arrays",
        "--strategy=one_device",
        f"--model_dir={model_dir}",
        env=user_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    final = read_metrics(model_dir)["final"]
    assert set(final) == {"loss", "mae"}
    assert final["loss"] > 0


def test_dataset_pair_trains_on_the_train_split_and_validates_on_the_other(tmp_path, user_env):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *MLP,
        "--dataset=user_models:dataset_pair",
        "--strategy=one_device",
        "--steps_per_epoch=0",
        "--validation_steps=0",
        f"--model_dir={model_dir}",
        env=user_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(model_dir)
    # One pass over 300 training examples in batches of 32.
    assert "9/9" in result.stdout + result.stderr
    assert metrics["status"] == "completed"


BAD_MODULES = [
    ("--model=no_such_package.models:build", "no_such_package.models"),
    ("--model=user_models:missing_function", "missing_function"),
    ("--model=user_models:not_a_model", "keras.Model"),
    ("--dataset=user_models:not_data", "user_models:not_data"),
    ("--dataset=no_such_data:load", "no_such_data"),
    # 10 scores against labels 50..59.
    ("--dataset=user_models:sixty_labels", "gives 10 scores per example"),
]


@pytest.mark.parametrize("flag, named", BAD_MODULES)
def test_bad_user_module_is_one_line_and_writes_nothing(tmp_path, user_env, flag, named):
    model_dir = tmp_path / "run"
    result = run_script(
        "train.py", *MLP, flag, "--strategy=one_device", f"--model_dir={model_dir}", env=user_env
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert named in last_line(result.stderr)
    assert not model_dir.exists() or not any(model_dir.iterdir())


def test_user_arrays_hold_out_a_tenth_and_a_dataset_pair_keeps_its_splits(tmp_path):
    (tmp_path / "arrays_module.py").write_text(USER_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        import arrays_module

        from tfmulti.data import load_user_dataset

        x, y = arrays_module.arrays()
        source = load_user_dataset("arrays_module:arrays")
        stream = load_user_dataset("arrays_module:dataset_pair")
    finally:
        sys.path.pop(0)
        sys.modules.pop("arrays_module", None)
    assert (source.info.num_train_examples, source.info.num_validation_examples) == (360, 40)
    assert source.info.input_shape == (8, 8, 1)
    assert source.info.num_classes == int(max(source.y_train.max(), source.y_validation.max())) + 1
    assert (stream.info.num_train_examples, stream.info.num_validation_examples) == (300, 100)
    assert stream.info.num_classes == source.info.num_classes
    assert isinstance(stream.train, tf.data.Dataset)
    batch_x, batch_y = next(iter(stream.train.batch(32)))
    np.testing.assert_array_equal(batch_x.numpy(), x[:32])
    np.testing.assert_array_equal(batch_y.numpy(), y[:32])


def test_a_user_module_named_models_is_not_shadowed_by_the_reference_models(tmp_path):
    """The reference models install as `tfmulti.models`; `models` stays the user's name."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "models.py").write_text(
        USER_MODULE + "\n\ndef build():\n    return small_mlp(width=8)\n\n\ndata = arrays\n"
    )
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        "--model=models:build",
        "--dataset=models:data",
        *RUN[1:],
        "--strategy=one_device",
        f"--model_dir={model_dir}",
        env={"PYTHONPATH": os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(model_dir)["status"] == "completed"
