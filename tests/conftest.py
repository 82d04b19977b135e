"""Test set-up: split the CPU into logical devices before TensorFlow initialises."""

import fcntl
import json
import math
import os
import shutil
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's preemption handler (every training run's) asks whether it runs on GCP by an
# HTTP request to the metadata server, a DNS lookup off this machine: tests send only to
# loopback, so the request goes to a closed loopback port and is refused at once.
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_TEST_DEVICES = 8


def pytest_configure(config):
    from tfmulti.platform.runtime.devices import configure_logical_devices

    configure_logical_devices(NUM_TEST_DEVICES, device_type="CPU")


def pytest_collection_modifyitems(items):
    """Runs the files that took longest in the last profile (`tests/file_seconds.json`, which
    `make test-profile` writes) first, each file's tests in their order: `make test` hands
    whole files to its two workers (`--dist=loadfile`), so the run ends on short files, both
    workers busy, instead of on one slow file while the other waits. A file the record does
    not know yet counts as the slowest."""
    with open(os.path.join(os.path.dirname(__file__), "file_seconds.json")) as handle:
        seconds = json.load(handle)
    items.sort(key=lambda item: -seconds.get(item.nodeid.partition("::")[0], math.inf))


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """`shared_dir(name, fill)`: the directory `name`, which `fill(path)` writes once per test
    session, in whichever xdist worker asks first; every later ask, in any worker, waits for
    it and gets it as it is. Only for runs that tests read and never write."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own

    def get(name: str, fill) -> str:
        directory = root / f"shared-{name}"
        with open(root / f"shared-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (directory / ".filled").exists():
                shutil.rmtree(directory, ignore_errors=True)  # a failed fill's leftovers
                directory.mkdir()
                fill(str(directory))
                (directory / ".filled").touch()
        return str(directory)

    return get


@pytest.fixture(scope="session")
def one_device_metrics(shared_dir):
    """metrics.json of `scripts/train.py --strategy=one_device` on the shared small run."""
    from script_runner import TWO_EPOCHS, read_metrics, run_script

    def fill(model_dir: str) -> None:
        result = run_script(
            "train.py", *TWO_EPOCHS, "--strategy=one_device", f"--model_dir={model_dir}"
        )
        assert result.returncode == 0, result.stderr[-3000:]

    return read_metrics(shared_dir("one_device_two_epochs", fill))
