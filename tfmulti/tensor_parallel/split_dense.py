"""Dense layers split over devices: by output features (column) or by input features (row)."""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import ops

from tfmulti.collectives.device_compute import run_on_device
from tfmulti.collectives.placed_steps import fan_out, gather, reduce_partial_sums, scatter
from tfmulti.tensor_parallel.shard_devices import check_divisible
from tfmulti.tensor_parallel.sharded_layer import TensorParallelLayer
from tfmulti.tensor_parallel.transfer_bytes import (
    CommunicationBytes,
    fan_out_bytes,
    reduction_bytes,
    tensor_bytes,
)


class _SplitDense(TensorParallelLayer):
    """What both split dense layers share: the Dense arguments and loading from a Dense."""

    def __init__(
        self,
        units: int,
        devices: Sequence[str],
        activation=None,
        use_bias: bool = True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(devices, **kwargs)
        self.units = units
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    @classmethod
    def from_dense(cls, dense: keras.layers.Dense, devices: Sequence[str], **kwargs):
        """Returns this split layer holding the weights of the built `dense` layer.

        Example:
            >>> split = ColumnParallelDense.from_dense(dense, ["/CPU:0", "/CPU:1"])
        """
        layer = cls(
            dense.units,
            devices,
            activation=dense.activation,
            use_bias=dense.use_bias,
            dtype=dense.dtype_policy,
            **kwargs,
        )
        layer.build(layer._unsplit_input_shape(dense.kernel.shape[0]))
        layer.set_unsplit_weights(dense.get_weights())
        return layer

    def _unsplit_input_shape(self, input_features: int):
        return (None, input_features)

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            activation=keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
        )
        return config


