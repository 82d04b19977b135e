"""Test set-up: split the CPU into logical devices before TensorFlow initialises."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_TEST_DEVICES = 8


def pytest_configure(config):
    from tfmulti.devices import configure_logical_devices

    configure_logical_devices(NUM_TEST_DEVICES, device_type="CPU")
