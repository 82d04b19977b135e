"""`scripts/train.py` keeps the optimizer the user's model was compiled with, runs the user's
`--callbacks` under every strategy, and schedules the built-in optimizers' rate from flags.

The user's module is written into a temporary directory on PYTHONPATH, as a user's project
would be.
"""

import functools
import json
import math
import os
import sys
import textwrap

import pytest
from script_runner import (
    assert_same_training,
    last_line,
    launch_training,
    read_metrics,
    run_script,
    user_module_environment,
)

USER_MODULE = textwrap.dedent(
    """
    import keras
    import numpy as np


    def small_mlp():
        seeded = lambda seed: keras.initializers.GlorotUniform(seed=seed)
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(1))(x)
        x = keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(2))(x)
        return keras.Model(inputs, keras.layers.Dense(10, kernel_initializer=seeded(3))(x))


    def adamw():
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=6, warmup_target=0.02, warmup_steps=4)
        optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.5)
        # Not in the optimizer's config: tfmulti's copy must carry it over.
        optimizer.exclude_from_weight_decay(var_names=["kernel"])
        return optimizer


    def compiled_with_adamw():
        model = small_mlp()
        model.compile(
            optimizer=adamw(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        )
        return model


    def arrays():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(400, 8, 8, 1)).astype("float32")
        return x, x.reshape(400, -1)[:, :10].argmax(1).astype("int64")


    def plateau():
        # No epoch improves val_loss by 100, so both act by patience alone: the rate halves
        # at the end of epochs 2 and 3, and training stops after epoch 3.
        return [
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", min_delta=100.0, patience=1,
                                              factor=0.5),
            keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=100.0, patience=2),
        ]


    class LearningRateAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(
                self.model.optimizer.learning_rate))


    def learning_rate_log():
        return [LearningRateAtEpochEnd()]


    def not_callbacks():
        return ["EarlyStopping"]


    class FailAtBatch2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("the user's callback failed at batch 2")


    def failing():
        return [FailAtBatch2()]
    """
)
RUN = (
    "--dataset=user_hooks:arrays",
    "--batch_size=32",
    "--steps_per_epoch=5",
    "--validation_steps=2",
    "--log_steps=0",
)
PLATEAU = (
    "--model=user_hooks:small_mlp",
    *RUN,
    # The callbacks act by patience alone: 2 steps an epoch are enough (the last flag wins).
    "--steps_per_epoch=2",
    "--validation_steps=1",
    "--epochs=5",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--callbacks=user_hooks:plateau",
)


@pytest.fixture(scope="module")
def user_env(shared_dir):
    """Environment with the user's module on PYTHONPATH."""
    return user_module_environment(shared_dir, "user_hooks", USER_MODULE)


def _train_plateau(user_env: dict, strategy: str, directory: str) -> None:
    """Trains the PLATEAU run under `strategy` into `directory`/run."""
    model_dir = f"{directory}/run"
    if strategy == "multi_worker":
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", user_env["PYTHONPATH"])
            code, output = launch_training(
                *PLATEAU,
                "--strategy=multi_worker",
                f"--model_dir={model_dir}",
                devices_per_worker=1,
            )
        assert code == 0, output[-3000:]
    else:
        flags = {
            "one_device": ("--strategy=one_device",),
            "pipeline": ("--strategy=pipeline", "--virtual_devices=2"),
        }[strategy]
        result = run_script("train.py", *PLATEAU, *flags, f"--model_dir={model_dir}", env=user_env)
        assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def plateau_run(user_env, shared_dir):
    """metrics.json of the PLATEAU run under a strategy, each run once."""

    @functools.cache
    def run(strategy: str) -> dict:
        fill = functools.partial(_train_plateau, user_env, strategy)
        return read_metrics(f"{shared_dir(f'user_hooks-plateau-{strategy}', fill)}/run")

    return run


@pytest.mark.parametrize("strategy", ["pipeline", "multi_worker"])
def test_early_stopping_stops_at_the_epoch_of_one_device(plateau_run, strategy):
    one_device = plateau_run("one_device")
    assert [epoch["epoch"] for epoch in one_device["epochs"]] == [1, 2, 3]  # of --epochs=5
    assert_same_training(plateau_run(strategy), one_device)


@pytest.mark.parametrize("strategy", ["one_device", "pipeline", "multi_worker"])
def test_reduce_lr_on_plateau_changes_the_rate_at_the_same_epoch(plateau_run, strategy):
    rates = [epoch["learning_rate"] for epoch in plateau_run(strategy)["epochs"]]
    assert rates == pytest.approx([0.1, 0.1, 0.05])


def _train_adamw_in_process(user_env: dict, directory: str) -> None:
    """Writes `directory`/loss.json: the validation loss of the user's compiled model trained
    by plain Keras on one device."""
    sys.path.insert(0, user_env["PYTHONPATH"].split(os.pathsep)[0])
    try:
        import keras
        import user_hooks

        from tfmulti import data as data_lib

        keras.utils.set_random_seed(0)
        source = data_lib.load_source("user_hooks:arrays", seed=0)
        data = data_lib.make_datasets_from_source(source, 32, seed=0, steps_per_epoch=5)
        model = user_hooks.compiled_with_adamw()
        model.fit(data.train, steps_per_epoch=5, epochs=2, verbose=0)
        loss = model.evaluate(data.validation, steps=2, verbose=0, return_dict=True)["loss"]
    finally:
        sys.path.pop(0)
        sys.modules.pop("user_hooks", None)
    with open(os.path.join(directory, "loss.json"), "w") as handle:
        json.dump(loss, handle)


