"""A pipeline whose stages run on different workers trains like one device.

`scripts/launch.py` starts 2 workers of 2 logical CPU devices; the chief connects to the
other worker and drives all 4 stages, stages 0-1 on its own devices and 2-3 on worker 1's,
with TensorFlow's runtime moving activations and gradients between the processes. The
runs hold for the reference MLP (SGD, 1F1B and ZB-V) and a user's module (Adam, ZB-H1), through
`--resume`, a SIGTERM to the group and a SIGKILL of worker 1.

Tolerance: the pipeline sums the same micro-batch gradients as one device does its batch,
in another order, so float32 rounding stays within rel 1e-5 of the losses and rtol 1e-5,
atol 1e-6 of the weights.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from script_runner import (
    DEEP_MLP_MODEL,
    DEEP_MLP_MODULE,
    TWO_EPOCHS,
    assert_same_run,
    launch_training,
    model_weights,
    read_metrics,
    run_script,
    start_launched_training,
    use_deep_mlp_module,
    worker_pid,
)

from tfmulti.platform.runtime.devices import worker_device_name

FLAGS = TWO_EPOCHS  # the suite's shared small run, whose one-device record conftest keeps
PIPELINE = ("--strategy=pipeline", "--num_stages=4", "--microbatches=4", "--partition=params")
# Long enough for a signal after an early step checkpoint to land mid-epoch, with steps
# left after each restart: 12 steps an epoch, a step checkpoint every 3.
SIGNALLED = (*FLAGS, "--steps_per_epoch=12", "--checkpoint_steps=3")
USERS_MODEL = (DEEP_MLP_MODEL, "--optimizer=adam", "--learning_rate=0.01")


def launch_on_two_workers(*train_args: str) -> tuple[int, str]:
    """Runs `scripts/train.py train_args...` on 2 launched workers of 2 devices each."""
    return launch_training(*FLAGS, *train_args, timeout=300)


def one_device_reference(shared_dir, name: str, *train_args: str, env=None) -> str:
    """The directory of `scripts/train.py train_args... --strategy=one_device`, run once per
    session as `name` and shared by the tests (and modules) that compare with it."""

    def fill(model_dir: str) -> None:
        result = run_script(
            "train.py", *train_args, "--strategy=one_device", f"--model_dir={model_dir}", env=env
        )
        assert result.returncode == 0, result.stderr[-3000:]

    return shared_dir(name, fill)


def one_device_two_epochs_dir(shared_dir) -> str:
    """conftest's `one_device_two_epochs` run (of `FLAGS`), as a directory."""
    return one_device_reference(shared_dir, "one_device_two_epochs", *TWO_EPOCHS)


def users_model_one_device_dir(shared_dir) -> str:
    """A user's module (`DEEP_MLP_MODULE`) under Adam, `FLAGS`, on one device."""

    def fill(directory: str) -> None:
        with open(os.path.join(directory, "cross_worker_models.py"), "w") as handle:
            handle.write(DEEP_MLP_MODULE)

    user_code = shared_dir("across_workers-users_model_code", fill)
    return one_device_reference(
        shared_dir,
        "across_workers-users_model_one_device",
        *FLAGS,
        *USERS_MODEL,
        env={"PYTHONPATH": user_code},
    )


def signalled_one_device_dir(shared_dir) -> str:
    """The uninterrupted one-device run of `SIGNALLED`."""
    return one_device_reference(shared_dir, "across_workers-signalled_one_device", *SIGNALLED)


@pytest.fixture(scope="module")
def one_device_dir(shared_dir) -> str:
    return one_device_two_epochs_dir(shared_dir)


@pytest.fixture(scope="module")
def one_f_one_b_run(tmp_path_factory) -> tuple[str, str]:
    """(model_dir, output) of 1F1B over 4 stages on 2 workers, with step checkpoints and the
    trained model saved at the end (which change nothing in the training): the run both the
    training and the chief's-outputs tests check."""
    model_dir = str(tmp_path_factory.mktemp("one_f_one_b") / "run")
    returncode, output = launch_on_two_workers(
        *PIPELINE,
        "--schedule=1f1b",
        "--checkpoint_steps=2",
        f"--model_dir={model_dir}",
        f"--save_model={model_dir}/model.keras",
    )
    assert returncode == 0, output[-3000:]
    return model_dir, output


def assert_stages_on_both_workers_train_like(model_dir: str, reference_dir: str) -> None:
    assert_same_run(model_dir, reference_dir)
    stages = read_metrics(model_dir)["run"]["split"]["stages"]
    assert {"task:0" in stage["device"] for stage in stages} == {True, False}


