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

import os
import signal
import time

import pytest
from script_runner import (
    DEEP_MLP_MODEL,
    assert_same_run,
    launch_training,
    read_metrics,
    run_script,
    start_launched_training,
    use_deep_mlp_module,
    worker_pid,
)

from tfmulti.platform.devices import worker_device_name

FLAGS = (
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=32",
    "--steps_per_epoch=5",
    "--validation_steps=4",
    "--epochs=2",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--log_steps=0",
)
PIPELINE = ("--strategy=pipeline", "--num_stages=4", "--microbatches=4", "--partition=params")


def launch_on_two_workers(*train_args: str) -> tuple[int, str]:
    """Runs `scripts/train.py train_args...` on 2 launched workers of 2 devices each."""
    return launch_training(*FLAGS, *train_args, timeout=300)


@pytest.fixture(scope="module")
def one_device_dir(tmp_path_factory) -> str:
    model_dir = str(tmp_path_factory.mktemp("one_device") / "run")
    result = run_script("train.py", *FLAGS, "--strategy=one_device", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir


# ZB-V: 2 devices of two chunks each in a V (the MLP's 4 blocks), one device per worker:
# stages 0 and 3 on the chief, 1 and 2 on worker 1 (the last --num_stages counts).
@pytest.mark.parametrize(
    "schedule", [("--schedule=1f1b",), ("--schedule=zbv", "--num_stages=2", "--chunks=2")]
)
def test_stages_on_two_workers_train_like_one_device(tmp_path, one_device_dir, schedule):
    model_dir = str(tmp_path / "run")
    returncode, output = launch_on_two_workers(*PIPELINE, *schedule, f"--model_dir={model_dir}")
    assert returncode == 0, output[-3000:]
    assert_same_run(model_dir, one_device_dir)
    stages = read_metrics(model_dir)["run"]["split"]["stages"]
    assert {"task:0" in stage["device"] for stage in stages} == {True, False}


def test_a_users_model_under_adam_and_zb_h1_on_two_workers_trains_like_one_device(
    tmp_path, monkeypatch
):
    use_deep_mlp_module(tmp_path, monkeypatch)
    user_flags = (
        DEEP_MLP_MODEL,
        "--optimizer=adam",
        "--learning_rate=0.01",
    )
    reference_dir = str(tmp_path / "one_device")
    reference = run_script(
        "train.py", *FLAGS, *user_flags, "--strategy=one_device", f"--model_dir={reference_dir}"
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    model_dir = str(tmp_path / "run")
    returncode, output = launch_on_two_workers(
        *user_flags, *PIPELINE, "--schedule=zb_h1", f"--model_dir={model_dir}"
    )
    assert returncode == 0, output[-3000:]
    assert_same_run(model_dir, reference_dir)


def test_the_chief_alone_writes_the_run_and_names_each_stages_worker(tmp_path):
    model_dir = tmp_path / "run"
    returncode, output = launch_on_two_workers(
        *PIPELINE,
        "--schedule=1f1b",
        "--epochs=1",
        "--checkpoint_steps=2",
        f"--model_dir={model_dir}",
    )
    assert returncode == 0, output[-3000:]
    devices = [stage["device"] for stage in read_metrics(model_dir)["run"]["split"]["stages"]]
    assert devices == [
        f"/job:worker/replica:0/task:{task}/device:CPU:{index}"
        for task, index in ((0, 0), (0, 1), (1, 0), (1, 1))
    ]
    for task, index in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert f"/job:worker/task:{task}/device:CPU:{index}" in output
    assert "session config" not in output  # TensorFlow's connect-time dump stays quiet
    assert "[worker 1]" not in output  # the serving worker prints nothing
    assert os.listdir(model_dir / "backup") and os.listdir(model_dir / "checkpoints")


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


def test_a_preempted_then_killed_group_restarts_and_ends_like_the_uninterrupted_run(tmp_path):
    flags = (*FLAGS, "--steps_per_epoch=20", "--checkpoint_steps=7")
    model_dir = str(tmp_path / "run")
    launcher = start_launched_training(
        ("--num_workers=2", "--devices_per_worker=2", "--max_restarts=2", "--grace_seconds=30"),
        (*flags, *PIPELINE, "--schedule=1f1b", f"--model_dir={model_dir}"),
    )
    try:
        # SIGTERM to the group in epoch 1 (after step 7): the serving worker stays while
        # the chief saves a step checkpoint and exits 42. SIGKILL of worker 1 (stages 2-3)
        # in epoch 2 (after step 28): a crash, no save.
        signal_once_checkpointed(launcher, model_dir, (0, 1), 7, signal.SIGTERM)
        signal_once_checkpointed(launcher, model_dir, (1,), 28, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "worker 0 was preempted and saved a checkpoint (code 42)" in output
    assert "worker 1 was killed by SIGKILL" in output
    assert "Lost a worker: TensorFlow could not reach /job:worker/replica:0/task:1" in output
    after_preemption, after_kill = read_metrics(model_dir)["resumes"]
    assert after_preemption["epoch"] == 1 and after_preemption["step"] > 7
    assert (after_kill["epoch"], after_kill["step"]) == (2, 8)  # global step 28
    reference_dir = str(tmp_path / "one_device")
    reference = run_script(
        "train.py", *flags, "--strategy=one_device", f"--model_dir={reference_dir}"
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert_same_run(model_dir, reference_dir)


def test_a_run_resumed_across_workers_ends_like_the_uninterrupted_one(tmp_path, one_device_dir):
    model_dir = str(tmp_path / "run")
    for epochs in ("--epochs=1", "--epochs=2 --resume"):
        returncode, output = launch_on_two_workers(
            *PIPELINE, "--schedule=zb_h1", *epochs.split(), f"--model_dir={model_dir}"
        )
        assert returncode == 0, output[-3000:]
    assert "Resuming at epoch 2, step 0" in output
    assert_same_run(model_dir, one_device_dir)
