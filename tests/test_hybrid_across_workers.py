"""A hybrid mesh whose pipe axis crosses the workers trains like one device.

`scripts/launch.py` starts 2 workers of 2 logical CPU devices and `--strategy=hybrid
--mesh=data=2,pipe=2` (the pipe axis crosses the workers by default, `--cross_host_axis`)
puts each data replica's stage 0 on worker 0 and stage 1 on worker 1: the chief connects
to the cluster and drives both replicas, the sum of a stage's gradients over the replicas
stays inside the worker that holds the stage, and only activations and their gradients
cross hosts. The runs hold for a user's module (Adam, ZB-H1; one run, read by the tests
of its losses and weights, its placement and its output) and the reference Transformer
with each stage's layers split over two devices of its worker (data=2,pipe=2,tensor=2 over
2 workers x 4 devices, the ring of placed ops summing each tensor pair).

Tolerance: as `assert_same_run` (the same gradients summed in another order).
"""

import pytest
from script_runner import (
    TWO_EPOCHS,
    assert_same_run,
    launch_training,
    read_metrics,
    use_deep_mlp_module,
)
from test_pipeline_across_workers import USERS_MODEL, users_model_one_device_dir
from test_train_script_hybrid import TRANSFORMER, TRANSFORMER_MESH, transformer_one_device_dir

from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.cluster import resolve_cluster
from tfmulti.platform.runtime.connected_cluster import mesh_groups_across_workers, pipe_major_groups

# The pipe axis crosses the workers without --cross_host_axis=pipe: it is the default.
PIPE_ACROSS_WORKERS = ("--strategy=hybrid", "--mesh=data=2,pipe=2", "--microbatches=2")


def worker_device(task: int, index: int) -> str:
    return f"/job:worker/replica:0/task:{task}/device:CPU:{index}"


@pytest.fixture(scope="module")
def pipe_across_workers_run(tmp_path_factory) -> tuple[str, str]:
    """(model_dir, output) of a user's model under Adam and ZB-H1 on 2 launched workers,
    pipe axis across."""
    directory = tmp_path_factory.mktemp("pipe_across_workers")
    model_dir = str(directory / "run")
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_deep_mlp_module(directory, monkeypatch)
        returncode, output = launch_training(
            *TWO_EPOCHS,
            *USERS_MODEL,
            *PIPE_ACROSS_WORKERS,
            "--schedule=zb_h1",
            f"--model_dir={model_dir}",
        )
    assert returncode == 0, output[-3000:]
    return model_dir, output


def test_a_users_model_under_adam_and_zb_h1_with_pipe_across_workers_trains_like_one_device(
    shared_dir, pipe_across_workers_run
):
    model_dir, _ = pipe_across_workers_run
    assert_same_run(model_dir, users_model_one_device_dir(shared_dir))


def test_each_stage_of_every_replica_is_on_one_worker_and_only_the_chief_reports(
    pipe_across_workers_run,
):
    model_dir, output = pipe_across_workers_run
    split = read_metrics(model_dir)["run"]["split"]
    # Stage s of both replicas on worker s: a stage's gradient sum stays on one host.
    assert split["replica_devices"] == [
        [worker_device(0, 0), worker_device(1, 0)],
        [worker_device(0, 1), worker_device(1, 1)],
    ]
    assert [stage["device"] for stage in split["stages"]] == [
        worker_device(0, 0),
        worker_device(1, 0),
    ]
    assert "[worker 1]" not in output  # the serving worker prints nothing
    assert "session config" not in output


def test_tensor_groups_inside_each_worker_with_pipe_across_workers_train_like_one_device(
    tmp_path, shared_dir
):
    reference_dir = transformer_one_device_dir(shared_dir)
    model_dir = str(tmp_path / "run")
    returncode, output = launch_training(
        *TRANSFORMER,
        *TRANSFORMER_MESH,
        "--cross_host_axis=pipe",
        "--tensor_reduce=ring",
        f"--model_dir={model_dir}",
        devices_per_worker=4,
        timeout=300,
    )
    assert returncode == 0, output[-3000:]
    metrics, expected = read_metrics(model_dir), read_metrics(reference_dir)
    # Each replica's stage s on worker s, its tensor pair on two devices of that worker.
    assert metrics["run"]["split"]["replica_devices"] == [
        [worker_device(0, 0), worker_device(1, 0)],
        [worker_device(0, 2), worker_device(1, 2)],
    ]
    # The weights file holds split layers' shards, so the losses are compared.
    for epoch, wanted in zip(metrics["epochs"], expected["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(wanted["loss"], rel=1e-5)
    assert metrics["final"]["loss"] == pytest.approx(expected["final"]["loss"], rel=1e-5)


def test_rank_order_keeps_tensor_then_data_groups_inside_a_pipe_stage():
    devices = [f"w{worker}d{index}" for worker in range(2) for index in range(4)]
    groups = pipe_major_groups(devices, parse_mesh("data=2,pipe=2,tensor=2"))
    assert groups == [
        [["w0d0", "w0d1"], ["w1d0", "w1d1"]],  # replica 0: stage 0 on worker 0, 1 on 1
        [["w0d2", "w0d3"], ["w1d2", "w1d3"]],
    ]


def test_a_pipe_axis_that_does_not_split_over_the_workers_is_refused():
    cluster = resolve_cluster(["h:1", "h:2"], task_index=0)
    with pytest.raises(ValueError, match="pipe must be a multiple of 2; use ") as raised:
        mesh_groups_across_workers(cluster, parse_mesh("data=4,pipe=1"))
    assert "--cross_host_axis=data" in str(raised.value)
    assert "Received: pipe=1" in str(raised.value)