def test_1f1b_stages_on_two_workers_train_like_one_device(one_f_one_b_run, one_device_dir):
    model_dir, _ = one_f_one_b_run
    assert_stages_on_both_workers_train_like(model_dir, one_device_dir)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shaped_stages_on_two_workers_train_like_one_device(tmp_path, one_device_dir, schedule):
    # ZB-V and DualPipeV: 2 devices of two chunks each in a V (the MLP's 4 blocks), one
    # device per worker: stages 0 and 3 on the chief, 1 and 2 on worker 1 (the last
    # --num_stages counts). DualPipeV's overlapped pairs then wait on the other worker.
    model_dir = str(tmp_path / "run")
    returncode, output = launch_on_two_workers(
        *PIPELINE,
        f"--schedule={schedule}",
        "--num_stages=2",
        "--chunks=2",
        f"--model_dir={model_dir}",
    )
    assert returncode == 0, output[-3000:]
    assert_stages_on_both_workers_train_like(model_dir, one_device_dir)


def test_the_chief_alone_writes_the_run_and_names_each_stages_worker(one_f_one_b_run):
    model_dir, output = one_f_one_b_run
    devices = [stage["device"] for stage in read_metrics(model_dir)["run"]["split"]["stages"]]
    assert devices == [
        f"/job:worker/replica:0/task:{task}/device:CPU:{index}"
        for task, index in ((0, 0), (0, 1), (1, 0), (1, 1))
    ]
    for task, index in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert f"/job:worker/task:{task}/device:CPU:{index}" in output
    assert "session config" not in output  # TensorFlow's connect-time dump stays quiet
    assert "[worker 1]" not in output  # the serving worker prints nothing
    for kept in ("backup", "checkpoints"):
        assert os.listdir(os.path.join(model_dir, kept))


def test_a_device_is_shown_with_its_worker_only_in_a_cluster():
    assert worker_device_name("/job:worker/replica:0/task:1/device:CPU:0") == (
        "/job:worker/task:1/device:CPU:0"
    )
    assert worker_device_name("/job:localhost/replica:0/task:0/device:CPU:1") == "/device:CPU:1"
    assert worker_device_name("/device:CPU:2") == "/device:CPU:2"


def test_stages_that_do_not_split_over_the_workers_are_one_line(tmp_path):
    model_dir = tmp_path / "run"
    returncode, output = launch_on_two_workers(
        "--strategy=pipeline", "--num_stages=3", f"--model_dir={model_dir}"
    )
    assert returncode == 1, output[-3000:]
    assert "Traceback" not in output
    assert (
        "--num_stages=3 over 2 workers needs the same number of devices on each, at most as "
        "many as each has; use a multiple of 2 up to 4"
    ) in output
    assert "Received: 3 devices, workers with [2, 2]" in output
    assert not (model_dir / "metrics.json").exists()


def signal_once_checkpointed(launcher, model_dir: str, ranks, global_step: int, signum) -> None:
    """Sends `signum` to the workers of `ranks` once the chief's step checkpoint
    `global_step` exists."""
    checkpoint = os.path.join(model_dir, "backup", f"step-{global_step:09d}.json")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        pids = [worker_pid(model_dir, rank) for rank in ranks] if os.path.exists(checkpoint) else []
        if pids and None not in pids:
            for pid in pids:
                os.kill(pid, signum)
            return
        time.sleep(0.01)
    raise AssertionError(f"no step checkpoint {global_step} while the launcher ran")