@pytest.fixture(scope="module")
def adamw_in_process_loss(user_env, shared_dir):
    """Validation loss of the user's compiled model trained by plain Keras on one device,
    trained once per session for every xdist worker."""
    fill = functools.partial(_train_adamw_in_process, user_env)
    with open(os.path.join(shared_dir("user_hooks-adamw_in_process", fill), "loss.json")) as handle:
        return json.load(handle)


@pytest.mark.parametrize(
    "strategy_flags",
    [("--strategy=one_device",), ("--strategy=pipeline", "--virtual_devices=2")],
    ids=["one_device", "pipeline"],
)
def test_compiled_adamw_with_a_schedule_trains_to_the_plain_keras_loss(
    tmp_path, user_env, adamw_in_process_loss, strategy_flags
):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        "--model=user_hooks:compiled_with_adamw",
        *RUN,
        "--epochs=2",
        *strategy_flags,
        f"--model_dir={model_dir}",
        env=user_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Optimizer: AdamW, learning rate CosineDecay(" in result.stderr
    final = read_metrics(model_dir)["final"]
    assert final["loss"] == pytest.approx(adamw_in_process_loss, rel=1e-4)


def test_optimizer_flags_replace_the_compiled_optimizer_and_schedule_the_rate(tmp_path, user_env):
    """--lr_schedule=cosine --warmup_steps=2 over 4 epochs of 2 steps: the rate climbs to
    0.1 by step 2, then follows 0.1 * (1 + cos(pi * (step - 2) / 6)) / 2 down to 0."""
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        "--model=user_hooks:compiled_with_adamw",
        *RUN,
        "--steps_per_epoch=2",
        "--epochs=4",
        "--optimizer=sgd",
        "--learning_rate=0.1",
        "--lr_schedule=cosine",
        "--warmup_steps=2",
        "--callbacks=user_hooks:learning_rate_log",
        "--strategy=one_device",
        f"--model_dir={model_dir}",
        env=user_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Optimizer: SGD, learning rate CosineDecay(" in result.stderr
    rates = [epoch["learning_rate"] for epoch in read_metrics(model_dir)["epochs"]]
    steps = [2, 4, 6, 8]
    expected = [0.1 * (1 + math.cos(math.pi * (step - 2) / 6)) / 2 for step in steps]
    assert rates == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedule_gives_the_closed_form_rate_at_each_step(schedule):
    from tfmulti.run.model_setup import build_optimizer

    peak, warmup, total = 0.3, 10, 110
    optimizer = build_optimizer("adam", peak, schedule, warmup_steps=warmup, total_steps=total)
    decay = {
        "constant": lambda fraction: 1.0,
        "cosine": lambda fraction: (1 + math.cos(math.pi * fraction)) / 2,
        "linear": lambda fraction: 1 - fraction,
    }[schedule]
    for step in [0, 1, 5, 10, 11, 35, 60, 109, 110, 200]:
        expected = (
            peak * step / warmup
            if step < warmup
            else peak * decay(min(step - warmup, total - warmup) / (total - warmup))
        )
        optimizer.iterations.assign(step)
        assert float(optimizer.learning_rate) == pytest.approx(expected, abs=1e-6), step


@pytest.mark.parametrize(
    "flag, named",
    [
        ("--callbacks=user_hooks.plateau", "--callbacks must be package.module:function"),
        ("--callbacks=no_such_hooks:callbacks", "no_such_hooks"),
        ("--callbacks=user_hooks:not_callbacks", "keras.callbacks.Callback"),
        ("--warmup_steps=10", "--warmup_steps"),  # of 2 x 5 steps
    ],
)
def test_wrong_callbacks_or_schedule_is_one_line_and_writes_nothing(
    tmp_path, user_env, flag, named
):
    model_dir = tmp_path / "run"
    result = run_script(
        "train.py",
        "--model=user_hooks:small_mlp",
        *RUN,
        "--epochs=2",
        flag,
        "--strategy=one_device",
        f"--model_dir={model_dir}",
        env=user_env,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert named in last_line(result.stderr)
    assert not model_dir.exists() or not any(model_dir.iterdir())


def test_a_fit_that_raises_leaves_no_preemption_scratch_behind(user_env, tmp_path):
    """Keras skips on_train_end when fit raises; the trainer still removes the preemption
    handler's scratch directory (and gives SIGTERM back)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = run_script(
        "train.py",
        "--model=user_hooks:small_mlp",
        *RUN,
        "--epochs=1",
        "--callbacks=user_hooks:failing",
        f"--model_dir={tmp_path / 'run'}",
        env={**user_env, "TMPDIR": str(scratch)},
    )
    assert result.returncode != 0
    assert "the user's callback failed at batch 2" in result.stderr
    assert not [name for name in os.listdir(scratch) if name.startswith("tfmulti-preemption-")]
