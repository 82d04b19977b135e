"""Reading a `keras.distribution` mesh and layout as the shards tfmulti places on devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tfmulti.platform.runtime.devices import short_device_name


class LayoutNotHonouredWarning(UserWarning):
    """A variable's layout asks for a sharding tfmulti does not do; the variable stays whole."""


class UnsupportedLayout(ValueError):
    """Why one variable's layout cannot be honoured (the caller warns and keeps it whole)."""


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """A variable split into `len(devices)` equal pieces along `axis`, piece k on devices[k].

    With `row_axis`, shard k is split again along `row_axis` over the mesh's rows (the
    batch axis, as FSDP does): its piece r lives on `row_devices[k][r]`, and each row
    gathers the whole shard when it computes.
    """

    axis: int
    devices: tuple[str, ...]
    row_axis: int | None = None
    row_devices: tuple[tuple[str, ...], ...] = ()

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
        return short_device_name(text)
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


def check_model_axes(device_mesh, batch_dim_name: str | None) -> None:
    """Raises ValueError unless at most one mesh axis other than the batch axis has size > 1.

    tfmulti splits a weight over one group of devices (the model axis); the batch axis
    may have any size (`mesh_rows`: each row computes a part of the batch).
    """
    wide = [
        name
        for name, size in zip(device_mesh.axis_names, device_mesh.shape, strict=True)
        if size > 1 and name != batch_dim_name
    ]
    if len(wide) > 1:
        raise ValueError(
            "On TensorFlow, tfmulti's ModelParallel shards over one mesh axis besides the "
            f"batch axis: give the other axes {wide[1:]} size 1, e.g. a (batch, model) mesh. "
            f"Received: mesh shape={tuple(device_mesh.shape)}, "
            f"axis_names={tuple(device_mesh.axis_names)}, batch_dim_name={batch_dim_name!r}"
        )


def plan_for_layout(
    layout, shape: Sequence[int], device_mesh, batch_dim_name: str | None = None
) -> ShardPlan | None:
    """Returns how a variable of `shape` with `layout` is split, or None to keep it whole.

    Layout axes naming mesh axes of size 1 split nothing. Raises UnsupportedLayout for a
    layout that splits along two model axes or along the batch axis alone, names an
    unknown axis, or does not divide. Shard k goes to the k-th device of the first row.

    Args:
        layout: a `keras.distribution.TensorLayout`, a tuple of axis names, or None.
        shape: the variable's full shape.
        device_mesh: the `keras.distribution.DeviceMesh` the axis names refer to.
        batch_dim_name: the mesh axis of the batch; a layout naming it beside a model axis
            splits each shard over the rows too (`ShardPlan.row_axis`).
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
    row_split = [(axis, name) for axis, name in split if name == batch_dim_name]
    split = [(axis, name) for axis, name in split if name != batch_dim_name]
    if not split:
        if row_split:
            raise UnsupportedLayout(
                f"the layout {axes} splits only along the batch axis {batch_dim_name!r}; "
                "tfmulti splits a weight over the batch axis only beside a model axis"
            )
        return None
    if len(split) > 1:
        raise UnsupportedLayout(
            f"the layout {axes} splits along {len(split)} model axes; tfmulti splits along one"
        )
    (axis, mesh_axis_name), row_axis = split[0], (row_split[0][0] if row_split else None)
    names = mesh_device_names(device_mesh)
    axis_names = list(device_mesh.axis_names)
    if batch_dim_name not in axis_names:
        names, axis_names = names[..., np.newaxis], [*axis_names, batch_dim_name]
    # grid[k][r]: the device of model shard k in row r (the other axes at index 0).
    grid = np.moveaxis(
        names, [axis_names.index(mesh_axis_name), axis_names.index(batch_dim_name)], [0, 1]
    )
    grid = grid.reshape(grid.shape[0], grid.shape[1], -1)[:, :, 0]
    devices = tuple(str(device) for device in grid[:, 0])
    if shape[axis] % len(devices):
        raise UnsupportedLayout(
            f"axis {axis} of shape {tuple(shape)} does not divide into {len(devices)} shards"
        )
    if row_axis is None:
        return ShardPlan(axis, devices)
    rows = grid.shape[1]
    if shape[row_axis] % rows:
        raise UnsupportedLayout(
            f"axis {row_axis} of shape {tuple(shape)} does not divide into {rows} row pieces"
        )
    row_devices = tuple(tuple(str(device) for device in column) for column in grid)
    return ShardPlan(axis, devices, row_axis, row_devices)
