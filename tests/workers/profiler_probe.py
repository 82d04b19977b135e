"""One worker of a two-worker run whose worker 1 starts and stops TensorFlow's profiler often.

Usage: python profiler_probe.py --windows=N --profiling_rank=R
Worker R traces N windows of 2 steps each; the other does not trace. Prints
"probe finished <windows>" when every window was traced without a crash.
"""

import argparse
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmulti.compat  # noqa: E402

tfmulti.compat.install_when_keras_loads()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.platform.runtime import cluster as cluster_lib  # noqa: E402
from tfmulti.platform.runtime import input_sharding  # noqa: E402

STEPS_PER_WINDOW = 2


class ProfileEveryWindow(keras.callbacks.Callback):
    """Starts the profiler before every window's first step and stops it after its last."""

    def __init__(self):
        super().__init__()
        self.windows = 0
        self._directory = None

    def on_train_batch_begin(self, batch, logs=None):
        if batch % STEPS_PER_WINDOW == 0:
            self._directory = tempfile.mkdtemp(prefix="tfmulti-profiler-probe-")
            tf.profiler.experimental.start(self._directory)

    def on_train_batch_end(self, batch, logs=None):
        if batch % STEPS_PER_WINDOW == STEPS_PER_WINDOW - 1:
            tf.profiler.experimental.stop()
            shutil.rmtree(self._directory, ignore_errors=True)
            self.windows += 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=96)
    parser.add_argument("--profiling_rank", type=int, default=1)
    args = parser.parse_args()
    cluster = cluster_lib.resolve_cluster()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = cluster_lib.build_multi_worker_strategy(
        cluster, communication="ring", timeout_seconds=60, connect_timeout_seconds=150
    )
    rows = args.windows * STEPS_PER_WINDOW * 16
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), loss="mse")
    probe = ProfileEveryWindow()
    model.fit(
        input_sharding.apply_shard_policy(dataset, "data"),
        epochs=1,
        verbose=0,
        callbacks=[probe] if cluster.task_index == args.profiling_rank else [],
    )
    print(f"probe finished {probe.windows}", flush=True)


if __name__ == "__main__":
    main()
