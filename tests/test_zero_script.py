"""`scripts/train.py --zero=1|2|3`: a user's model trained with sharded state, from the script."""

import os
import sys

import keras
import numpy as np
import pytest
from script_runner import USER_CODE_ENV, one_line_error, read_metrics, run_script

from tfmulti.zero import zero_state_bytes

USER_RUN = (
    "--model=zero_user_model:model",
    "--dataset=zero_user_model:data",
    "--batch_size=32",
    "--steps_per_epoch=3",
    "--log_steps=1",
)


def _train(model_dir, *args):
    result = run_script("train.py", *USER_RUN, f"--model_dir={model_dir}", *args, env=USER_CODE_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(str(model_dir))


def _losses(metrics):
    return [epoch["loss"] for epoch in metrics["epochs"]]


HYBRID_RUN = (
    "--strategy=hybrid",
    "--mesh=data=2,pipe=2",
    "--virtual_devices=4",
    "--microbatches=2",
    "--partition=layers:odd_width",
)
# The user model's parameters by pipeline stage under HYBRID_RUN's partition: the embedding
# (37x5), then the odd-width layer (30x13 + 13) and the head (13x3 + 3).
STAGE_PARAMS = (37 * 5, 30 * 13 + 13 + 13 * 3 + 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One device; ZeRO-2 over 4 devices; ZeRO-3 over 4 devices for one epoch, then resumed
    over 2 devices for the second (a checkpoint read at another data-axis size)."""
    root = tmp_path_factory.mktemp("zero_script")
    one = _train(root / "one", "--strategy=one_device", "--epochs=2")
    zero2 = _train(
        root / "zero2",
        "--strategy=mirrored",
        "--virtual_devices=4",
        "--zero=2",
        "--epochs=2",
        f"--save_model={root / 'zero2.keras'}",
    )
    _train(root / "zero3", "--strategy=mirrored", "--virtual_devices=4", "--zero=3", "--epochs=1")
    resumed = _train(
        root / "zero3",
        "--strategy=mirrored",
        "--virtual_devices=2",
        "--zero=3",
        "--epochs=2",
        "--resume",
    )
    hybrid = {
        stage: _train(root / f"hybrid{stage}", *HYBRID_RUN, f"--zero={stage}", "--epochs=2")
        for stage in (2, 3)
    }
    return {"root": root, "one": one, "zero2": zero2, "resumed": resumed, "hybrid": hybrid}


def test_zero_from_the_script_trains_a_users_model_as_one_device(runs):
    np.testing.assert_allclose(_losses(runs["zero2"]), _losses(runs["one"]), rtol=1e-5)


def test_hybrid_mesh_with_zero_shards_optimizer_state_over_its_data_axis(runs):
    """data=2, pipe=2: each stage's variables are owned by one of its 2 data replicas, which
    alone holds their Adam moments; the run still trains as one device."""
    hybrid = runs["hybrid"][2]
    np.testing.assert_allclose(_losses(hybrid), _losses(runs["one"]), rtol=1e-5)
    optimizer = sorted(held["optimizer"] for held in hybrid["memory"].values())
    # AdamW's two float32 moments of each variable, on its owner: stage 0 holds the
    # embedding (37x5) alone, so one of its replicas owns nothing (only the step counter
    # and learning rate, 12 bytes); stage 1's kernel (30x13) goes to one replica, the
    # head's kernel (13x3) and both biases (13, 3) to the other.
    assert optimizer == sorted([12, 8 * 37 * 5, 8 * (13 * 3 + 13 + 3), 8 * 30 * 13])


def test_zero_run_resumed_on_fewer_devices_ends_as_an_unbroken_run(runs):
    assert runs["resumed"]["resumes"], runs["resumed"]
    np.testing.assert_allclose(_losses(runs["resumed"]), _losses(runs["one"]), rtol=1e-5)
    assert runs["resumed"]["run"]["num_replicas"] == 2


def test_metrics_json_records_each_devices_bytes_at_stage_two(runs):
    memory = runs["zero2"]["memory"]
    sharding = runs["zero2"]["run"]["sharding"]
    assert sharding["stage"] == 2 and sharding["padded_weights"]  # 37, 30, 13 and 3 rows
    params = sharding["parameters_with_padding"]
    devices = [name for name in memory if name.startswith("/job:localhost")]
    assert len(devices) == 4
    for device in devices:
        # Stage 2, AdamW in float32: whole weights everywhere, a quarter of the moments.
        assert memory[device]["weights"] == pytest.approx(4 * params, rel=0.02)
        assert memory[device]["optimizer"] == pytest.approx(8 * params / 4, rel=0.02)
    # Logical devices share one allocator: no per-device peak to give.
    assert {entry["peak"] for entry in memory.values()} == {None}


def test_one_device_run_records_its_memory_too(runs):
    memory = runs["one"]["memory"]
    (device,) = memory
    params = runs["one"]["run"]["parameters"]
    assert memory[device]["weights"] == 4 * params
    assert memory[device]["peak"] > 0  # one device in its process: the allocator's peak


def test_saved_model_of_a_zero_run_is_plain_keras(runs):
    sys.path.insert(0, USER_CODE_ENV["PYTHONPATH"].split(os.pathsep)[0])
    loaded = keras.saving.load_model(str(runs["root"] / "zero2.keras"))
    assert loaded.name == "zero_user_model"
    assert loaded.count_params() == runs["zero2"]["run"]["parameters"]


def test_zero_with_a_strategy_it_cannot_serve_is_one_line(tmp_path):
    result = run_script("train.py", "--strategy=pipeline", "--zero=2", f"--model_dir={tmp_path}")
    line = one_line_error(result, 2)
    assert "--zero goes only with --strategy=hybrid or mirrored or multi_worker" in line
    assert not os.listdir(tmp_path)


def test_hybrid_mesh_with_zero_three_holds_each_weight_once_and_trains_as_one_device(runs):
    """data=2, pipe=2, --zero=3: each weight lives on its owner's device only (the other
    data replica reads it from there), so the data replicas together hold one copy, half
    of what zero=0's two copies hold; the run still trains as one device."""
    hybrid = runs["hybrid"][3]
    np.testing.assert_allclose(_losses(hybrid), _losses(runs["one"]), rtol=1e-5)
    assert hybrid["run"]["parameters"] == sum(STAGE_PARAMS)
    memory = {name[-5:]: held for name, held in hybrid["memory"].items()}
    assert sorted(memory) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    # Replica r's stage s runs on CPU:(2r + s). ZeRO's formula for stage 3, N = 2: each
    # data replica holds 4Ψ/2 bytes of weights, so both hold 4Ψ, half of zero=0's 2 x 4Ψ.
    per_replica = zero_state_bytes(3, sum(STAGE_PARAMS), 2).weights
    assert sum(held["weights"] for held in memory.values()) == 2 * per_replica
    for stage, params in enumerate(STAGE_PARAMS):
        # Each stage's weights once over its two devices: zero=0 holds 4 x params on each.
        pair = [memory[f"CPU:{2 * replica + stage}"] for replica in (0, 1)]
        assert sum(held["weights"] for held in pair) == 4 * params
        # Adam's moments with the weights, by owner (whole variables, dealt by size).
        for held in pair:
            assert held["optimizer"] in (2 * held["weights"], 2 * held["weights"] + 12)
    # Whole variables are dealt, not rows: stage 0's embedding goes to replica 1, stage
    # 1's 30x13 kernel to replica 0 and the head's kernel and the biases to replica 1 (so
    # each replica holds about half: 390 and 240 of the 630 parameters).
    assert [memory[f"CPU:{index}"]["weights"] for index in range(4)] == [
        0,
        4 * 30 * 13,
        4 * 37 * 5,
        4 * (13 + 13 * 3 + 3),
    ]


def test_zero_under_hybrid_with_the_data_axis_across_workers_is_one_line(tmp_path):
    """Refused before any worker is contacted (no other worker runs here)."""
    result = run_script(
        "train.py",
        "--strategy=hybrid",
        "--mesh=data=2,pipe=1",
        "--zero=3",
        "--cross_host_axis=data",
        "--worker_hosts=localhost:1,localhost:2",
        "--task_index=0",
        f"--model_dir={tmp_path}",
    )
    line = one_line_error(result, 1)
    assert "needs the data replicas in the chief's program" in line
    assert "--zero=3 with --cross_host_axis=data" in line


def test_zero_three_with_xla_under_hybrid_is_one_line(tmp_path):
    # XLA compiles a stage for one device and cannot read a weight its owner holds on another.
    result = run_script(
        "train.py",
        "--strategy=hybrid",
        "--mesh=data=2,pipe=2",
        "--zero=3",
        "--jit_compile",
        f"--model_dir={tmp_path}",
    )
    line = one_line_error(result, 2)
    assert "--zero=3 under --strategy=hybrid does not go with --jit_compile" in line
    assert not os.listdir(tmp_path)


def test_an_unknown_zero_stage_is_one_line(tmp_path):
    result = run_script("train.py", "--zero=4", f"--model_dir={tmp_path}")
    line = one_line_error(result, 2)
    assert "--zero" in line and "0|1|2|3" in line


def _launch(model_dir, num_workers, *args):
    result = run_script(
        "launch.py",
        f"--num_workers={num_workers}",
        "--devices_per_worker=1",
        "--",
        sys.executable,
        "scripts/train.py",
        *USER_RUN,
        "--strategy=multi_worker",
        "--epochs=2",
        f"--model_dir={model_dir}",
        *args,
        env=USER_CODE_ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(str(model_dir))


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    """ZeRO-3 and ZeRO-1 over 2 launched workers, one device each."""
    root = tmp_path_factory.mktemp("zero_workers")
    return {
        "zero3_2": _launch(root / "zero3_2", 2, "--zero=3"),
        "zero1_2": _launch(root / "zero1_2", 2, "--zero=1"),
    }


@pytest.mark.parametrize("run", ["zero3_2", "zero1_2"])
def test_zero_across_launched_workers_trains_as_one_device(runs, worker_runs, run):
    np.testing.assert_allclose(_losses(worker_runs[run]), _losses(runs["one"]), rtol=1e-5)


def test_memory_of_every_worker_is_gathered_on_the_chief_with_its_peak(worker_runs):
    record = worker_runs["zero3_2"]
    memory = record["memory"]
    params = record["run"]["sharding"]["parameters_with_padding"]
    assert sorted(memory) == [f"/job:worker/replica:0/task:{task}/device:CPU:0" for task in (0, 1)]
    for held in memory.values():
        # Stage 3: a half of the weights and of AdamW's moments on each worker.
        assert held["weights"] == pytest.approx(4 * params / 2, rel=0.02)
        assert held["optimizer"] == pytest.approx(8 * params / 2, rel=0.02)
        assert held["peak"] > held["weights"] + held["optimizer"]


KERAS_HUB_RUN = (
    "--model=zero_keras_hub_model:gpt2",
    "--dataset=zero_keras_hub_model:data",
    "--batch_size=16",
    "--steps_per_epoch=3",
    "--epochs=1",  # 3 steps, each from the weights the one before changed
)


def test_a_keras_hub_gpt2_with_tied_embedding_trains_under_zero3_as_on_one_device(tmp_path):
    """The token embedding is read twice (lookup and output projection): its blocks are
    gathered for each use and its gradients from both summed."""

    def losses(name, *args):
        model_dir = tmp_path / name
        result = run_script(
            "train.py", *KERAS_HUB_RUN, f"--model_dir={model_dir}", *args, env=USER_CODE_ENV
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return _losses(read_metrics(str(model_dir)))

    one = losses("one", "--strategy=one_device")
    zero3 = losses("zero3", "--strategy=mirrored", "--virtual_devices=2", "--zero=3")
    np.testing.assert_allclose(zero3, one, rtol=1e-5)
    # Under a hybrid mesh each data replica is a copy of the model: the embedding reused
    # outside its backbone must stay one weight in the copy (it was two, untied).
    mesh = ("--strategy=hybrid", "--mesh=data=2,pipe=2", "--virtual_devices=4")
    hybrid3 = losses("hybrid3", *mesh, "--microbatches=2", "--zero=3")
    np.testing.assert_allclose(hybrid3, one, rtol=1e-5)
