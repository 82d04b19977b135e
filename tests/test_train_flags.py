"""`scripts/train.py` rejects bad input with one line that names the problem.

Every flag check runs while absl parses the command line, before TensorFlow starts: the
bad flags are parsed by the script's own parser (`parse_flags_or_exit`, with the script's
flags defined) in one process, case by case, and one of them through the script itself;
the errors found once training has started are each a run of the script.
"""

import pytest
from script_runner import USER_CODE_ENV, last_line, parse_each, run_script

BAD_FLAGS = [
    ("--batch_size=0", "batch_size"),
    ("--epochs=0", "epochs"),
    ("--strategy=parameter_server", "strategy"),
    ("--model=vgg", "model"),
    ("--dataset=imagenet", "dataset"),
    ("--dtype=float8", "dtype"),
    ("--optimizer=lion", "optimizer"),
    ("--learning_rate=-1", "learning_rate"),
    ("--steps_per_execution=0", "steps_per_execution"),
    ("--profile_steps=5,3", "profile_steps"),
    ("--profile_steps=abc", "profile_steps"),
    ("--save_model=runs/model.h5", "save_model"),
    ("--virtual_devices=-2", "virtual_devices"),
    ("--virtual_devices=100000", "virtual_devices"),
    ("--collective_timeout=0.001", "collective_timeout"),
    ("--no_such_flag=1", "no_such_flag"),
    ("--tensor_parallel=2", "tensor_parallel"),
    ("--placement=auto", "placement"),
    ("--mesh=data=2,pipe=2", "mesh"),
    ("--strategy=hybrid", "mesh"),
    ("--schedule=interleaved_1f1b", "chunks"),
    ("--partition=evenly", "partition"),
    ("--trace_steps=0", "trace_steps"),
    ("--trace_steps=1,2", "trace_steps"),  # with the default --strategy=mirrored
    ("--worker_hosts=localhost:1234", "task_index"),
    ("--model_option=num_layers", "model_option"),
    ("--jit_compile", "jit_compile"),  # with the default --strategy=mirrored
    ("--norolled", "rolled"),
    # pipe is the default, so the other axis names a hybrid-only setting.
    ("--cross_host_axis=data", "cross_host_axis"),
]


@pytest.fixture(scope="module")
def parsed_bad_flags() -> dict:
    """{flag: (exit code, stderr)} of train.py's parser on each of `BAD_FLAGS` alone."""
    flags = [flag for flag, _ in BAD_FLAGS]
    results = parse_each("tfmulti.cli.train", [[flag] for flag in flags])
    return dict(zip(flags, results, strict=True))


@pytest.mark.parametrize("flag, name", BAD_FLAGS)
def test_bad_flag_exits_with_one_line_naming_the_flag(parsed_bad_flags, flag, name):
    code, stderr = parsed_bad_flags[flag]
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("train.py: error: ") and name in lines[0]
    assert "Traceback" not in stderr


def test_the_script_prints_a_bad_flag_as_its_one_line():
    result = run_script("train.py", "--tensor_parallel=2", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "train.py: error: --tensor_parallel goes only with --strategy=model_parallel, not "
        "--strategy=mirrored; drop it, or change --strategy"
    )


def test_global_batch_not_divisible_by_replicas_is_one_line(tmp_path):
    result = run_script(
        "train.py",
        "--virtual_devices=4",
        "--batch_size=30",
        "--epochs=1",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode != 0
    assert "batch_size=30" in last_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_more_devices_than_exist_is_one_line(tmp_path):
    result = run_script(
        "train.py", "--virtual_devices=2", "--num_devices=4", f"--model_dir={tmp_path}"
    )
    assert result.returncode != 0
    assert "--virtual_devices" in last_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_model_and_dataset_that_do_not_fit_is_one_line(tmp_path):
    result = run_script(
        "train.py", "--model=transformer", "--dataset=digits", f"--model_dir={tmp_path}"
    )
    assert result.returncode != 0
    assert "dataset" in last_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_missing_data_file_is_one_line(tmp_path):
    result = run_script(
        "train.py",
        "--dataset=npz",
        f"--data_path={tmp_path}/missing.npz",
        f"--model_dir={tmp_path}/run",
    )
    assert result.returncode != 0
    assert "missing.npz" in last_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_a_collective_that_times_out_is_one_line_naming_the_flag(tmp_path):
    # The user's model sums over a group of two devices that only one joins.
    result = run_script(
        "train.py",
        "--strategy=one_device",
        "--model=stalled_collective:stalled_mlp",
        "--epochs=1",
        "--steps_per_epoch=2",
        f"--model_dir={tmp_path}",
        env=USER_CODE_ENV,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    line = last_line(result.stderr)
    assert "did not arrive" in line and "--collective_timeout" in line
