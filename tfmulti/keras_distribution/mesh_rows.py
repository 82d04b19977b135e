"""The batch axis of a `keras.distribution` mesh: each row of devices computes a part of the batch.

A `ModelParallel` mesh such as `DeviceMesh((2, 4), ("batch", "model"))` has two rows of
four devices. The weights are sharded over the devices of the first row and held there
once; in `fit`, `evaluate` and `predict` the model's call splits each batch into one part
per row, and row r computes its part with every device name of the first row replaced by
the device in the same place of row r. Each row reads the weights from the first row,
and autodiff sums the rows' gradients into the one copy: the weights train exactly as on
one device, and the optimizer state lives once, beside the weights.

Example:
    >>> rows = MeshRows.of_device_mesh(mesh, "batch")
    >>> with rows.on_row(1):
    ...     row_devices(("/device:CPU:0", "/device:CPU:1"))  # the same places in row 1
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfmulti.keras_distribution.mesh_layout import mesh_device_names
from tfmulti.keras_distribution.row_state import RowState

_ROWS_ATTRIBUTE = "_tfmulti_mesh_rows"
_ACTIVE = threading.local()


@dataclasses.dataclass(frozen=True)
class MeshRows:
    """The devices of each row of a mesh along its batch axis; row 0 holds the weights."""

    rows: tuple[tuple[str, ...], ...]

    @classmethod
    def of_device_mesh(cls, device_mesh, batch_dim_name: str | None) -> MeshRows:
        """Rows of a `keras.distribution.DeviceMesh` along `batch_dim_name` (one row without it)."""
        names = mesh_device_names(device_mesh)
        axis_names = list(device_mesh.axis_names)
        if batch_dim_name in axis_names:
            names = np.moveaxis(names, axis_names.index(batch_dim_name), 0)
        else:
            names = names[np.newaxis]
        names = names.reshape(names.shape[0], -1)
        return cls(tuple(tuple(str(name) for name in row) for row in names))

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def home(self, row: int) -> str:
        """The device of `row` where the layers that are not sharded compute."""
        return self.rows[row][0]

    @contextlib.contextmanager
    def on_row(self, row: int):
        """Sharded layers called inside compute on `row`'s devices."""
        previous = getattr(_ACTIVE, "placement", None)
        _ACTIVE.placement = dict(zip(self.rows[0], self.rows[row], strict=True))
        try:
            yield
        finally:
            _ACTIVE.placement = previous


def row_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """`devices` (of the mesh's first row) moved to the row computing now; as given outside."""
    placement = getattr(_ACTIVE, "placement", None)
    if not placement:
        return tuple(devices)
    return tuple(placement.get(device, device) for device in devices)


def mark_mesh_rows(layer, rows: MeshRows) -> None:
    """Records that `layer` was built for a mesh with these rows (outside Keras' tracking)."""
    object.__setattr__(layer, _ROWS_ATTRIBUTE, rows)


def mesh_rows_of(layers: Sequence) -> MeshRows | None:
    """The rows recorded on `layers` (a model's layers), or None if none spans several rows.

    Raises ValueError if layers were built for meshes with different rows.
    """
    found = {getattr(layer, _ROWS_ATTRIBUTE, None) for layer in layers} - {None}
    found = {rows for rows in found if rows.num_rows > 1}
    if len(found) > 1:
        raise ValueError(
            "The model's layers were built under keras.distribution meshes with different "
            f"batch rows; build the whole model under one distribution. Received rows: "
            f"{sorted(rows.rows for rows in found)}"
        )
    return found.pop() if found else None


def _is_batched(value) -> bool:
    return tf.is_tensor(value) and bool(value.shape.rank)


def _row_slices(args, kwargs, num_rows: int) -> list[tuple]:
    """`(args, kwargs, share)` for each of `num_rows` consecutive parts of every batched
    tensor; `share` is the part's fraction of the batch (a float32 tensor)."""
    batched = [value for value in tf.nest.flatten((args, kwargs)) if _is_batched(value)]
    if not batched:
        raise ValueError(
            "A model sharded over a mesh with a batch axis needs tensor inputs to split by "
            "rows. Received none"
        )
    batch_size = tf.shape(batched[0])[0]
    parts = []
    for row in range(num_rows):
        start, stop = row * batch_size // num_rows, (row + 1) * batch_size // num_rows
        row_args, row_kwargs = tf.nest.map_structure(
            lambda value, start=start, stop=stop: (
                value[start:stop] if _is_batched(value) else value
            ),
            (args, kwargs),
        )
        share = tf.cast(stop - start, tf.float32) / tf.cast(batch_size, tf.float32)
        parts.append((row_args, row_kwargs, share))
    return parts


def call_by_rows(call: Callable, rows: MeshRows, args, kwargs, join: Callable, layer):
    """`layer`'s `call(*args, **kwargs)` with the batch split over the rows, outputs joined
    by `join`.

    Row r's part runs under `rows.on_row(r)` with its unsharded layers on `rows.home(r)`;
    `join(outputs_of_each_row)` runs on the first row's home device. The state the rows
    change (moving statistics, seeds, added losses) is applied once, combined
    (`row_state.RowState`).
    """
    outputs, state = [], RowState(layer)
    for row, (row_args, row_kwargs, share) in enumerate(_row_slices(args, kwargs, rows.num_rows)):
        with tf.device(rows.home(row)), rows.on_row(row), state.row(share):
            outputs.append(call(*row_args, **row_kwargs))
    with tf.device(rows.home(0)):
        state.apply()
        return join(outputs)
