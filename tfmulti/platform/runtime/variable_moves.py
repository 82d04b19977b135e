"""Moving built Keras variables to another device while they keep their identity.

Layers, optimizers and checkpoints hold on to the Keras variable object, so a variable is
moved by re-creating its backing `tf.Variable` under the new device, never replaced.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.compat.keras_internals import reinitialize_variable, variable_device
from tfmulti.platform.runtime.devices import device_key


def same_device(first: str, second: str) -> bool:
    """Whether two device names name the same device: the same type and index, on the same
    worker (job and task) where both names say which.

    Example:
        >>> same_device("/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0")
        True
        >>> same_device("/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0")
        False
    """
    specs = [tf.DeviceSpec.from_string(name) for name in (first, second)]
    if all(spec.job is not None for spec in specs):
        if len({(spec.job, spec.task or 0) for spec in specs}) > 1:
            return False
    return device_key(first) == device_key(second)


def move_variable(variable: keras.Variable, device: str) -> None:
    """Moves `variable`'s storage to `device`; the Keras variable stays the same object.

    Example:
        >>> move_variable(layer.kernel, "/device:CPU:1")
    """
    if same_device(variable_device(variable), device):
        return
    # Keras re-creates the backing tf.Variable from a value: under this device scope it
    # lands on `device`.
    with tf.init_scope(), tf.device(device):
        reinitialize_variable(variable, tf.identity(variable.value))
