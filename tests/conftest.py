"""Test set-up: split the CPU into logical devices before TensorFlow initialises."""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_TEST_DEVICES = 8


def pytest_configure(config):
    from tfmulti.platform.devices import configure_logical_devices

    configure_logical_devices(NUM_TEST_DEVICES, device_type="CPU")


@pytest.fixture(scope="session")
def one_device_metrics(tmp_path_factory):
    """metrics.json of `scripts/train.py --strategy=one_device` on the shared small run."""
    from script_runner import TWO_EPOCHS, read_metrics, run_script

    model_dir = str(tmp_path_factory.mktemp("one_device"))
    result = run_script(
        "train.py", *TWO_EPOCHS, "--strategy=one_device", f"--model_dir={model_dir}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(model_dir)
