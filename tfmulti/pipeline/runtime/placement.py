"""Devices of pipeline stages: name checking, and building each stage's variables there."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmulti.devices import variable_device


def resolve_devices(devices: Sequence[str]) -> list[str]:
    """Returns the full logical-device name of each of `devices`.

    Accepts any spelling TensorFlow does ("/cpu:1", "GPU:0", "/device:CPU:3",
    "/job:localhost/replica:0/task:0/device:CPU:3").

    Raises:
        ValueError: a device is not a logical device of this process, or appears twice.
    """
    available = {}
    by_full_name = {}
    for logical in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(logical.name)
        by_full_name[spec.to_string()] = logical.name
        # In a cluster the list also holds other workers' devices, after this worker's.
        available.setdefault((spec.device_type.upper(), spec.device_index), logical.name)
    resolved = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except ValueError as error:
            raise ValueError(
                f"Cannot read device name {name!r}; write it like '/device:CPU:0'. "
                f"Available: {sorted(available.values())}"
            ) from error
        if spec.to_string() in by_full_name:
            resolved.append(by_full_name[spec.to_string()])
            continue
        key = ((spec.device_type or "").upper(), spec.device_index)
        if key not in available:
            raise ValueError(
                f"Unknown device {name!r}. Use one of {sorted(available.values())}, or "
                "make more with tfmulti.devices.configure_logical_devices."
            )
        resolved.append(available[key])
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"Each pipeline device must appear once. Received: devices={devices}")
    return resolved


def build_stages_on_devices(
    stages: Sequence[keras.layers.Layer], stage_device_names: Sequence[str], inputs
) -> None:
    """Builds every unbuilt stage under its device, feeding each the previous one's output spec.

    Keras builds layers eagerly inside `tf.init_scope`, which forgets the device scope of a
    traced function, so the device is entered again inside it.

    Args:
        stages: the stages, in order.
        stage_device_names: the device of each stage.
        inputs: a nest of tensors or KerasTensors shaped like one batch of stage 0's input.
    """
    spec = tf.nest.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=keras.backend.standardize_dtype(t.dtype)),
        inputs,
    )
    with tf.init_scope():
        for stage, device in zip(stages, stage_device_names, strict=True):
            with tf.device(device):
                spec = stage(spec)


def check_stage_placement(
    stages: Sequence[keras.layers.Layer], stage_device_names: Sequence[str]
) -> None:
    """Raises ValueError when a stage's variable lives off its stage's device."""
    for index, (stage, device) in enumerate(zip(stages, stage_device_names, strict=True)):
        expected = tf.DeviceSpec.from_string(device)
        for variable in stage.variables:
            actual = tf.DeviceSpec.from_string(variable_device(variable))
            if (actual.device_type, actual.device_index) != (
                expected.device_type,
                expected.device_index,
            ):
                raise ValueError(
                    f"Stage {index}'s variable {variable.path!r} is on "
                    f"{variable_device(variable)}, "
                    f"not on its stage device {device}: the stage was built before the "
                    "pipeline placed it. Pass unbuilt layers (the pipeline builds them), or "
                    f"build stage {index} under `tf.device({device!r})`."
                )
