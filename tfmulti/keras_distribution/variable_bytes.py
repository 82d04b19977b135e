"""How many bytes of variables each device holds, for checking what a sharding gave."""

from __future__ import annotations

import collections

import keras
import numpy as np

from tfmulti.compat.keras_internals import variable_device
from tfmulti.keras_distribution.mesh_layout import tensorflow_device_name

PARTS = ("model", "optimizer", "all")


def _storage_bytes(variable) -> int:
    return int(np.prod(variable.shape, dtype=np.int64)) * np.dtype(variable.dtype).itemsize


def variable_bytes_per_device(model: keras.Model, part: str = "model") -> dict[str, int]:
    """Returns the bytes of variables held on each device, keyed "/device:CPU:0" etc.

    Counts `model.variables`, where a sharded weight is its shards (`shards_of`), not
    `model.weights`, where it is listed whole.

    Args:
        model: a Keras model (sharded or not).
        part: "model" counts the model's variables (weights and non-trainable state) only;
            "optimizer" counts only its optimizer's variables (slots, iteration count),
            which exist once it has been built (after the first training step);
            "all" counts both.

    Example:
        >>> variable_bytes_per_device(model)
        {'/device:CPU:0': 4096, '/device:CPU:1': 4096}
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}. Received: part={part!r}")
    variables = []
    if part in ("model", "all"):
        variables += list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if part in ("optimizer", "all") and optimizer is not None:
        variables += list(optimizer.variables)
    totals: dict[str, int] = collections.defaultdict(int)
    seen = set()
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        totals[tensorflow_device_name(variable_device(variable))] += _storage_bytes(variable)
    return dict(sorted(totals.items()))
