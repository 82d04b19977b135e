"""TensorFlow's start-up notices stay off the console unless the user asks for them;
real errors still show."""

import os

import pytest
from script_runner import last_line, run_script

from tfmulti.platform.runtime.tf_startup import STARTUP_NOISE, stderr_without

NOTICES = ("cuInit", "Could not find cuda drivers", "absl::InitializeLog")
TINY_RUN = (
    "--strategy=one_device",
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=16",
    "--epochs=1",
    "--steps_per_epoch=1",
    "--validation_steps=1",
    "--log_steps=0",
)
# Fails right after TensorFlow lists the devices: as telling as a run, and quicker.
TOO_MANY_DEVICES = ("--virtual_devices=2", "--num_devices=4")


def test_a_cpu_run_prints_no_tensorflow_startup_notice(tmp_path):
    result = run_script("train.py", *TINY_RUN, f"--model_dir={tmp_path}")

    assert result.returncode == 0, result.stderr[-3000:]
    assert not [notice for notice in NOTICES if notice in result.stderr], result.stderr


@pytest.mark.parametrize(
    "flag, env",
    [("--tf_log_level=0", {}), (None, {"TF_CPP_MIN_LOG_LEVEL": "0"})],
    ids=["flag", "environment"],
)
def test_the_users_log_level_brings_the_notices_back_and_errors_still_show(flag, env, tmp_path):
    args = [*TOO_MANY_DEVICES, f"--model_dir={tmp_path}", *([flag] if flag else [])]
    result = run_script("train.py", *args, env=env, timeout=120)

    assert result.returncode == 1
    assert "failed call to cuInit" in result.stderr
    assert "--virtual_devices" in last_line(result.stderr)


def test_a_quiet_start_still_shows_the_users_error(tmp_path):
    result = run_script("train.py", *TOO_MANY_DEVICES, f"--model_dir={tmp_path}", timeout=120)

    assert result.returncode == 1
    assert "cuInit" not in result.stderr
    assert "--virtual_devices" in last_line(result.stderr)


def test_filter_drops_startup_notices_and_passes_every_other_line(capfd):
    written = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your machine.\n"
        "E0000 00:00:1.0 1 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n"
        "E0000 00:00:1.0 1 bfc_allocator.cc:1] Allocator ran out of memory\n"
        "a Python warning\n"
    )
    with stderr_without(STARTUP_NOISE):
        os.write(2, written.encode())

    assert capfd.readouterr().err == (
        "E0000 00:00:1.0 1 bfc_allocator.cc:1] Allocator ran out of memory\na Python warning\n"
    )
