"""The base of tensor-parallel layers, and mapping their split weights to the unsplit layout."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmulti.collectives.device_compute import run_on_device
from tfmulti.compat import keras_internals, keras_whole_weights
from tfmulti.compat.keras_internals import variable_device
from tfmulti.tensor_parallel.shard_devices import resolve_shard_devices
from tfmulti.tensor_parallel.transfer_bytes import CommunicationBytes


def pin_deferred_initialization(variable: keras.Variable, device: str) -> keras.Variable:
    """Makes `variable` be created on `device` even if Keras defers its creation.

    A layer built while an enclosing layer is called symbolically (Keras'
    `compute_output_spec` runs inside a stateless scope) gets variables whose values are
    made later, when that scope ends, under whatever device scope is active then: a split
    layer's shards would all land on the enclosing stage's device. An already created
    variable is left as it is.
    """
    keras_internals.initialize_deferred_on_device(variable, device)
    return variable


@dataclasses.dataclass(eq=False, repr=False)
class ShardedWeight:
    """One weight of the unsplit layer, held as K variables split along `axis`.

    It stands in the layer's `weights` where the shards would (so `get_weights()`,
    `set_weights()` and `count_params()` see the unsplit layer's weights): `shape` is the
    whole shape, `numpy()` joins the shards and `assign` splits a whole value into them.
    Training reads and updates the shards (`variables`, also in the layer's `variables`).
    """

    shards: list
    axis: int
    path: str = ""

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        """The unsplit weight's shape."""
        shape = list(self.shards[0].shape)
        shape[self.axis] *= len(self.shards)
        return tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.shards[0].dtype

    @property
    def variables(self) -> list:
        """The variables holding the weight, shard by shard (a row-split shard's pieces)."""
        return [
            variable for shard in self.shards for variable in getattr(shard, "shards", (shard,))
        ]

    @property
    def trainable(self) -> bool:
        return self.variables[0].trainable

    @trainable.setter
    def trainable(self, value: bool) -> None:
        for variable in self.variables:
            variable.trainable = value

    # A split weight has neither (`layer_sharding` keeps such weights whole).
    regularizer = None
    constraint = None

    @property
    def value(self):
        """The whole value, joined on the first shard's device."""
        with tf.device(variable_device(self.variables[0])):
            return keras.ops.concatenate(
                [keras.ops.convert_to_tensor(shard) for shard in self.shards], self.axis
            )

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

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} path={self.path} shape={self.shape} "
            f"dtype={keras.backend.standardize_dtype(self.dtype)} shards={len(self.shards)}>"
        )


def _read_whole(weight: ShardedWeight, dtype=None, name=None, as_ref=False):
    del name, as_ref
    value = weight.value
    return value if dtype is None else tf.cast(value, dtype)


# A whole weight reads as a tensor where one is expected (`tf.reduce_sum(model.weights[0])`).
tf.register_tensor_conversion_function(ShardedWeight, _read_whole)


def stand_for_shards(view: ShardedWeight) -> ShardedWeight:
    """Makes `view` stand in its layer's weight lists for its shards; returns it."""
    keras_whole_weights.stand_for(view, view.variables)
    return view


def shards_of(weight) -> list:
    """The variables holding one of a model's `weights` on its devices.

    For a weight split over devices (by `keras.distribution.ModelParallel`, `shard`, or
    a tensor-parallel layer), its shards in order (a shard split again over a mesh's rows
    gives its pieces); for a whole weight, the weight itself. `model.variables` lists
    all of them, as training and `variable_bytes_per_device` see them.

    Example:
        >>> [shard.shape for shard in shards_of(model.weights[0])]
        [(32, 32), (32, 32), (32, 32), (32, 32)]
    """
    return keras_whole_weights.variables_holding(weight)


class TensorParallelLayer(keras.layers.Layer):
    """A Keras layer whose weights are split over devices, shard k on `devices[k]`.

    Its input and output live on the home device, `devices[0]`. Subclasses create split
    weights with `add_sharded_weight`, in the order of the unsplit layer's weights, so
    its `weights` and `get_weights()` match the unsplit layer's (each split weight listed
    whole, a `ShardedWeight`); `variables` lists the shards.

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
        parent = shards[0].path.rpartition("/")[0]
        path = f"{parent}/{name}" if parent else name
        self.sharded_weights.append(stand_for_shards(ShardedWeight(shards, axis, path)))
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
        """Returns the weights in the unsplit layer's layout and order (`get_weights()`)."""
        return self.get_weights()

    def set_unsplit_weights(self, weights: Sequence) -> None:
        """Loads weights given in the unsplit layer's layout and order (`set_weights`)."""
        self.set_weights(weights)

    def communication_bytes(self, input_shape: Sequence[int]) -> CommunicationBytes:
        """Returns the bytes this layer moves between devices per forward and backward pass."""
        raise NotImplementedError

    def get_config(self):
        config = super().get_config()
        config.update(devices=list(self.devices))
        return config


def unsplit_weights(layer: keras.layers.Layer) -> list[np.ndarray]:
    """Returns `layer.get_weights()`: every split weight is listed whole in `weights`.

    Kept for code written when `get_weights()` gave the shards; works on any layer or
    model, split by tensor-parallel layers, `shard` or `keras.distribution`.

    Example:
        >>> weights = unsplit_weights(parallel_model)  # == unsplit_model.get_weights()
    """
    return layer.get_weights()


def set_unsplit_weights(layer: keras.layers.Layer, weights: Sequence) -> None:
    """Calls `layer.set_weights(weights)`, which takes the unsplit layout.

    Example:
        >>> set_unsplit_weights(parallel_model, unsplit_model.get_weights())
    """
    layer.set_weights(weights)
