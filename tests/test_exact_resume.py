"""Step checkpoints: a run killed mid-epoch resumes at the exact step, as if never stopped."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from script_runner import (
    REPO_ROOT,
    USER_CODE_ENV,
    read_metrics,
    run_script,
    script_environment,
    warm_when_possible,
)

from tfmulti.zero import zero_state_bytes

# Step checkpoints every 3 steps in epochs of 12: a kill after the first (or second) one
# lands inside epoch 1, with steps left for the resumed run to train.
STEPS_PER_EPOCH = 12
CHECKPOINT_STEPS = 3
UNSAVED_RUN = (
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=32",
    f"--steps_per_epoch={STEPS_PER_EPOCH}",
    "--validation_steps=2",
    "--epochs=2",
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--log_steps=0",
)
RUN = (*UNSAVED_RUN, f"--checkpoint_steps={CHECKPOINT_STEPS}")
# The small Transformer of the 3D mesh's run (and of the one-device run it equals).
TRANSFORMER = (
    "--model=transformer",
    "--model_option=num_layers=2",
    "--model_option=num_heads=2",
    "--model_option=d_model=16",
    "--dataset=tokens",
    "--steps_per_epoch=10",
)

STRATEGIES = {
    "one_device": ("--strategy=one_device",),
    # A ResNet's BatchNorm moving statistics: each replica's copy must resume where it was.
    "mirrored_batchnorm": ("--strategy=mirrored", "--virtual_devices=2", "--model=resnet"),
    "pipeline": (
        "--strategy=pipeline",
        "--virtual_devices=2",
        "--num_stages=2",
        "--microbatches=4",
        "--schedule=1f1b",
    ),
    # keras.distribution's ModelParallel on a (batch, model) mesh: sharded weights, Adam
    # slots beside each shard, the batch split over two rows.
    "keras_model_parallel": (
        "--strategy=keras_model_parallel",
        "--layout_map=user_layouts:mlp_layout_map",
        "--virtual_devices=4",
        "--mesh=data=2,tensor=2",
    ),
    # A 3D mesh under ZeRO-3: tensor groups inside pipeline stages inside data replicas,
    # each shard of a split weight (and each whole weight) and its Adam moments held by one
    # data replica only, the other replica's copy reading it there; the loop's micro-batch
    # state resumes too. Its steps are slow (a 3D schedule's many ops), so a small
    # Transformer and epochs of 10 steps still leave the kill after step 3 a second's
    # margin inside epoch 1.
    "hybrid_3d_zero3": (
        "--strategy=hybrid",
        "--mesh=data=2,pipe=2,tensor=2",
        "--virtual_devices=8",
        "--microbatches=2",
        "--schedule=1f1b",
        "--zero=3",
        *TRANSFORMER,
    ),
    "hybrid": (
        "--strategy=hybrid",
        "--mesh=data=2,pipe=2",
        "--virtual_devices=4",
        "--microbatches=2",
        "--schedule=1f1b",
    ),
    # ZeRO: weights and Adam's moments in blocks over the devices, saved whole.
    "mirrored_zero3": ("--strategy=mirrored", "--virtual_devices=2", "--zero=3"),
    "mirrored_zero1": ("--strategy=mirrored", "--virtual_devices=2", "--zero=1"),
}
# Each strategy is stopped once, by SIGKILL or by SIGTERM (both resume from a step checkpoint
# that StepCheckpoint.save wrote): one_device by SIGKILL in the damaged-checkpoint test below.
# `--strategy=model_parallel` builds the same PipelineModel as `pipeline` (its schedule,
# "model_parallel", is data), so the pipeline's case holds its resume.
KILLED = [
    "mirrored_batchnorm",
    "keras_model_parallel",
    "hybrid_3d_zero3",
    "mirrored_zero3",
]
PREEMPTED = ["pipeline", "hybrid", "mirrored_zero1"]


def final_weights(model_dir: str) -> list[np.ndarray]:
    """Every array of the run's last epoch checkpoint, in file order."""
    path = sorted(glob.glob(os.path.join(model_dir, "checkpoints", "epoch-*.weights.h5")))[-1]
    arrays = []
    with h5py.File(path, "r") as handle:
        handle.visititems(
            lambda name, item: arrays.append(item[()]) if isinstance(item, h5py.Dataset) else None
        )
    return arrays