def test_a_preempted_then_killed_group_restarts_and_ends_like_the_uninterrupted_run(
    tmp_path, shared_dir
):
    model_dir = str(tmp_path / "run")
    launcher = start_launched_training(
        ("--num_workers=2", "--devices_per_worker=2", "--max_restarts=2", "--grace_seconds=30"),
        (*SIGNALLED, *PIPELINE, "--schedule=1f1b", f"--model_dir={model_dir}"),
    )
    try:
        # SIGTERM to the group in epoch 1 (after step 3): the serving worker stays while
        # the chief saves a step checkpoint and exits 42. SIGKILL of worker 1 (stages 2-3)
        # in epoch 2 (after step 18): a crash, no save.
        signal_once_checkpointed(launcher, model_dir, (0, 1), 3, signal.SIGTERM)
        signal_once_checkpointed(launcher, model_dir, (1,), 18, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "worker 0 was preempted and saved a checkpoint (code 42)" in output
    assert "worker 1 was killed by SIGKILL" in output
    # Once (of many runs, under three xdist workers' load) the chief did not print this:
    # the log's end shows what it said instead.
    lost = "Lost a worker: TensorFlow could not reach /job:worker/replica:0/task:1"
    assert lost in output, output[-4000:]
    after_preemption, after_kill = read_metrics(model_dir)["resumes"]
    assert after_preemption["epoch"] == 1 and after_preemption["step"] > 3
    assert (after_kill["epoch"], after_kill["step"]) == (2, 6)  # global step 18
    assert_same_run(model_dir, signalled_one_device_dir(shared_dir))


def test_a_run_resumed_across_workers_ends_like_the_uninterrupted_one(
    tmp_path, monkeypatch, shared_dir
):
    """A user's module under Adam and ZB-H1: one epoch, then the second by `--resume`
    (Adam's moments and step count come back from the epoch checkpoint), ends like the
    uninterrupted one-device run."""
    reference_dir = users_model_one_device_dir(shared_dir)
    use_deep_mlp_module(tmp_path, monkeypatch)
    model_dir = str(tmp_path / "run")
    for epochs in ("--epochs=1", "--epochs=2 --resume"):
        returncode, output = launch_on_two_workers(
            *USERS_MODEL, *PIPELINE, "--schedule=zb_h1", *epochs.split(), f"--model_dir={model_dir}"
        )
        assert returncode == 0, output[-3000:]
    assert "Resuming at epoch 2, step 0" in output
    assert_same_run(model_dir, reference_dir)


# What works on one host works across hosts: each case is one run over launched workers,
# compared with the one-device run of the same flags.
ACROSS_HOSTS_CASES = {
    # 4 workers of one device each: every stage on its own worker; GPipe, recomputing
    # each stage's forward in its backward.
    "gpipe-remat-4x1": ((4, 1), ("--schedule=gpipe", "--remat")),
    # Two chunks of each worker's one device, interleaved.
    "interleaved-2x1": (
        (2, 1),
        ("--schedule=interleaved_1f1b", "--num_stages=2", "--chunks=2"),
    ),
    "zb_h2-2x2": ((2, 2), ("--schedule=zb_h2",)),
}


@pytest.mark.parametrize("case", ACROSS_HOSTS_CASES)
def test_schedules_and_recomputation_across_workers_train_like_one_device(
    tmp_path, one_device_dir, case
):
    (num_workers, devices_per_worker), flags = ACROSS_HOSTS_CASES[case]
    model_dir = str(tmp_path / "run")
    returncode, output = launch_training(
        *FLAGS,
        *PIPELINE,
        *flags,
        f"--model_dir={model_dir}",
        num_workers=num_workers,
        devices_per_worker=devices_per_worker,
        timeout=300,
    )
    assert returncode == 0, output[-3000:]
    tasks = {
        stage["device"].split("/")[3] for stage in read_metrics(model_dir)["run"]["split"]["stages"]
    }
    assert tasks == {f"task:{task}" for task in range(num_workers)}
    assert_same_run(model_dir, one_device_dir)


# 30 rows over 4 micro-batches: 8, 8, 7, 7.
UNEVEN_MIXED = ("--batch_size=30", "--dtype=mixed_bfloat16")


def test_an_uneven_batch_under_mixed_precision_across_workers_trains_like_one_device(
    tmp_path, shared_dir
):
    """bfloat16 compute rounds each micro-batch's activations, so the pipeline's sums of
    micro-batches part from one device's whole batch by bfloat16's precision, not float32's:
    losses within rel 2e-2 (the bound the runtime's mixed-precision tests use)."""
    reference_dir = one_device_reference(
        shared_dir, "across_workers-uneven_mixed", *FLAGS, *UNEVEN_MIXED
    )
    model_dir = str(tmp_path / "run")
    returncode, output = launch_on_two_workers(
        *UNEVEN_MIXED, *PIPELINE, "--schedule=1f1b", f"--model_dir={model_dir}"
    )
    assert returncode == 0, output[-3000:]
    metrics, reference = read_metrics(model_dir), read_metrics(reference_dir)
    assert metrics["status"] == "completed"
    losses = [epoch["loss"] for epoch in metrics["epochs"]]
    expected = [epoch["loss"] for epoch in reference["epochs"]]
    assert losses == pytest.approx(expected, rel=2e-2)
    assert losses[1] < losses[0]  # it learns


# Loads a .keras file in a fresh process: its weights, as `layers/...` arrays of the file's
# own weights store, and whether tfmulti was imported.
PLAIN_LOADER = """
import json, sys
import keras
model = keras.saving.load_model(sys.argv[1])
print(json.dumps({"parameters": model.count_params(), "tfmulti_loaded": "tfmulti" in sys.modules}))
"""


def _saved_weights(path: str) -> list:
    """The `layers/...` arrays inside a `.keras` file (its `model.weights.h5`), in order."""
    import io
    import zipfile

    import h5py

    arrays = []
    with (
        zipfile.ZipFile(path) as archive,
        h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as handle,
    ):
        handle["layers"].visititems(
            lambda name, item: arrays.append(item[()]) if isinstance(item, h5py.Dataset) else None
        )
    return arrays


def test_the_chief_saves_the_trained_model_as_a_plain_keras_file(one_f_one_b_run):
    model_dir, output = one_f_one_b_run
    path = os.path.join(model_dir, "model.keras")
    assert f"Saved the trained model: {path}" in output
    loaded = subprocess.run(
        [sys.executable, "-c", PLAIN_LOADER, path], capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    report = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert report["tfmulti_loaded"] is False
    saved, trained = _saved_weights(path), model_weights(model_dir)
    assert report["parameters"] == sum(array.size for array in trained)
    for weight, expected in zip(saved, trained, strict=True):
        np.testing.assert_array_equal(weight, expected)
