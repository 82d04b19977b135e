"""Devices of pipeline stages: name checking, and building each stage's variables there."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmulti.compat import keras_internals
from tfmulti.compat.keras_internals import variable_device
from tfmulti.platform.runtime.variable_moves import move_variable, same_device


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
                "make more with tfmulti.platform.runtime.devices.configure_logical_devices."
            )
        resolved.append(available[key])
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"Each pipeline device must appear once. Received: devices={devices}")
    return resolved


def build_stages_on_devices(
    stages: Sequence[keras.layers.Layer], stage_device_names: Sequence[str], inputs
):
    """Builds every unbuilt stage under its device, feeding each the previous one's output
    spec; returns the last stage's (KerasTensors).

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
    return spec


def build_from_build_configs(
    stages: Sequence[keras.layers.Layer],
    built_stages: Sequence[keras.layers.Layer],
    stage_device_names: Sequence[str],
) -> None:
    """Builds unbuilt copies of `built_stages` under their devices from the built layers'
    build configs (input shapes), as Keras rebuilds a model it loads, without tracing a
    call through them; a data replica's copy of a pipeline builds this way. Layers left
    unbuilt (no build config) are for the caller to build by calling the stages
    (`build_stages_on_devices`).
    """
    with tf.init_scope():
        for stage, built, device in zip(stages, built_stages, stage_device_names, strict=True):
            copies = keras_internals.layers_within(stage)
            originals = keras_internals.layers_within(built)
            if len(copies) != len(originals):
                return
            with tf.device(device):
                # Parents come before their layers: a parent's build may build them.
                holders = []
                for copy, original in zip(copies, originals, strict=True):
                    config = original.get_build_config() if original.built else None
                    if copy.built or not config:
                        continue
                    if type(copy).build is keras.layers.Layer.build:
                        holders.append(copy)  # built once the layers it holds are
                    else:
                        copy.build_from_config(config)
                for holder in holders:
                    holder.built = True


def owned_variables(stages: Sequence[keras.layers.Layer]) -> list[list]:
    """Per stage, the variables it places on its device: those no earlier stage holds (a
    weight tied between stages lives with the first stage that uses it), except the shards
    of tensor-parallel layers, which live on their own group of devices."""
    # Imported here: tfmulti.parallel's placement imports the pipeline runtime.
    from tfmulti.tensor_parallel.sharded_layer import TensorParallelLayer

    seen = set()
    owned = []
    for stage in stages:
        self_placed = {
            id(v)
            for layer in keras_internals.layers_within(stage)
            if isinstance(layer, TensorParallelLayer)
            for v in layer.variables
        }
        own = [v for v in stage.variables if id(v) not in seen and id(v) not in self_placed]
        seen.update(id(v) for v in stage.variables)
        owned.append(own)
    return owned


def move_built_stages(
    stages: Sequence[keras.layers.Layer], stage_device_names: Sequence[str]
) -> None:
    """Moves the variables of every built stage onto its stage's device (unbuilt stages are
    built there later); a tied weight goes to the first stage that holds it."""
    for stage, variables, device in zip(
        stages, owned_variables(stages), stage_device_names, strict=True
    ):
        if stage.built:
            for variable in variables:
                move_variable(variable, device)


def check_stage_placement(
    stages: Sequence[keras.layers.Layer], stage_device_names: Sequence[str]
) -> None:
    """Raises ValueError when a stage's variable lives off its stage's device."""
    for index, (variables, device) in enumerate(
        zip(owned_variables(stages), stage_device_names, strict=True)
    ):
        for variable in variables:
            if not same_device(variable_device(variable), device):
                raise ValueError(
                    f"Stage {index}'s variable {variable.path!r} is on "
                    f"{variable_device(variable)}, not on its stage device {device}: it was "
                    "created after the pipeline placed its stage. Build the stage before "
                    f"making the pipeline, or build it under `tf.device({device!r})`."
                )
