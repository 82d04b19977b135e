"""`scripts/train.py --strategy=hybrid --mesh=data=2,pipe=2` trains like one device, on one host
and across two local workers launched by `scripts/launch.py`."""

import os

import pytest
from script_runner import (
    TWO_EPOCHS,
    assert_same_training,
    assert_split_recorded,
    last_line,
    one_line_error,
    read_metrics,
    run_script,
    start_launched_training,
)

# Each run here holds every flag of a command docs/guide/hybrid_and_planner.md shows, which
# test_documented_commands.py (RUN_BY_TRAIN_TESTS) therefore does not run again.
ONE_HOST_RUN = (
    *TWO_EPOCHS,
    "--strategy=hybrid",
    "--mesh=data=2,pipe=2",
    "--virtual_devices=4",
    "--microbatches=4",
    "--schedule=zb_h1",
)
TWO_WORKERS_LAUNCH = ("--num_workers=2", "--devices_per_worker=2")
TWO_WORKERS_RUN = (
    *TWO_EPOCHS,
    "--strategy=hybrid",
    "--mesh=data=2,pipe=2",
    "--cross_host_axis=data",  # each worker trains its own replica
    "--microbatches=4",
    "--schedule=zb_h1",
    "--collective_timeout=120",
    "--verbose_workers",
)


def launched(launch_flags, *train_args: str) -> tuple[int, str]:
    """(exit code, output) of `launch.py launch_flags... -- train.py train_args...`."""
    launcher = start_launched_training(launch_flags, train_args)
    output, _ = launcher.communicate(timeout=240)
    return launcher.returncode, output


def test_hybrid_script_on_one_host_trains_like_one_device(tmp_path, one_device_metrics):
    model_dir = str(tmp_path / "run")
    result = run_script("train.py", *ONE_HOST_RUN, f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(model_dir)
    assert metrics["run"]["num_replicas"] == 2
    assert_same_training(metrics, one_device_metrics)
    split = assert_split_recorded(result, metrics, num_stages=2)
    assert split["data_replicas"] == 2
    assert len({tuple(devices) for devices in split["replica_devices"]}) == 2


def test_hybrid_script_across_two_workers_trains_like_one_device_with_chief_only_outputs(
    tmp_path,
    one_device_metrics,
):
    model_dir = str(tmp_path / "run")
    returncode, output = launched(TWO_WORKERS_LAUNCH, *TWO_WORKERS_RUN, f"--model_dir={model_dir}")
    assert returncode == 0, output[-3000:]
    # --verbose_workers: every worker prints its progress lines (2 epochs each).
    progress = [line for line in output.splitlines() if " - loss: " in line]
    assert sorted(line.split("]")[0] for line in progress) == 2 * ["[worker 0"] + 2 * ["[worker 1"]
    assert_same_training(read_metrics(model_dir), one_device_metrics)
    assert sorted(os.listdir(model_dir)) == ["backup", "checkpoints", "logs", "metrics.json"]


def test_mesh_that_does_not_fit_the_devices_is_one_line(tmp_path):
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        "--strategy=hybrid",
        "--mesh=data=2,pipe=3",
        "--virtual_devices=4",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 1
    assert "needs data x pipe x tensor = 6 devices" in last_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_xla_with_a_tensor_group_in_the_mesh_is_one_line(tmp_path):
    # XLA compiles a stage for one device; a stage split over a tensor group spans two.
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        "--strategy=hybrid",
        "--mesh=data=1,pipe=2,tensor=2",
        "--virtual_devices=4",
        "--model=transformer",
        "--dataset=tokens",
        "--jit_compile",
        f"--model_dir={tmp_path / 'run'}",
    )
    line = one_line_error(result, 2)
    assert "--jit_compile" in line and "tensor > 1" in line and "tensor=1" in line
    assert not os.path.exists(tmp_path / "run")


# One layer: tracing every stage of every replica over the mesh's devices, not the steps,
# is what takes these runs' time.
TRANSFORMER = (
    "--model=transformer",
    "--dataset=tokens",
    "--model_option=num_layers=1",
    "--model_option=num_heads=2",
    "--model_option=d_model=16",
    "--batch_size=16",
    "--epochs=2",
    "--steps_per_epoch=3",
    "--validation_steps=1",
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--log_steps=0",
)
# 2 stages of tensor pairs: by parameters, the vocabulary-split embedding alone is stage 0
# and the layer with the head stage 1, so each stage is split over its tensor group.
TRANSFORMER_MESH = (
    "--strategy=hybrid",
    "--mesh=data=2,pipe=2,tensor=2",
    "--microbatches=2",
    "--partition=params",
)
MESH_3D_LAUNCH = ("--num_workers=2", "--devices_per_worker=4")
MESH_3D_RUN = (
    *TRANSFORMER,
    *TRANSFORMER_MESH,
    "--cross_host_axis=data",
    "--collective_timeout=120",
)


def transformer_one_device_dir(shared_dir) -> str:
    """The small Transformer trained on one device, once per session."""

    def fill(reference_dir: str) -> None:
        reference = run_script(
            "train.py", *TRANSFORMER, "--strategy=one_device", f"--model_dir={reference_dir}"
        )
        assert reference.returncode == 0, reference.stderr[-3000:]

    return shared_dir("hybrid-transformer_one_device", fill)


@pytest.fixture(scope="module")
def transformer_on_one_device(shared_dir):
    """metrics.json of the small Transformer trained on one device."""
    return read_metrics(transformer_one_device_dir(shared_dir))


def test_data_pipe_tensor_mesh_across_two_workers_trains_like_one_device(
    tmp_path, transformer_on_one_device
):
    # 2 workers x 4 devices: a data replica per worker, 2 stages, each split over 2 devices;
    # with collectives, each worker's tensor groups have keys of their own under the
    # runtime that also runs the cross-worker gradient all-reduce. The ring of placed ops
    # (the default) over tensor groups inside each of 2 workers is
    # tests/test_hybrid_across_workers.py's, with the pipe axis across them.
    model_dir = str(tmp_path / "mesh")
    returncode, output = launched(
        MESH_3D_LAUNCH, *MESH_3D_RUN, "--tensor_reduce=collective", f"--model_dir={model_dir}"
    )
    assert returncode == 0, output[-3000:]
    metrics = read_metrics(model_dir)
    assert [stage["blocks"] for stage in metrics["run"]["split"]["stages"]] == [
        ["embedding"],
        ["transformer_block_0", "lm_head"],
    ]
    assert_same_training(metrics, transformer_on_one_device)
