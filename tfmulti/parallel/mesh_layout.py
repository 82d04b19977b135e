"""Reading a `keras.distribution` mesh and layout as the shards tfmulti places on devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf


class LayoutNotHonouredWarning(UserWarning):
    """A variable's layout asks for a sharding tfmulti does not do; the variable stays whole."""


class UnsupportedLayout(ValueError):
    """Why one variable's layout cannot be honoured (the caller warns and keeps it whole)."""


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """A variable split into `len(devices)` equal pieces along `axis`, piece k on devices[k]."""

    axis: int
    devices: tuple[str, ...]

    @property
    def num_shards(self) -> int:
        return len(self.devices)


def tensorflow_device_name(device: str) -> str:
    """Returns the TensorFlow name of a Keras mesh device, e.g. "cpu:1" -> "/device:CPU:1".

    Example:
        >>> tensorflow_device_name("gpu:0")
        '/device:GPU:0'
    """
    text = str(device)
    if "/" in text:
        spec = tf.DeviceSpec.from_string(text)
        return f"/device:{spec.device_type}:{spec.device_index or 0}"
    device_type, _, index = text.rpartition(":")
    if not device_type or not index.isdigit():
        raise ValueError(
            f"Expected a mesh device like 'cpu:0' or '/device:GPU:1'. Received: {device!r}"
        )
    return f"/device:{device_type.upper()}:{int(index)}"


def mesh_device_names(device_mesh) -> np.ndarray:
    """The mesh's devices as TensorFlow device names, in the mesh's shape."""
    names = [tensorflow_device_name(device) for device in np.ravel(device_mesh.devices)]
    return np.array(names, dtype=object).reshape(device_mesh.devices.shape)


def check_single_model_axis(device_mesh, batch_dim_name: str | None) -> None:
    """Raises ValueError unless at most one mesh axis, not the batch axis, has size > 1.

    tfmulti splits a weight over one group of devices; data-parallel copies of a sharded
    model (a batch axis > 1 next to a model axis) are not done yet.
    """
    wide = [
        name
        for name, size in zip(device_mesh.axis_names, device_mesh.shape, strict=True)
        if size > 1
    ]
    if len(wide) > 1 or (wide and wide[0] == batch_dim_name):
        raise ValueError(
            "On TensorFlow, tfmulti's ModelParallel shards over one mesh axis and no data "
            f"axis: give the batch axis size 1 (e.g. shape=(1, {int(np.prod(device_mesh.shape))}))"
            " or use keras.distribution.DataParallel. Received: mesh shape="
            f"{tuple(device_mesh.shape)}, axis_names={tuple(device_mesh.axis_names)}, "
            f"batch_dim_name={batch_dim_name!r}"
        )


def plan_for_layout(layout, shape: Sequence[int], device_mesh) -> ShardPlan | None:
    """Returns how a variable of `shape` with `layout` is split, or None to keep it whole.

    Layout axes naming mesh axes of size 1 split nothing. Raises UnsupportedLayout for a
    layout that splits along two mesh axes, names an unknown axis, or does not divide.

    Args:
        layout: a `keras.distribution.TensorLayout`, a tuple of axis names, or None.
        shape: the variable's full shape.
        device_mesh: the `keras.distribution.DeviceMesh` the axis names refer to.
    """
    if layout is None:
        return None
    axes = tuple(getattr(layout, "axes", layout))
    if len(axes) != len(shape):
        raise UnsupportedLayout(
            f"the layout {axes} has {len(axes)} axes but the variable has shape {tuple(shape)}"
        )
    sizes = dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True))
    unknown = [name for name in axes if name is not None and name not in sizes]
    if unknown:
        raise UnsupportedLayout(f"the layout names mesh axes {unknown} the mesh does not have")
    split = [(axis, name) for axis, name in enumerate(axes) if name is not None and sizes[name] > 1]
    if not split:
        return None
    if len(split) > 1:
        raise UnsupportedLayout(
            f"the layout {axes} splits along {len(split)} mesh axes; tfmulti splits along one"
        )
    axis, mesh_axis_name = split[0]
    mesh_axis = list(device_mesh.axis_names).index(mesh_axis_name)
    devices = np.moveaxis(mesh_device_names(device_mesh), mesh_axis, 0)
    devices = devices.reshape(devices.shape[0], -1)[:, 0]
    if shape[axis] % len(devices):
        raise UnsupportedLayout(
            f"axis {axis} of shape {tuple(shape)} does not divide into {len(devices)} shards"
        )
    return ShardPlan(axis, tuple(devices))