def assert_same_run(model_dir: str, reference_dir: str) -> None:
    for weight, expected in zip(
        final_weights(model_dir), final_weights(reference_dir), strict=True
    ):
        np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)
    metrics, reference = read_metrics(model_dir), read_metrics(reference_dir)
    assert metrics["status"] == "completed"
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    for epoch, expected in zip(metrics["epochs"], reference["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert epoch["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)


def start_training(*args: str) -> subprocess.Popen:
    command = [sys.executable, os.path.join(REPO_ROOT, "scripts", "train.py"), *args]
    environment = {**script_environment(), **USER_CODE_ENV}
    return subprocess.Popen(
        warm_when_possible(command, environment),
        cwd=REPO_ROOT,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def wait_for_step_checkpoint(
    process: subprocess.Popen, model_dir: str, global_step: int = CHECKPOINT_STEPS
) -> None:
    """Returns as soon as the checkpoint of `global_step` is complete."""
    state = os.path.join(model_dir, "backup", f"step-{global_step:09d}.json")
    deadline = time.monotonic() + 240
    while not os.path.exists(state):
        assert process.poll() is None, "the run ended before its first step checkpoint"
        assert time.monotonic() < deadline, "no step checkpoint within 240 s"
        time.sleep(0.01)


def kill_after_step_checkpoint(
    process: subprocess.Popen, model_dir: str, global_step: int = CHECKPOINT_STEPS
) -> None:
    """SIGKILLs the run's process group as soon as the checkpoint of `global_step` is complete."""
    wait_for_step_checkpoint(process, model_dir, global_step)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def assert_resumed_once_at_a_step_checkpoint_of_epoch_1(model_dir: str, resumed) -> None:
    """Asserts the `resumed` run said and recorded one resume, mid-epoch 1 at a step save."""
    (resume,) = read_metrics(model_dir)["resumes"]
    assert resume["epoch"] == 1 and resume["step"] % CHECKPOINT_STEPS == 0 and resume["step"] > 0
    assert f"Resuming at epoch 1, step {resume['step']} (from " in resumed.stderr


@pytest.fixture(scope="module")
def uninterrupted(shared_dir):
    """`uninterrupted(strategy)`: the model_dir of that strategy's run, never stopped. Only
    one_device's saves step checkpoints (the state-file test reads them): saving changes
    nothing in the training, so the others, without, are the plainer reference."""

    def run(name: str) -> str:
        def fill(model_dir: str) -> None:
            flags = RUN if name == "one_device" else UNSAVED_RUN
            result = run_script(
                "train.py", *flags, *STRATEGIES[name], f"--model_dir={model_dir}", env=USER_CODE_ENV
            )
            assert result.returncode == 0, result.stderr[-3000:]

        return shared_dir(f"exact_resume-whole-{name}", fill)

    return run


@pytest.mark.parametrize("strategy", KILLED)
def test_run_killed_mid_epoch_resumes_at_the_exact_step_with_the_uninterrupted_weights(
    strategy, uninterrupted, tmp_path
):
    model_dir = str(tmp_path / "run")
    flags = (*RUN, *STRATEGIES[strategy], f"--model_dir={model_dir}")
    kill_after_step_checkpoint(start_training(*flags), model_dir)

    resumed = run_script("train.py", *flags, "--resume", env=USER_CODE_ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_once_at_a_step_checkpoint_of_epoch_1(model_dir, resumed)
    assert_same_run(model_dir, uninterrupted(strategy))


def test_3d_mesh_at_zero_three_trains_as_one_device_holding_each_weight_once(
    uninterrupted, shared_dir
):
    """data=2, pipe=2, tensor=2, --zero=3 (the uninterrupted run above): the losses are one
    device's, and the weights are held once over the data axis, each data replica about
    half of them (ZeRO's 4Ψ/N), where zero=0 holds them twice."""

    def fill(model_dir: str) -> None:
        result = run_script(
            "train.py",
            *UNSAVED_RUN,
            *TRANSFORMER,
            "--strategy=one_device",
            f"--model_dir={model_dir}",
        )
        assert result.returncode == 0, result.stderr[-3000:]

    reference = read_metrics(shared_dir("exact_resume-one_device_transformer", fill))
    metrics = read_metrics(uninterrupted("hybrid_3d_zero3"))
    for epoch, expected in zip(metrics["epochs"], reference["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert epoch["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    params = metrics["run"]["parameters"]
    assert params == reference["run"]["parameters"]
    held = {int(name.rsplit(":", 1)[-1]): entry for name, entry in metrics["memory"].items()}
    assert sorted(held) == list(range(8))
    # Replica r's stage s, tensor rank k on CPU:(4r + 2s + k).
    replicas = [
        sum(held[4 * replica + place]["weights"] for place in range(4)) for replica in (0, 1)
    ]
    assert sum(replicas) == 4 * params
    for replica_bytes in replicas:
        assert replica_bytes == pytest.approx(zero_state_bytes(3, params, 2).weights, rel=0.05)
    for place in range(4):
        pair = [held[place]["weights"], held[place + 4]["weights"]]
        assert min(pair) > 0.35 * sum(pair), (place, pair)
    for entry in held.values():
        assert entry["optimizer"] in (2 * entry["weights"], 2 * entry["weights"] + 12)


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_in_one_line(
    uninterrupted, tmp_path
):
    model_dir = str(tmp_path / "run")
    flags = (*RUN, *STRATEGIES["one_device"], f"--model_dir={model_dir}")
    # Two mid-epoch checkpoints exist (steps 3 and 6), so the newest has one to fall back to.
    kill_after_step_checkpoint(start_training(*flags), model_dir, global_step=2 * CHECKPOINT_STEPS)
    backup = os.path.join(model_dir, "backup")
    newest_state = sorted(glob.glob(os.path.join(backup, "step-*.json")))[-1]
    newest = newest_state.replace(".json", ".weights.h5")
    with open(newest, "r+b") as handle:  # as a disk or a kill mid-copy would leave it
        handle.truncate(os.path.getsize(newest) // 2)

    resumed = run_script("train.py", *flags, "--resume", env=USER_CODE_ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fallback_lines = [
        line for line in resumed.stderr.splitlines() if "incomplete or damaged" in line
    ]
    assert len(fallback_lines) == 1
    assert os.path.basename(newest_state) in fallback_lines[0]
    # The killed run resumes mid-epoch at the previous step checkpoint, as if never stopped.
    assert_resumed_once_at_a_step_checkpoint_of_epoch_1(model_dir, resumed)
    assert_same_run(model_dir, uninterrupted("one_device"))


def test_state_file_names_the_position_and_holds_metrics_and_seed_states(uninterrupted):
    backup = os.path.join(uninterrupted("one_device"), "backup")
    with open(os.path.join(backup, "latest.json")) as handle:
        newest = json.load(handle)["state"]
    with open(os.path.join(backup, newest)) as handle:
        state = json.load(handle)
    # The run ended at its last epoch: the newest checkpoint starts epoch 3, step 0; the one
    # kept before it is the last step save (every 3 steps: step 21 of 24).
    assert (state["epoch"], state["step"], state["global_step"]) == (2, 0, 24)
    kept = sorted(name for name in os.listdir(backup) if name.endswith(".json"))
    assert kept == ["latest.json", "step-000000021.json", "step-000000024.json"]


def terminate_after_step_checkpoint(process: subprocess.Popen, model_dir: str) -> int:
    """SIGTERMs the run once its first step checkpoint exists; returns the exit code."""
    wait_for_step_checkpoint(process, model_dir)
    os.kill(process.pid, signal.SIGTERM)
    return process.wait(timeout=240)


@pytest.mark.parametrize("strategy", PREEMPTED)
def test_sigterm_saves_a_checkpoint_exits_with_the_restart_code_and_resumes_exactly(
    strategy, uninterrupted, tmp_path
):
    model_dir = str(tmp_path / "run")
    flags = (*RUN, *STRATEGIES[strategy], f"--model_dir={model_dir}")
    assert terminate_after_step_checkpoint(start_training(*flags), model_dir) == 42

    (preemption,) = read_metrics(model_dir)["preemptions"]
    assert read_metrics(model_dir)["status"] == "preempted"
    # Saved at the step after the signal: past the step checkpoint that prompted it.
    assert (preemption["epoch"], preemption["step"]) > (1, CHECKPOINT_STEPS)
    assert os.path.exists(os.path.join(model_dir, "backup", preemption["checkpoint"]))

    resumed = run_script("train.py", *flags, "--resume", env=USER_CODE_ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (resume,) = read_metrics(model_dir)["resumes"]
    assert (resume["epoch"], resume["step"]) == (preemption["epoch"], preemption["step"])
    assert_same_run(model_dir, uninterrupted(strategy))
