"""Elastic training, end to end: a job that loses a worker slot for good goes on with
fewer workers from its last step checkpoint and ends where the uninterrupted run ends.

Each elastic run is compared with one device, and a run that starts on 3 workers with
the uninterrupted 3-worker run too.

Tolerance: the global batches are the same rows in the same order at any worker count
(every worker builds the whole global-batch stream from the seed and keeps its share of
each batch), so the runs differ only in how the gradient mean is summed: one device sums
a batch, 3 or 2 workers sum their shares and all-reduce them. Float32 rounding of that
different order stays within rel 1e-4 of the losses and rtol 1e-5 of the weights here.
"""

import glob
import os
import signal
import time

import numpy as np
import pytest
from script_runner import model_weights, read_metrics, run_script, start_launched_training
from test_elastic_launcher import write_slots
from test_exact_resume import final_weights

# Divisible by 3 and by 2 workers of one replica each. 20 steps an epoch, a step checkpoint
# every 5: a kill after checkpoint 10 lands mid-epoch 1, after 30 mid-epoch 2.
FLAGS = (
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=24",
    "--steps_per_epoch=20",
    "--validation_steps=4",
    "--epochs=3",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--log_steps=0",
    "--checkpoint_steps=5",
)


def slot_pid(model_dir: str, slot: str) -> int | None:
    """The pid of the training process of `slot` whose command line names `model_dir`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = handle.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"--model_dir={model_dir}" in command and f"TFMULTI_SLOT={slot}" in environ:
            return int(pid)
    return None


def kill_slot_once_checkpointed(launcher, model_dir, slot, global_step, spare=None) -> int:
    """SIGKILLs `slot`'s worker (not pid `spare`) once step checkpoint `global_step` exists."""
    checkpoint = os.path.join(model_dir, "backup", f"step-{global_step:09d}.json")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        pid = slot_pid(model_dir, slot) if os.path.exists(checkpoint) else None
        if pid not in (None, spare):
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.01)
    raise AssertionError(f"no step checkpoint {global_step} while the launcher ran")


def launch_elastic(model_dir, *launch_flags, train_flags=(), grace_seconds=3):
    return start_launched_training(
        (*launch_flags, "--devices_per_worker=1", f"--grace_seconds={grace_seconds}"),
        (*FLAGS, "--strategy=multi_worker", f"--model_dir={model_dir}", *train_flags),
    )


def assert_ends_like(model_dir, reference_dir, weights=final_weights):
    """Per-epoch losses within rel 1e-4 and `weights` (by default every array of the last
    epoch checkpoint, optimizer state included) within rtol 1e-5, atol 1e-6."""
    metrics, reference = read_metrics(model_dir), read_metrics(reference_dir)
    assert metrics["status"] == "completed"
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3]
    for epoch, expected in zip(metrics["epochs"], reference["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(expected["loss"], rel=1e-4)
    for weight, expected in zip(weights(model_dir), weights(reference_dir), strict=True):
        np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)


def tensorboard_worker_counts(model_dir) -> list[tuple[int, int]]:
    """(global step, workers) of every `workers` scalar the chief logged, by step."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    counts = []
    for path in glob.glob(os.path.join(model_dir, "logs", "train", "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(record.numpy())
            counts += [
                (event.step, int(tf.make_ndarray(value.tensor)))
                for value in event.summary.value
                if value.tag == "workers"
            ]
    return sorted(counts)


def one_device_reference(shared_dir) -> str:
    """The uninterrupted run on one device, which every elastic run must end like (run
    once per session)."""

    def fill(reference_dir: str) -> None:
        reference = run_script(
            "train.py", *FLAGS, "--strategy=one_device", f"--model_dir={reference_dir}"
        )
        assert reference.returncode == 0, reference.stderr[-3000:]

    return shared_dir("elastic-one_device", fill)


@pytest.fixture(scope="module")
def one_device_run(shared_dir) -> str:
    return one_device_reference(shared_dir)


def uninterrupted_reference(shared_dir, workers: int) -> str:
    """The run on `workers` launched workers of one device that never changes size (run
    once per session): the issue's own reference for an elastic run."""

    def fill(model_dir: str) -> None:
        launcher = launch_elastic(model_dir, f"--num_workers={workers}")
        output, _ = launcher.communicate(timeout=300)
        assert launcher.returncode == 0, output[-3000:]

    return shared_dir(f"elastic-{workers}_workers", fill)


# The slot's budget restarts it once before it leaves (kills after step checkpoints 10 and
# 30); under ZeRO-2 the first kill drops it (budget 0), which is the resharding's case.
SHRINKS = {
    "mirrored_state": ((), 1, (10, 30)),
    "zero2_sharded_state": (("--zero=2",), 0, (10,)),
}


@pytest.mark.parametrize("case", SHRINKS)
def test_a_slot_killed_until_dropped_leaves_2_workers_that_end_like_the_uninterrupted_run(
    tmp_path, one_device_run, shared_dir, case
):
    """The slot's budget alone restarts it (no --max_restarts); under ZeRO the checkpoint
    written by 3 workers' blocks resumes as 2 workers' blocks."""
    zero, budget, kills = SHRINKS[case]
    model_dir = str(tmp_path / "run")
    launcher = launch_elastic(
        model_dir, "--num_workers=2:3", f"--max_restarts_per_worker={budget}", train_flags=zero
    )
    try:
        killed = None
        for global_step in kills:
            killed = kill_slot_once_checkpointed(
                launcher, model_dir, "slot2", global_step, spare=killed
            )
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    if budget:
        assert "launch: restarting all workers (failed slot restarts: slot2 1/1)" in output
    assert (
        f"launch: slot2 failed more than --max_restarts_per_worker={budget} times; slot2 left; "
        "2 workers (slot0, slot1); restarting the group" in output
    )
    metrics = read_metrics(model_dir)
    grown, shrunk = metrics["membership"]
    assert (grown["workers"], grown["slots"], grown["global_step"]) == (
        3,
        ["slot0", "slot1", "slot2"],
        0,
    )
    assert (shrunk["workers"], shrunk["slots"], shrunk["left"]) == (
        2,
        ["slot0", "slot1"],
        ["slot2"],
    )
    assert shrunk["global_step"] >= kills[-1]
    assert (
        f"Membership changed: slot2 left; now 2 workers; resuming at epoch {shrunk['epoch']}, "
        f"step {shrunk['step']} (global step {shrunk['global_step']})" in output
    )
    assert metrics["run"]["num_replicas"] == 2  # the record of the last start
    counts = tensorboard_worker_counts(model_dir)
    assert counts[0] == (0, 3) and counts[-1] == (shrunk["global_step"], 2), counts
    # A ZeRO run's epoch checkpoint is the plain model's weights, without the optimizer's.
    weights = model_weights if zero else final_weights
    assert_ends_like(model_dir, one_device_run, weights=model_weights)
    assert_ends_like(model_dir, uninterrupted_reference(shared_dir, 3), weights=weights)


def test_below_min_the_job_stops_in_one_line_keeping_its_checkpoints_and_resume_continues(
    tmp_path, one_device_run
):
    model_dir = str(tmp_path / "run")
    launcher = launch_elastic(model_dir, "--num_workers=2", "--max_restarts_per_worker=0")
    try:
        kill_slot_once_checkpointed(launcher, model_dir, "slot1", 10)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL, output[-3000:]
    launcher_lines = [line for line in output.splitlines() if line.startswith("launch: ")]
    assert launcher_lines[-1] == (
        "launch: 1 worker slot(s) left (slot0), fewer than --num_workers=2 needs; stopped "
        "(the run's checkpoints are kept: start it again with --resume to continue)"
    )
    assert os.path.exists(os.path.join(model_dir, "backup", f"step-{10:09d}.json"))

    resumed = launch_elastic(model_dir, "--num_workers=2", train_flags=("--resume",))
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    (after_stop,) = read_metrics(model_dir)["resumes"]
    assert after_stop["epoch"] == 1 and after_stop["step"] >= 10
    assert_ends_like(model_dir, one_device_run)


def wait_for(condition, launcher, what):
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} did not happen while the launcher ran")


