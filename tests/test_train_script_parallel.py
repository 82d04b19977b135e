"""`scripts/train.py` under every parallel strategy trains like one device.

Each run goes through the real script (and `scripts/launch.py` for multi-worker)
and is compared with a `--strategy=one_device` run of the same flags: same
weights imply the same validation loss, which `metrics.json` records.
"""

import glob
import json
import os
import re
import signal
import subprocess
import time

import pytest
from script_runner import (
    COMMON,
    TWO_EPOCHS,
    USER_CODE_ENV,
    assert_same_training,
    assert_split_recorded,
    last_line,
    launch_training,
    read_metrics,
    run_script,
    start_launched_training,
    worker_pid,
)
from test_elastic_training import FLAGS as ELASTIC_FLAGS
from test_elastic_training import one_device_reference as elastic_one_device_reference


# One run per path the script's flags choose: the unrolled step, the rolled loop, and the
# rolled loop with a split backward. GPipe rolled is the 1F1B path with other data (a schedule
# is data); tests/test_pipeline_rolled.py holds it, with every schedule, in process.
@pytest.mark.parametrize(
    "schedule, rolled", [("gpipe", "--norolled"), ("1f1b", "--rolled"), ("zb_h1", "--rolled")]
)
def test_pipeline_script_trains_like_one_device(tmp_path, one_device_metrics, schedule, rolled):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        rolled,
        "--strategy=pipeline",
        "--virtual_devices=4",
        "--num_stages=2",
        "--microbatches=4",
        f"--schedule={schedule}",
        "--partition=params",
        "--trace_steps=3,3",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(read_metrics(model_dir), one_device_metrics)
    split = assert_split_recorded(result, read_metrics(model_dir), num_stages=2)
    assert split["schedule"] == schedule
    timeline = f"{model_dir}/logs/pipeline_timeline"
    assert os.path.getsize(f"{timeline}/step3.png") > 0
    with open(f"{timeline}/step3.trace.json") as handle:
        assert json.load(handle)["traceEvents"]


@pytest.mark.parametrize(
    "strategy_flags",
    [
        ("--strategy=model_parallel",),
        ("--strategy=pipeline", "--microbatches=4", "--jit_compile"),  # XLA per stage
    ],
    ids=["model_parallel", "pipeline-xla"],
)
def test_staged_script_trains_like_one_device(tmp_path, one_device_metrics, strategy_flags):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        *strategy_flags,
        "--virtual_devices=2",
        "--num_stages=2",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(read_metrics(model_dir), one_device_metrics)


@pytest.mark.parametrize("placement", ["params", "time"])
def test_placed_model_parallel_script_trains_like_one_device(
    tmp_path, one_device_metrics, placement
):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        "--strategy=model_parallel",
        f"--placement={placement}",
        "--virtual_devices=3",
        "--num_stages=3",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "/device:CPU:2" in result.stderr
    assert_same_training(read_metrics(model_dir), one_device_metrics)


TENSOR_PARALLEL_RUN = (
    "--strategy=model_parallel",
    "--model=transformer",
    "--dataset=tokens",
    "--model_option=num_layers=1",
    "--batch_size=16",
    "--epochs=1",
    "--steps_per_epoch=3",
    "--validation_steps=2",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--num_stages=1",
    "--virtual_devices=2",
)


# docs/guide/tensor_parallel.md's tensor-parallel command, which test_documented_commands.py
# (RUN_BY_TRAIN_TESTS) therefore does not run again.
TWO_WAY_TENSOR_PARALLEL_RUN = (*TENSOR_PARALLEL_RUN, "--tensor_parallel=2")


