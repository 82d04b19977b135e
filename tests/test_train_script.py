"""`scripts/train.py` end to end: logs, profile trace, metrics.json, checkpoints, resume."""

import glob
import json
import os
import shutil
import time

import keras
import numpy as np
import pytest
from script_runner import last_line, one_line_error, run_script

COMMON = (
    "--virtual_devices=2",
    "--strategy=mirrored",
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=32",
    "--steps_per_epoch=6",
    "--validation_steps=2",
    "--log_steps=3",
    "--learning_rate=0.01",
)
EPOCH_KEYS = {"epoch", "loss", "accuracy", "val_loss", "val_accuracy", "examples_per_sec"}


def _metrics(model_dir):
    with open(os.path.join(model_dir, "metrics.json")) as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def finished_run(shared_dir) -> str:
    """The directory of a finished two-epoch run (profiled at steps 2-3): `run` (its
    model_dir) and `stdout.txt`. Tests that train on copy `run` first."""

    def fill(directory: str) -> None:
        result = run_script(
            "train.py",
            *COMMON,
            "--epochs=2",
            "--profile_steps=2,3",
            f"--model_dir={directory}/run",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        with open(f"{directory}/stdout.txt", "w") as handle:
            handle.write(result.stdout)

    return shared_dir("train_script-two_epochs", fill)


def _copy_of_finished_run(finished_run: str, tmp_path) -> str:
    copy = str(tmp_path / "run")
    shutil.copytree(f"{finished_run}/run", copy)
    return copy


def test_run_writes_tensorboard_logs_profile_trace_metrics_and_checkpoints(finished_run):
    model_dir = f"{finished_run}/run"
    with open(f"{finished_run}/stdout.txt") as handle:
        assert "TensorBoard logs:" in handle.read()

    metrics = _metrics(model_dir)
    assert metrics["status"] == "completed"
    assert metrics["run"]["num_replicas"] == 2
    assert metrics["run"]["per_replica_batch_size"] == 16
    assert [epoch["epoch"] for epoch in metrics["epochs"]] == [1, 2]
    assert EPOCH_KEYS <= set(metrics["epochs"][0])
    assert {"loss", "accuracy"} <= set(metrics["final"])

    assert glob.glob(f"{model_dir}/logs/train/events.out.tfevents.*")
    assert glob.glob(f"{model_dir}/logs/validation/events.out.tfevents.*")
    traces = glob.glob(f"{model_dir}/logs/train/plugins/profile/*/*.xplane.pb")
    assert traces and os.path.getsize(traces[0]) > 0

    with open(f"{model_dir}/checkpoints/latest.json") as handle:
        latest = json.load(handle)
    assert latest["epoch"] == 2
    assert os.path.exists(f"{model_dir}/checkpoints/{latest['weights']}")


def test_resume_continues_from_the_saved_epoch_and_records_each_epoch_once(finished_run, tmp_path):
    model_dir = _copy_of_finished_run(finished_run, tmp_path)
    refused = run_script("train.py", *COMMON, "--epochs=3", f"--model_dir={model_dir}")
    assert refused.returncode != 0
    assert "--resume" in last_line(refused.stderr)

    started = time.monotonic()
    resumed = run_script("train.py", *COMMON, "--epochs=3", "--resume", f"--model_dir={model_dir}")
    wall_seconds = time.monotonic() - started
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Epoch 3/3" in resumed.stdout + resumed.stderr
    assert "Epoch 1/3" not in resumed.stdout + resumed.stderr
    metrics = _metrics(model_dir)
    assert [epoch["epoch"] for epoch in metrics["epochs"]] == [1, 2, 3]
    # One start for the first run and one for the resume; this process's first step came
    # after its imports (a second at least) and before it exited.
    first, resumed_start = metrics["starts"]
    assert first["time"] < resumed_start["time"]
    assert 1.0 < resumed_start["seconds_to_first_step"] < wall_seconds


def test_resuming_with_another_layout_is_one_line_and_leaves_the_run_as_it_was(
    finished_run, tmp_path
):
    model_dir = _copy_of_finished_run(finished_run, tmp_path)  # mirrored: one model
    written = {
        path: open(path, "rb").read()
        for path in glob.glob(f"{model_dir}/**/*", recursive=True)
        if os.path.isfile(path) and "tfevents" not in path
    }
    resumed = run_script(
        "train.py",
        *COMMON,
        "--strategy=pipeline",  # two stage models
        "--epochs=3",
        "--resume",
        f"--model_dir={model_dir}",
    )
    line = one_line_error(resumed, 1)
    assert "holds the training state of another model or layout" in line
    assert "new --model_dir" in line
    for path, content in written.items():
        assert open(path, "rb").read() == content, f"{path} changed"


def test_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    model_dir = str(tmp_path / "run")
    good = run_script("train.py", *COMMON, "--epochs=1", f"--model_dir={model_dir}")
    assert good.returncode == 0, good.stderr[-3000:]
    diverging = run_script(
        "train.py",
        *COMMON,
        "--epochs=2",
        "--resume",
        "--optimizer=sgd",
        "--learning_rate=1e30",
        f"--model_dir={model_dir}",
    )
    assert diverging.returncode != 0
    message = last_line(diverging.stderr)
    assert "nan" in message.lower() or "inf" in message.lower()
    assert "epoch-001.weights.h5" in message
    assert "Traceback" not in diverging.stderr
    assert _metrics(model_dir)["status"] == "failed"

    from tfmulti.models.registry import build_model

    model = build_model("mlp", (8, 8, 1), 10, seed=0)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(f"{model_dir}/checkpoints/epoch-001.weights.h5")
    assert all(np.isfinite(np.asarray(w)).all() for w in model.get_weights())
    assert isinstance(model, keras.Model)