def started_sizes(model_dir) -> list[int]:
    path = os.path.join(model_dir, "metrics.json")
    return (
        [entry["workers"] for entry in read_metrics(model_dir)["membership"]]
        if (os.path.exists(path))
        else []
    )


def test_a_slot_leaving_then_rejoining_the_list_goes_3_2_3_and_ends_like_the_uninterrupted_run(
    tmp_path, one_device_run, shared_dir
):
    model_dir, hosts = str(tmp_path / "run"), tmp_path / "slots"
    hosts.write_text("a\nb\nc\n")
    launcher = launch_elastic(
        model_dir, "--num_workers=2:3", f"--hosts_file={hosts}", grace_seconds=20
    )
    backup = os.path.join(model_dir, "backup")
    try:
        wait_for(lambda: os.path.exists(f"{backup}/step-{10:09d}.json"), launcher, "step 10")
        write_slots(hosts, ["a", "b"])
        wait_for(lambda: started_sizes(model_dir) == [3, 2], launcher, "the shrink")
        resumed_at = read_metrics(model_dir)["membership"][-1]["global_step"]
        next_save = (resumed_at // 5 + 1) * 5
        wait_for(lambda: os.path.exists(f"{backup}/step-{next_save:09d}.json"), launcher, "a save")
        write_slots(hosts, ["a", "b", "c"])
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "launch: c left; 2 workers (a, b); restarting the group" in output
    assert "launch: c joined; 3 workers (a, b, c); restarting the group" in output
    metrics = read_metrics(model_dir)
    assert [entry["workers"] for entry in metrics["membership"]] == [3, 2, 3]
    assert metrics["membership"][2]["joined"] == ["c"]
    assert_ends_like(model_dir, one_device_run)
    assert_ends_like(model_dir, uninterrupted_reference(shared_dir, 3))


def test_a_hybrid_mesh_that_loses_a_worker_goes_on_along_its_data_axis(tmp_path, one_device_run):
    # 2 workers x 2 devices hold data=2,pipe=2; the one left holds data=1,pipe=2.
    model_dir = str(tmp_path / "run")
    launcher = start_launched_training(
        ("--num_workers=1:2", "--max_restarts_per_worker=0", "--devices_per_worker=2"),
        (
            *FLAGS,
            "--strategy=hybrid",
            "--mesh=data=auto,pipe=2",
            "--cross_host_axis=data",  # the axis an elastic job resizes
            "--microbatches=2",
            f"--model_dir={model_dir}",
        ),
    )
    try:
        kill_slot_once_checkpointed(launcher, model_dir, "slot1", 30)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "slot1 left; 1 workers (slot0); restarting the group" in output
    metrics = read_metrics(model_dir)
    assert [entry["workers"] for entry in metrics["membership"]] == [2, 1]
    assert metrics["run"]["num_replicas"] == 1  # data=1,pipe=2 after the shrink
    # A hybrid model's epoch checkpoint is the plain model's weights file.
    assert_ends_like(model_dir, one_device_run, weights=model_weights)