def test_tensor_parallel_transformer_script_trains_like_unsplit(tmp_path):
    # Split over 2 devices, summing with the ring of placed ops and with TensorFlow's
    # collective all-reduce, against the unsplit model.
    records = {}
    runs = {"unsplit": (*TENSOR_PARALLEL_RUN, "--tensor_parallel=1")}
    for reduction in ("ring", "collective"):
        runs[reduction] = (*TWO_WAY_TENSOR_PARALLEL_RUN, f"--tensor_reduce={reduction}")
    for name, flags in runs.items():
        model_dir = str(tmp_path / name)
        result = run_script("train.py", *flags, f"--model_dir={model_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        records[name] = read_metrics(model_dir)
    assert_same_training(records["ring"], records["unsplit"])
    assert_same_training(records["collective"], records["unsplit"])


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--tensor_reduce=nccl",), "tensor_reduce"),
        (("--strategy=one_device", "--tensor_reduce=collective", "--jit_compile"), "jit_compile"),
    ],
)
def test_a_bad_tensor_reduce_value_or_combination_is_one_line(tmp_path, flags, named):
    result = run_script("train.py", *TENSOR_PARALLEL_RUN, *flags, f"--model_dir={tmp_path}")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    line = last_line(result.stderr)
    assert "--tensor_reduce" in line and named in line
    assert "ring" in line


@pytest.mark.parametrize("dtype", ["mixed_float16", "mixed_bfloat16"])
def test_pipelined_transformer_trains_under_mixed_precision(tmp_path, dtype):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        "--strategy=pipeline",
        "--virtual_devices=2",
        "--num_stages=2",
        "--microbatches=2",
        "--model=transformer",
        "--dataset=tokens",
        f"--dtype={dtype}",
        "--batch_size=16",
        "--epochs=1",
        "--steps_per_epoch=3",
        "--validation_steps=1",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(model_dir)
    assert metrics["status"] == "completed"
    assert isinstance(metrics["final"]["loss"], float)


def test_batch_smaller_than_the_microbatches_is_one_line(tmp_path):
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        "--batch_size=4",
        "--strategy=pipeline",
        "--virtual_devices=2",
        "--microbatches=5",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "--microbatches" in last and "batch_size=4" in last, last
    assert "Traceback" not in result.stderr


def test_multi_worker_script_trains_like_one_device_with_chief_only_outputs(
    tmp_path, one_device_metrics, monkeypatch
):
    # TensorFlow's preemption handler waits on the chief's coordination service in a thread
    # of every worker; a wait still pending when the chief's process ends fails
    # (UnavailableError) with a traceback. slow_worker_exit makes worker 1 end after the
    # chief every time, as a loaded machine sometimes does: the run prints no traceback.
    monkeypatch.setenv("PYTHONPATH", USER_CODE_ENV["PYTHONPATH"])
    model_dir = str(tmp_path / "run")
    returncode, output = launch_training(
        *TWO_EPOCHS,
        "--strategy=multi_worker",
        "--profile_steps=2,3",
        "--callbacks=slow_worker_exit:callbacks",
        f"--model_dir={model_dir}",
    )
    assert returncode == 0, output[-3000:]
    assert "[worker 1] Ended after the chief; watcher threads left: []" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    metrics = read_metrics(model_dir)
    assert metrics["run"]["num_replicas"] == 4
    assert_same_training(metrics, one_device_metrics)
    top_level = sorted(os.listdir(model_dir))
    assert top_level == ["backup", "checkpoints", "logs", "metrics.json"]
    assert not glob.glob(f"{model_dir}/**/*worker1*/**", recursive=True)
    traces = sorted(glob.glob(f"{model_dir}/logs/train/plugins/profile/*/*.xplane.pb"))
    # TensorFlow's profiler corrupts non-chief heaps (tfmulti/compat/tf_profiler.py).
    assert [os.path.basename(t) for t in traces] == ["worker0.xplane.pb"]
    assert "[worker 1]" in output and "records no profile" in output
    # Only the chief prints Keras's progress lines and the final paths.
    progress = [line for line in output.splitlines() if " - loss: " in line]
    assert len(progress) == 2 and all(line.startswith("[worker 0]") for line in progress)
    paths = [line for line in output.splitlines() if "Metrics: " in line]
    assert len(paths) == 1 and paths[0].startswith("[worker 0]")


