"""The keras.distribution hooks: active after `import tfmulti`, off on unchecked Keras, and
still needed (Keras' TensorFlow backend shards nothing by itself)."""

import json
import os
import subprocess
import sys

import pytest

import tfmulti  # noqa: F401
from tfmulti.compat import keras_distribution_tf

# Plain Keras on TensorFlow, without tfmulti: a Dense kernel laid out over 2 devices.
UPSTREAM_PROBE = """
import json
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from keras.src.backend.tensorflow import distribution_lib
mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["dense/kernel"] = (None, "model")
with keras.distribution.ModelParallel(layout_map=layout_map).scope():
    layer = keras.layers.Dense(4, name="dense")
    layer.build((None, 8))
print(json.dumps({
    "kernels": [list(v.shape) for v in layer.weights if "kernel" in v.path],
    "devices": sorted({v.value.device for v in layer.weights}),
    "distribute_value": repr(distribution_lib.distribute_value(None, None)),
}))
"""


def test_patches_are_active_after_import_tfmulti():
    assert keras_distribution_tf.active_patch_names() == [
        patch.name for patch in keras_distribution_tf.PATCHES
    ]


@pytest.mark.parametrize(
    "version, applies", [((3, 9), False), ((3, 15, 1), True), ((3, 16), False)]
)
def test_patches_apply_only_to_checked_keras_versions(version, applies):
    assert [patch.applies_to(version) for patch in keras_distribution_tf.PATCHES] == [
        applies
    ] * len(keras_distribution_tf.PATCHES)


def test_tensorflow_backend_still_shards_nothing_by_itself():
    result = subprocess.run(
        [sys.executable, "-c", UPSTREAM_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["kernels"] == [[8, 4]] and len(probe["devices"]) == 1, (
        f"Keras' TensorFlow backend now lays out variables itself ({probe}): check "
        "tfmulti.compat.keras_distribution_tf against it before raising FIRST_UNCHECKED_KERAS"
    )
    assert probe["distribute_value"] == "None"