@keras.saving.register_keras_serializable(package="tfmulti")
class ColumnParallelDense(_SplitDense):
    """A dense layer whose output features are split over devices: device k computes units/K.

    Every device reads the whole input. With `gather_output` the K output slices are
    joined on the home device; without, the layer returns the K slices, each on its
    device, ready for a `RowParallelDense(input_is_parallel=True)`.

    Args:
        units: output features; must be divisible by K.
        devices: one device per shard (K = len(devices)).
        activation, use_bias, kernel_initializer, bias_initializer: as for keras.layers.Dense.
        gather_output: join the output slices (True) or return them per device (False).

    Example:
        >>> layer = ColumnParallelDense(8, ["/CPU:0", "/CPU:1"])
        >>> layer(keras.ops.ones((2, 4))).shape
        TensorShape([2, 8])
    """

    def __init__(self, units, devices, gather_output: bool = True, **kwargs):
        super().__init__(units, devices, **kwargs)
        check_divisible("units", units, self.num_shards)
        self.gather_output = gather_output

    def build(self, input_shape):
        input_features = input_shape[-1]
        self.kernel_shards = self.add_sharded_weight(
            "kernel", (input_features, self.units), 1, self.kernel_initializer
        )
        if self.use_bias:
            self.bias_shards = self.add_sharded_weight(
                "bias", (self.units,), 0, self.bias_initializer
            )

    def _shard_output(self, index, inputs):
        outputs = ops.matmul(inputs, self.kernel_shards[index])
        if self.use_bias:
            outputs = outputs + self.bias_shards[index]
        return self.activation(outputs)

    def shard_outputs(self, shard_inputs):
        """The K output slices; shard k reads shard_inputs[k] (on device k), its slice stays."""
        return self.on_each_shard(self._shard_output, shard_inputs)

    def call(self, inputs):
        shard_outputs = self.shard_outputs(fan_out(inputs, self.devices))
        return gather(shard_outputs, self.devices) if self.gather_output else shard_outputs

    def compute_output_shape(self, input_shape):
        if self.gather_output:
            return (*input_shape[:-1], self.units)
        return [(*input_shape[:-1], self.units // self.num_shards)] * self.num_shards

    def communication_bytes(self, input_shape):
        """Forward: the input to K-1 devices, and with `gather_output` K-1 output slices home.

        Backward: the K input gradients all-reduced home, K-1 output-gradient slices out.
        """
        moved = fan_out_bytes(input_shape, self.compute_dtype, self.num_shards)
        if self.gather_output:
            output_shape = (*input_shape[:-1], self.units // self.num_shards)
            slices = (self.num_shards - 1) * tensor_bytes(output_shape, self.compute_dtype)
            moved += CommunicationBytes(slices, slices)
        return moved

    def get_config(self):
        config = super().get_config()
        config.update(gather_output=self.gather_output)
        return config


@keras.saving.register_keras_serializable(package="tfmulti")
class RowParallelDense(_SplitDense):
    """A dense layer whose input features are split over devices; partial products are summed.

    Device k multiplies its slice of the input by its rows of the kernel; the K partial
    products are all-reduced to the home device (`reduce_partial_sums`), where the bias
    and activation apply.

    Args:
        units: output features.
        devices: one device per shard (K = len(devices)).
        activation, use_bias, kernel_initializer, bias_initializer: as for keras.layers.Dense.
        input_is_parallel: the input is already K slices, slice k on device k (the
            output of a `ColumnParallelDense(gather_output=False)`); else one tensor
            split on the home device.

    Example:
        >>> layer = RowParallelDense(3, ["/CPU:0", "/CPU:1"])
        >>> layer(keras.ops.ones((2, 4))).shape
        TensorShape([2, 3])
    """

    def __init__(self, units, devices, input_is_parallel: bool = False, **kwargs):
        super().__init__(units, devices, **kwargs)
        self.input_is_parallel = input_is_parallel

    def _unsplit_input_shape(self, input_features: int):
        if self.input_is_parallel:
            return [(None, input_features // self.num_shards)] * self.num_shards
        return (None, input_features)

    def _input_features(self, input_shape) -> int:
        if self.input_is_parallel:
            return sum(shape[-1] for shape in input_shape)
        return input_shape[-1]

    def build(self, input_shape):
        input_features = self._input_features(input_shape)
        check_divisible("input features", input_features, self.num_shards)
        self.kernel_shards = self.add_sharded_weight(
            "kernel", (input_features, self.units), 0, self.kernel_initializer
        )
        if self.use_bias:
            self.bias = self.add_home_weight("bias", (self.units,), self.bias_initializer)

    def _finish(self, summed):
        if self.use_bias:
            summed = summed + self.bias
        return self.activation(summed)

    def shard_partials(self, pieces):
        """The K partial products before their sum; piece k is on device k, its product too."""
        return [
            run_on_device(device, ops.matmul, piece, kernel)
            for device, piece, kernel in zip(self.devices, pieces, self.kernel_shards, strict=True)
        ]

    def call(self, inputs):
        pieces = inputs if self.input_is_parallel else scatter(inputs, self.devices)
        partials = self.shard_partials(pieces)
        return run_on_device(
            self.devices[0], self._finish, reduce_partial_sums(partials, self.devices)
        )

    def compute_output_shape(self, input_shape):
        first_shape = input_shape[0] if self.input_is_parallel else input_shape
        return (*first_shape[:-1], self.units)

    def communication_bytes(self, input_shape):
        """Forward: the partial outputs all-reduced to the home device, after (unless the
        input is parallel) K-1 input slices out. Backward mirrors it.

        `input_shape` is the unsplit input's shape, also when the input comes in slices.
        """
        output_shape = (*input_shape[:-1], self.units)
        moved = reduction_bytes(output_shape, self.compute_dtype, self.num_shards)
        if not self.input_is_parallel:
            slice_shape = (*input_shape[:-1], input_shape[-1] // self.num_shards)
            slices = (self.num_shards - 1) * tensor_bytes(slice_shape, self.compute_dtype)
            moved += CommunicationBytes(slices, slices)
        return moved

    def get_config(self):
        config = super().get_config()
        config.update(input_is_parallel=self.input_is_parallel)
        return config
