"""Stages on another worker's devices run only inside traced functions.

Across workers the chief drives every worker's devices as its own (a connected cluster),
but TensorFlow cannot run an XLA-compiled function eagerly on a remote device: Keras runs
a grouped convolution on CPU (ConvNeXt's) through one, and any `jit_compile` layer is
one. So building and first calls never call such a stage eagerly, and a stage's variables
live on its own worker's device (an XLA function reads no variable of another device).
In-process, another worker is a device name with another task; the launched run puts a
ConvNeXt-style network's grouped convolutions on worker 1 and trains like one device.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from script_runner import (
    USER_CODE_ENV,
    assert_same_run,
    launch_training,
    read_metrics,
    run_script,
)

from tfmulti.hybrid import HybridPipelineModel
from tfmulti.pipeline.runtime import PipelineModel, pipeline_model
from tfmulti.pipeline.stages import python_calls
from tfmulti.platform.runtime.devices import logical_device_names, on_another_worker
from tfmulti.platform.runtime.variable_moves import same_device

GROUPED_CONVNET = (
    "--model=user_applications:grouped_convnet",
    "--dataset=user_applications:images_16",
    "--batch_size=16",
    "--epochs=2",
    "--steps_per_epoch=3",
    "--log_steps=0",
)


class EagerRecorder(keras.layers.Layer):
    """A Dense layer that records, at every call, whether it runs eagerly."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(1))
        self.eager_calls = []

    def call(self, inputs):
        self.eager_calls.append(tf.executing_eagerly())
        return self.dense(inputs)


def _first_stage():
    return keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(0))


def test_a_device_with_another_task_is_another_workers():
    own = logical_device_names("CPU")[1]
    assert not on_another_worker(own)
    assert not on_another_worker("/device:CPU:1")
    assert on_another_worker("/job:worker/replica:0/task:1/device:CPU:1")


def test_the_same_device_index_on_another_worker_is_another_device():
    assert same_device("/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0")
    assert not same_device("/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0")


class PythonDoubling(keras.layers.Layer):
    """Doubles its input in Python, through tf.py_function."""

    def call(self, inputs):
        doubled = tf.py_function(lambda values: values * 2.0, [inputs], tf.float32)
        return tf.ensure_shape(doubled, inputs.shape)


def test_a_layer_that_calls_python_on_another_worker_is_one_line(monkeypatch):
    monkeypatch.setattr(python_calls, "on_another_worker", lambda device: device.endswith(":1"))
    devices = logical_device_names("CPU")[:2]
    pipe = PipelineModel([_first_stage(), PythonDoubling(name="doubling")], devices)
    x = tf.ones((4, 3))
    pipe.build_stages(x)
    with pytest.raises(ValueError) as error:
        python_calls.refuse_python_calls_on_other_workers(pipe.stages, devices, x)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("Layer 'doubling' calls Python (EagerPyFunc, from tf.py_function")
    assert "write the layer with TensorFlow ops" in message
    # On the chief's own devices the same stages pass.
    python_calls.refuse_python_calls_on_other_workers(pipe.stages[::-1], devices, x)


@pytest.fixture
def odd_cpus_on_another_worker(monkeypatch):
    """Makes pipelines take CPU:1 and CPU:3 for devices of another worker."""
    monkeypatch.setattr(
        pipeline_model, "on_another_worker", lambda device: device.endswith((":1", ":3"))
    )


def test_a_stage_on_another_worker_is_never_called_eagerly(odd_cpus_on_another_worker):
    recorder = EagerRecorder()
    devices = logical_device_names("CPU")[:2]
    pipe = PipelineModel([_first_stage(), recorder], devices, num_microbatches=2)
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 3)), tf.float32)
    outputs = pipe(x)  # builds, as a run's first call on its sample batch does
    assert recorder.eager_calls and not any(recorder.eager_calls)
    np.testing.assert_allclose(outputs, recorder.dense(pipe.stages[0](x)), rtol=1e-6)


def test_no_replica_calls_a_stage_on_another_worker_eagerly(odd_cpus_on_another_worker):
    recorders = []

    def make_stages():
        recorders.append(EagerRecorder())
        return [_first_stage(), recorders[-1]]

    devices = logical_device_names("CPU")
    hybrid = HybridPipelineModel(make_stages, [devices[0:2], devices[2:4]], 2)
    hybrid(tf.ones((8, 3)))
    assert len(recorders) == 2 and recorders[0].eager_calls
    assert not any(call for recorder in recorders for call in recorder.eager_calls)


# Over 2 launched workers: a hybrid mesh whose pipe axis crosses them (2 devices each), the
# chief-driven path `--strategy=pipeline` across workers takes too, with data replicas on
# top (a pipeline's own model is test_a_stage_on_another_worker_is_never_called_eagerly's).
# Grouped convolutions hold no BatchNorm, so two micro-batches sum to one device's batch.
LAYOUTS = {
    "hybrid-2x2": ((2, 2), ("--strategy=hybrid", "--mesh=data=2,pipe=2", "--microbatches=2")),
}


@pytest.fixture(scope="module")
def grouped_convnet_one_device(shared_dir) -> str:
    """The one-device run of `GROUPED_CONVNET`, once per session."""

    def fill(model_dir: str) -> None:
        result = run_script(
            "train.py",
            *GROUPED_CONVNET,
            "--strategy=one_device",
            f"--model_dir={model_dir}",
            env=USER_CODE_ENV,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    return shared_dir("grouped_convnet_one_device", fill)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_convolutions_on_another_worker_train_like_one_device(
    tmp_path, monkeypatch, grouped_convnet_one_device, layout
):
    (num_workers, devices_per_worker), flags = LAYOUTS[layout]
    monkeypatch.setenv("PYTHONPATH", USER_CODE_ENV["PYTHONPATH"])
    model_dir = str(tmp_path / "run")
    returncode, output = launch_training(
        *GROUPED_CONVNET,
        *flags,
        f"--model_dir={model_dir}",
        num_workers=num_workers,
        devices_per_worker=devices_per_worker,
        timeout=300,
    )
    assert returncode == 0, output[-3000:]
    last_stage = read_metrics(model_dir)["run"]["split"]["stages"][-1]
    assert "task:1" in last_stage["device"] and "grouped_2" in last_stage["blocks"]
    assert_same_run(model_dir, grouped_convnet_one_device)
