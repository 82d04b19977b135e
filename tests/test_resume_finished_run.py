"""`scripts/train.py --resume` of a run that already trained every epoch: one line, exit 0,
and every file of the run left as it was; more `--epochs` train on from where it stopped."""

import json
import os
import shutil
import textwrap

import pytest
from script_runner import one_line_error, read_metrics, run_script

RUN = (
    "--strategy=one_device",
    "--model=mlp",
    "--batch_size=64",
    "--epochs=2",
    "--steps_per_epoch=2",
    "--checkpoint_steps=2",
    "--log_steps=0",
)
DATASETS = {"synthetic": "--dataset=synthetic", "user": "--dataset=user_rows:data"}
USER_MODULE = textwrap.dedent(
    """
    import numpy as np
    import tensorflow as tf


    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(400, 8, 8, 1)).astype("float32")
        y = x.reshape(400, -1)[:, :10].argmax(1).astype("int64")
        return (tf.data.Dataset.from_tensor_slices((x[:320], y[:320])),
                tf.data.Dataset.from_tensor_slices((x[320:], y[320:])))
    """
)
NOTHING_LEFT = "Nothing left to train"


@pytest.fixture(scope="module")
def user_env(shared_dir):
    def fill(directory: str) -> None:
        with open(os.path.join(directory, "user_rows.py"), "w") as handle:
            handle.write(USER_MODULE)

    return {"PYTHONPATH": shared_dir("resume_finished-user_project", fill)}


@pytest.fixture(scope="module")
def finished_run(shared_dir, user_env):
    """`finished_run(dataset)`: the model_dir of a completed two-epoch run of that dataset,
    which tests copy before they resume it."""

    def run(name: str) -> str:
        def fill(directory: str) -> None:
            model_dir = f"{directory}/run"
            result = run_script(
                "train.py", *RUN, DATASETS[name], f"--model_dir={model_dir}", env=user_env
            )
            assert result.returncode == 0, result.stderr[-3000:]
            assert read_metrics(model_dir)["status"] == "completed"

        return f"{shared_dir(f'resume_finished-{name}', fill)}/run"

    return run


def _copy(model_dir: str, tmp_path) -> str:
    copy = str(tmp_path / "run")
    shutil.copytree(model_dir, copy)
    return copy


