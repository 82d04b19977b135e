"""TensorFlow's start-up notices stay off the console unless the user asks for them;
real errors still show."""

import os

import pytest
from script_runner import last_line, run_script

from tfmulti.platform.runtime.tf_startup import STARTUP_NOISE, stderr_without

NOTICES = ("cuInit", "Could not find cuda drivers", "absl::InitializeLog")
# Fails right after TensorFlow lists the devices: as telling as a run, and quicker.
TOO_MANY_DEVICES = ("--virtual_devices=2", "--num_devices=4")


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


def test_a_quiet_start_prints_no_tensorflow_startup_notice_and_still_shows_the_users_error(
    tmp_path,
):
    result = run_script("train.py", *TOO_MANY_DEVICES, f"--model_dir={tmp_path}", timeout=120)

    assert result.returncode == 1
    assert not [notice for notice in NOTICES if notice in result.stderr], result.stderr
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


# A script run by `run_script` that loaded TensorFlow and leaves, at exit, what a user's
# program may: a TensorBoard writer that never flushes by itself, a text file and an HDF5
# file left open, a thread still writing, exit handlers, buffered output, and an object
# whose finalizer runs only in the interpreter's teardown (which run_script skips). Its
# main raises a user error: one line and exit code 1.
QUICK_EXIT_PROGRAM = r"""
import atexit, os, sys, threading, time
import h5py, numpy as np, tensorflow as tf
from tfmulti.flags.parsing import run_script

out = sys.argv[1]
left_open = []


class TornDown:
    # It holds what it needs, since the teardown empties the modules first.
    def __del__(self, path=os.path.join(out, "torn_down.txt"), write=open):
        with write(path, "w") as handle:
            handle.write("yes")


kept_until_teardown = TornDown()


def late_writer():
    time.sleep(0.5)
    with open(os.path.join(out, "thread.txt"), "w") as handle:
        handle.write("done")


def main(argv):
    writer = tf.summary.create_file_writer(os.path.join(out, "logs"), max_queue=1000,
                                           flush_millis=10**9)
    with writer.as_default():
        tf.summary.scalar("loss", 0.5, step=1)
    text = open(os.path.join(out, "notes.txt"), "w")
    text.write("kept")
    weights = h5py.File(os.path.join(out, "weights.h5"), "w")
    weights["kernel"] = np.arange(6.0)
    left_open.extend([writer, text, weights])  # still open at exit
    threading.Thread(target=late_writer).start()
    atexit.register(lambda: open(os.path.join(out, "atexit.txt"), "w").write("ran"))
    print("buffered", end="")
    raise ValueError("a bad value")


run_script(main, (ValueError,))
"""


@pytest.fixture(scope="module")
def quick_exit_run(tmp_path_factory):
    """(CompletedProcess, output directory) of `QUICK_EXIT_PROGRAM`."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("quick_exit")
    result = subprocess.run(
        [sys.executable, "-c", QUICK_EXIT_PROGRAM, str(out)],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=300,
    )
    return result, out


def test_an_exit_without_teardown_keeps_everything_left_open(quick_exit_run):
    """What `run_script` does at the end of a TensorFlow program: threads, exit handlers
    and every open writer's data are as after Python's own exit."""
    import h5py
    import numpy as np
    from tensorflow.core.util import event_pb2
    from tensorflow.python.lib.io import tf_record

    result, out = quick_exit_run
    assert result.stdout == "buffered", result.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "kept"
    assert (out / "thread.txt").read_text() == "done"
    assert (out / "atexit.txt").read_text() == "ran"
    with h5py.File(out / "weights.h5", "r") as handle:
        np.testing.assert_array_equal(handle["kernel"][()], np.arange(6.0))
    (events_file,) = (out / "logs").iterdir()
    tags = [
        value.tag
        for record in tf_record.tf_record_iterator(str(events_file))
        for value in event_pb2.Event.FromString(record).summary.value
    ]
    assert tags == ["loss"]


def test_a_script_that_loaded_tensorflow_skips_the_teardown_and_keeps_its_exit_code(
    quick_exit_run,
):
    result, out = quick_exit_run
    assert result.returncode == 1, result.stderr[-2000:]
    assert last_line(result.stderr) == "-c: error: a bad value"
    assert (out / "atexit.txt").read_text() == "ran"
    assert not (out / "torn_down.txt").exists()