def test_multi_worker_script_with_steps_per_execution_trains_like_one_step_per_call(tmp_path):
    # 4 steps per epoch and 4 validation steps, in calls of 2 steps (Keras runs whole
    # calls, so the counts divide by 2 to compare with one step per call).
    flags = (*COMMON, "--epochs=2", "--steps_per_epoch=4", "--validation_steps=4")
    reference_dir = str(tmp_path / "one_step_per_call")
    reference = run_script(
        "train.py", *flags, "--strategy=one_device", f"--model_dir={reference_dir}"
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    model_dir = str(tmp_path / "run")
    returncode, output = launch_training(
        *flags, "--strategy=multi_worker", "--steps_per_execution=2", f"--model_dir={model_dir}"
    )
    assert returncode == 0, output[-3000:]
    assert_same_training(read_metrics(model_dir), read_metrics(reference_dir))


def test_a_one_host_strategy_launched_on_two_workers_is_one_line(tmp_path):
    # Two independent copies would each train alone and write the same model_dir.
    model_dir = tmp_path / "run"
    returncode, output = launch_training(
        *TWO_EPOCHS, "--strategy=model_parallel", f"--model_dir={model_dir}"
    )
    assert returncode == 1
    assert "Traceback" not in output
    assert "--strategy=model_parallel trains on one host, but this process is worker" in output
    assert "use --strategy=multi_worker, pipeline or hybrid" in output
    assert not (model_dir / "metrics.json").exists()


def _signal_worker_once_checkpointed(
    launcher: subprocess.Popen, model_dir: str, global_step: int, signum: int
) -> int:
    """Sends `signum` to worker 1 once the chief's step checkpoint `global_step` exists."""
    checkpoint = os.path.join(model_dir, "backup", f"step-{global_step:09d}.json")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        if os.path.exists(checkpoint):
            pid = worker_pid(model_dir, rank=1)
            if pid is not None:
                os.kill(pid, signum)
                return pid
        time.sleep(0.01)
    raise AssertionError(f"no step checkpoint {global_step} while the launcher ran")


def test_preempted_then_killed_workers_restart_the_group_which_resumes_the_exact_step(
    tmp_path, shared_dir
):
    model_dir = str(tmp_path / "run")
    # tests/test_elastic_training.py's run, whose one-device record the session shares:
    # epochs of 20 steps with a checkpoint every 5. Each signal lands 15 steps before its
    # epoch ends, and the kill in the last epoch leaves steps to run after the resume.
    launcher = start_launched_training(
        ("--num_workers=2", "--max_restarts=2"),
        (*ELASTIC_FLAGS, "--strategy=multi_worker", f"--model_dir={model_dir}"),
    )
    try:
        # SIGTERM in epoch 2 (after global step 25): both workers save at the step they
        # agree on and exit 42. SIGKILL in epoch 3 (after step 45): a crash, no save.
        _signal_worker_once_checkpointed(launcher, model_dir, 25, signal.SIGTERM)
        _signal_worker_once_checkpointed(launcher, model_dir, 45, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    # Both workers save at the agreed step and exit 42; the launcher names the first it sees.
    assert re.search(r"worker [01] was preempted and saved a checkpoint \(code 42\)", output)
    assert "worker 1 was killed by SIGKILL" in output
    assert output.count("restarting all workers") == 2
    assert "Epoch 1/3" not in output.split("restarting all workers", 1)[1]
    metrics = read_metrics(model_dir)
    assert metrics["status"] == "completed"
    assert [epoch["epoch"] for epoch in metrics["epochs"]] == [1, 2, 3]
    (preemption,) = metrics["preemptions"]
    after_preemption, after_kill = metrics["resumes"]
    assert preemption["epoch"] == 2 and preemption["step"] > 5
    assert (after_preemption["epoch"], after_preemption["step"]) == (2, preemption["step"])
    assert after_kill["epoch"] == 3 and after_kill["step"] in (5, 10)
    assert f"Resuming at epoch 3, step {after_kill['step']}" in output
    assert_same_training(metrics, read_metrics(elastic_one_device_reference(shared_dir)))