def _contents(model_dir: str) -> dict[str, bytes]:
    """Every file under `model_dir`, by relative path, with its bytes."""
    contents = {}
    for root, _, names in os.walk(model_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                contents[os.path.relpath(path, model_dir)] = handle.read()
    return contents


def _resume(model_dir: str, dataset: str, user_env, *extra: str):
    return run_script(
        "train.py",
        *RUN,
        DATASETS[dataset],
        f"--model_dir={model_dir}",
        "--resume",
        *extra,
        env=user_env,
    )


def _assert_nothing_trained(result, model_dir: str, before: dict[str, bytes]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.count(NOTHING_LEFT) == 1, result.stderr[-3000:]
    assert "Resuming at" not in result.stderr
    assert "Final validation" not in result.stderr + result.stdout
    assert _contents(model_dir) == before


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_resuming_a_finished_run_says_so_and_leaves_every_file_as_it_was(
    tmp_path, finished_run, user_env, dataset
):
    model_dir = _copy(finished_run(dataset), tmp_path)
    before = _contents(model_dir)
    _assert_nothing_trained(_resume(model_dir, dataset, user_env), model_dir, before)


def test_resuming_a_run_killed_after_its_last_step_leaves_every_file_as_it_was(
    tmp_path, finished_run, user_env
):
    # A kill after the last epoch's checkpoint but before the final evaluation leaves
    # the record of a run still going.
    model_dir = _copy(finished_run("synthetic"), tmp_path)
    metrics = read_metrics(model_dir)
    metrics.update(status="running", final={})
    with open(os.path.join(model_dir, "metrics.json"), "w") as handle:
        json.dump(metrics, handle)
    before = _contents(model_dir)
    _assert_nothing_trained(_resume(model_dir, "synthetic", user_env), model_dir, before)


def test_resuming_a_finished_run_with_more_epochs_trains_on(tmp_path, finished_run, user_env):
    model_dir = _copy(finished_run("synthetic"), tmp_path)
    finished = read_metrics(model_dir)
    result = _resume(model_dir, "synthetic", user_env, "--epochs=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resuming at epoch 3, step 0" in result.stderr
    assert NOTHING_LEFT not in result.stderr
    metrics = read_metrics(model_dir)
    assert metrics["status"] == "completed"
    assert [epoch["epoch"] for epoch in metrics["epochs"]] == [1, 2, 3]
    assert metrics["epochs"][:2] == finished["epochs"]
    assert [resume["epoch"] for resume in metrics["resumes"]] == [3]


@pytest.mark.parametrize("restart_count", ["0", "1"])
def test_a_job_slurm_requeued_resumes_by_itself_and_a_first_start_does_not(
    tmp_path, finished_run, user_env, restart_count
):
    model_dir = _copy(finished_run("synthetic"), tmp_path)
    result = run_script(
        "train.py",
        *RUN,
        DATASETS["synthetic"],
        f"--model_dir={model_dir}",
        "--epochs=3",
        env={**user_env, "SLURM_RESTART_COUNT": restart_count},
    )
    if restart_count == "0":
        assert one_line_error(result, 1).endswith(
            "already holds a run. Pass --resume to continue it or choose a new --model_dir."
        )
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resuming at epoch 3, step 0" in result.stderr
    assert [epoch["epoch"] for epoch in read_metrics(model_dir)["epochs"]] == [1, 2, 3]


def test_a_run_killed_between_its_last_record_and_checkpoint_trains_that_epoch_again(
    tmp_path, finished_run, user_env
):
    """Each epoch is recorded before it is checkpointed, so a kill between the two leaves
    the record of an epoch whose checkpoint is missing: the resume starts from the epoch
    before, records the epoch again in its place, and ends as the uninterrupted run."""
    model_dir = _copy(finished_run("synthetic"), tmp_path)
    finished = read_metrics(model_dir)
    backup = os.path.join(model_dir, "backup")
    for name in ("step-000000004.json", "step-000000004.weights.h5"):
        os.remove(os.path.join(backup, name))
    with open(os.path.join(backup, "latest.json"), "w") as handle:
        json.dump({"state": "step-000000002.json"}, handle)
    os.remove(os.path.join(model_dir, "checkpoints", "epoch-002.weights.h5"))
    with open(os.path.join(model_dir, "checkpoints", "latest.json"), "w") as handle:
        json.dump({"epoch": 1, "weights": "epoch-001.weights.h5"}, handle)
    metrics = dict(finished, status="running", final={})
    with open(os.path.join(model_dir, "metrics.json"), "w") as handle:
        json.dump(metrics, handle)

    result = _resume(model_dir, "synthetic", user_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resuming at epoch 2, step 0" in result.stderr
    resumed = read_metrics(model_dir)
    assert resumed["status"] == "completed"
    assert [epoch["epoch"] for epoch in resumed["epochs"]] == [1, 2]
    assert [epoch["loss"] for epoch in resumed["epochs"]] == pytest.approx(
        [epoch["loss"] for epoch in finished["epochs"]], rel=1e-6
    )


def test_every_epoch_is_recorded_before_it_is_checkpointed(tmp_path):
    """Keras ends an epoch callback by callback in list order: the record comes first."""
    from tfmulti.config import RunConfig, TrainConfig
    from tfmulti.run.epoch_checkpoint import EpochCheckpoint
    from tfmulti.run.run_record import RecordEpochs, RunRecord
    from tfmulti.run.step_checkpoint import StepCheckpoint
    from tfmulti.run.training import standard_callbacks

    directory = str(tmp_path)
    config = TrainConfig(run=RunConfig(model_dir=directory))
    callbacks, _ = standard_callbacks(config, directory, RunRecord(directory, {}), 10)
    kinds = [type(callback) for callback in callbacks]
    record = kinds.index(RecordEpochs)
    assert record < kinds.index(StepCheckpoint) and record < kinds.index(EpochCheckpoint)
