"""The base of tensor-parallel layers, and mapping their split weights to the unsplit layout."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmulti.parallel.communication import CommunicationBytes
from tfmulti.parallel.device_compute import run_on_device
from tfmulti.parallel.shard_devices import resolve_shard_devices


def pin_deferred_initialization(variable: keras.Variable, device: str) -> keras.Variable:
    """Makes `variable` be created on `device` even if Keras defers its creation.

    A layer built while an enclosing layer is called symbolically (Keras'
    `compute_output_spec` runs inside a stateless scope) gets variables whose values are
    made later, when that scope ends, under whatever device scope is active then: a split
    layer's shards would all land on the enclosing stage's device. An already created
    variable is left as it is.
    """
    if getattr(variable, "_value", True) is not None:
        return variable
    initialize = variable._deferred_initialize

    def initialize_on_device():
        with tf.device(device):
            initialize()

    variable._deferred_initialize = initialize_on_device
    return variable


@dataclasses.dataclass
class ShardedWeight:
    """One weight of the unsplit layer, held as K variables split along `axis`."""

    shards: list
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The unsplit weight's shape."""
        shape = list(self.shards[0].shape)
        shape[self.axis] *= len(self.shards)
        return tuple(shape)

    @property
    def dtype(self):
        return self.shards[0].dtype

    def unsplit_value(self) -> np.ndarray:
        return np.concatenate(
            [keras.ops.convert_to_numpy(shard) for shard in self.shards], self.axis
        )

    def numpy(self) -> np.ndarray:
        return self.unsplit_value()

    def __array__(self, dtype=None, copy=None):
        value = self.unsplit_value()
        return value if dtype is None else value.astype(dtype)

    def assign(self, value) -> None:
        """Splits a whole value into the shards."""
        self.assign_unsplit(keras.ops.convert_to_numpy(value))

    def assign_unsplit(self, value) -> None:
        value = np.asarray(value)
        expected = list(self.shape)
        if list(value.shape) != expected:
            raise ValueError(
                f"Expected an unsplit weight of shape {tuple(expected)}. "
                f"Received: shape={value.shape}"
            )
        for shard, piece in zip(
            self.shards, np.split(value, len(self.shards), self.axis), strict=True
        ):
            shard.assign(piece)


class TensorParallelLayer(keras.layers.Layer):
    """A Keras layer whose weights are split over devices, shard k on `devices[k]`.

    Its input and output live on the home device, `devices[0]`. Subclasses create split
    weights with `add_sharded_weight`, in the order of the unsplit layer's weights, so
    `get_unsplit_weights()` matches the unsplit layer's `get_weights()`.

    Args:
        devices: one device name per shard (K = len(devices)).
    """

    def __init__(self, devices: Sequence[str], **kwargs):
        super().__init__(**kwargs)
        self.devices = resolve_shard_devices(None, devices)
        self.sharded_weights = []

    @property
    def num_shards(self) -> int:
        return len(self.devices)

    def add_sharded_weight(self, name: str, shape, axis: int, initializer) -> list:
        """Creates a weight of full `shape` as K variables split along `axis`, each on its device.

        The full weight is drawn once from `initializer` and split, so a seeded
        initializer gives the same weights as in the unsplit layer.
        """
        initializer = keras.initializers.get(initializer)
        with tf.init_scope():
            full_value = keras.ops.convert_to_numpy(initializer(shape, dtype=self.variable_dtype))
        shards = []
        for index, (device, piece) in enumerate(
            zip(self.devices, np.split(full_value, self.num_shards, axis), strict=True)
        ):
            with tf.device(device):
                shard = self.add_weight(
                    name=f"{name}_shard_{index}",
                    shape=piece.shape,
                    initializer=lambda shape, dtype, piece=piece: keras.ops.cast(piece, dtype),
                )
            shards.append(pin_deferred_initialization(shard, device))
        self.sharded_weights.append(ShardedWeight(shards, axis))
        return shards

    def on_each_shard(self, shard_function: Callable, shard_inputs: Sequence) -> list:
        """`shard_function(k, shard_inputs[k])` on device k for each shard k; each result
        stays on its shard's device."""
        return [
            run_on_device(device, functools.partial(shard_function, index), shard_input)
            for index, (device, shard_input) in enumerate(
                zip(self.devices, shard_inputs, strict=True)
            )
        ]

    def add_home_weight(self, name: str, shape, initializer) -> keras.Variable:
        """Creates an unsplit weight on the home device."""
        with tf.device(self.devices[0]):
            weight = self.add_weight(name=name, shape=shape, initializer=initializer)
        return pin_deferred_initialization(weight, self.devices[0])

    def get_unsplit_weights(self) -> list[np.ndarray]:
        """Returns the weights in the unsplit layer's layout and order."""
        return unsplit_weights(self)

    def set_unsplit_weights(self, weights: Sequence) -> None:
        """Loads weights given in the unsplit layer's layout and order (its `get_weights()`)."""
        set_unsplit_weights(self, weights)

    def communication_bytes(self, input_shape: Sequence[int]) -> CommunicationBytes:
        """Returns the bytes this layer moves between devices per forward and backward pass."""
        raise NotImplementedError

    def get_config(self):
        config = super().get_config()
        config.update(devices=list(self.devices))
        return config


def _sharded_weights_by_variable(layer: keras.layers.Layer) -> dict:
    # Keras's own walk over nested layers; there is no public one for a plain Layer.
    by_variable = {}
    for sublayer in layer._flatten_layers(include_self=True, recursive=True):
        for sharded in getattr(sublayer, "sharded_weights", ()):
            for shard in sharded.shards:
                # A shard split over mesh rows (`RowSplitShard`) is held by its pieces.
                for variable in getattr(shard, "shards", (shard,)):
                    by_variable[id(variable)] = sharded
    return by_variable


def _unsplit_slots(layer: keras.layers.Layer) -> list:
    """Returns `layer.weights` with each sharded weight's shards replaced by one ShardedWeight."""
    by_variable = _sharded_weights_by_variable(layer)
    slots, seen = [], set()
    for variable in layer.weights:
        sharded = by_variable.get(id(variable))
        if sharded is None:
            slots.append(variable)
        elif id(sharded) not in seen:
            seen.add(id(sharded))
            slots.append(sharded)
    return slots


def unsplit_weights(layer: keras.layers.Layer) -> list[np.ndarray]:
    """Returns `layer.get_weights()` with every tensor-parallel weight joined to its full shape.

    Works on a split layer or on any layer or model containing them, so a model built
    with tensor parallelism can be compared with, or saved for, the unsplit model.

    Example:
        >>> weights = unsplit_weights(parallel_model)  # == unsplit_model.get_weights() layout
    """
    return [
        slot.unsplit_value()
        if isinstance(slot, ShardedWeight)
        else keras.ops.convert_to_numpy(slot)
        for slot in _unsplit_slots(layer)
    ]


def set_unsplit_weights(layer: keras.layers.Layer, weights: Sequence) -> None:
    """Loads weights in the unsplit layout (`unsplit_model.get_weights()`) into `layer`.

    Example:
        >>> set_unsplit_weights(parallel_model, unsplit_model.get_weights())
    """
    slots = _unsplit_slots(layer)
    if len(slots) != len(weights):
        raise ValueError(
            f"Expected {len(slots)} weights in the unsplit layout. Received: {len(weights)}"
        )
    for slot, value in zip(slots, weights, strict=True):
        if isinstance(slot, ShardedWeight):
            slot.assign_unsplit(value)
        else:
            slot.assign(value)
