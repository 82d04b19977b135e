"""Stages that call back into Python cannot run on another worker's device.

`tf.py_function` and `tf.numpy_function` run a Python function that only the process
that traced them holds: on a device the chief drives on another worker
(`tfmulti.platform.runtime.connected_cluster`) the op fails at the first step, deep in TensorFlow
("Could not find callback with key=pyfunc_3 in the registry"). A run checks its stages
before training and names the layer instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmulti.compat import keras_internals
from tfmulti.platform.runtime.devices import on_another_worker, worker_device_name

# The ops of tf.py_function, tf.numpy_function and tf.compat.v1.py_func.
PYTHON_CALL_OPS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


def refuse_python_calls_on_other_workers(
    stages: Sequence[keras.layers.Layer], stage_devices: Sequence[str], inputs
) -> None:
    """Raises a one-line ValueError naming the first layer that calls Python in a stage on
    another worker's device.

    Traces the built stages in turn on a batch like `inputs` (nothing runs); does nothing
    when every stage is on this process's devices.

    Example:
        >>> refuse_python_calls_on_other_workers(pipe.stages, pipe.stage_devices, x[:8])
    """
    remote = [on_another_worker(device) for device in stage_devices]
    if not any(remote):
        return
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)
    found = []

    def through_stages(part):
        graph = tf.compat.v1.get_default_graph()
        for stage, device, is_remote in zip(stages, stage_devices, remote, strict=True):
            before = len(graph.get_operations())
            part = stage(part, training=True)
            if is_remote:
                ops = graph.get_operations()[before:]
                found.extend((stage, device, op) for op in ops if op.type in PYTHON_CALL_OPS)
        return part

    tf.function(through_stages, autograph=False).get_concrete_function(specs)
    if found:
        stage, device, op = found[0]
        raise ValueError(
            f"Layer {_layer_of(stage, op.name)!r} calls Python ({op.type}, from "
            "tf.py_function or tf.numpy_function), which runs only in the chief's process, "
            f"but its stage runs on {worker_device_name(device)}; write the layer with "
            "TensorFlow ops, or cut the stages so it stays on the chief "
            f"(--partition=layers:...). Received: op {op.name!r}"
        )


def _layer_of(stage: keras.layers.Layer, op_name: str) -> str:
    """The innermost layer of `stage` whose name scope holds the op `op_name` (a stage cut
    from a model names its calls, `GraphStage.call_names`)."""
    names = {layer.name for layer in keras_internals.layers_within(stage)}
    names.update(name.split("/")[-1] for name in getattr(stage, "call_names", []))
    for scope in reversed(op_name.split("/")[:-1]):
        name = re.sub(r"_\d+$", "", scope)
        for candidate in (scope, name):
            if candidate in names:
                return candidate
    return op_name
