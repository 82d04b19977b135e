"""Causal multi-head self-attention with its heads split over devices."""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import ops

from tfmulti.collectives.device_compute import run_on_device
from tfmulti.collectives.placed_steps import fan_out, reduce_partial_sums
from tfmulti.tensor_parallel.causal_attention import attend_causally
from tfmulti.tensor_parallel.shard_devices import check_divisible
from tfmulti.tensor_parallel.sharded_layer import TensorParallelLayer
from tfmulti.tensor_parallel.transfer_bytes import fan_out_bytes, reduction_bytes

_PROJECTIONS = ("query", "key", "value", "output")


@keras.saving.register_keras_serializable(package="tfmulti")
class ParallelSelfAttention(TensorParallelLayer):
    """Causal multi-head self-attention; device k computes num_heads/K heads end to end.

    Device k holds its heads' columns of the query, key and value projections and their
    rows of the output projection, so its heads' attention needs nothing from other
    devices; the K partial outputs are all-reduced to the home device, where the output
    bias is added. Weights are laid out as four unsplit Dense layers (query, key,
    value, output projection; kernel then bias), heads in order.

    Args:
        d_model: input and output width.
        num_heads: attention heads; must be divisible by K and divide d_model.
        devices: one device per shard (K = len(devices)).
        kernel_initializers: one initializer for the four projection kernels, or four
            (query, key, value, output).

    Example:
        >>> attention = ParallelSelfAttention(8, 2, ["/CPU:0", "/CPU:1"])
        >>> attention(keras.ops.ones((2, 5, 8))).shape
        TensorShape([2, 5, 8])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        devices: Sequence[str],
        kernel_initializers="glorot_uniform",
        **kwargs,
    ):
        super().__init__(devices, **kwargs)
        if d_model % num_heads:
            raise ValueError(
                "d_model must be a multiple of num_heads. "
                f"Received: d_model={d_model}, num_heads={num_heads}"
            )
        check_divisible("num_heads", num_heads, self.num_shards)
        if isinstance(kernel_initializers, (list, tuple)):
            if len(kernel_initializers) != len(_PROJECTIONS):
                raise ValueError(
                    f"Give one kernel initializer, or one for each of {_PROJECTIONS}. "
                    f"Received: {len(kernel_initializers)} initializers"
                )
        else:
            kernel_initializers = [kernel_initializers] * len(_PROJECTIONS)
        self.kernel_initializers = [keras.initializers.get(each) for each in kernel_initializers]
        self.d_model = d_model
        self.num_heads = num_heads
        self.softmax = keras.layers.Softmax(axis=-1, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.shards = {}
        for name, initializer in zip(_PROJECTIONS, self.kernel_initializers, strict=True):
            # Query, key and value split by output columns (heads); output by input rows.
            kernel_axis = 0 if name == "output" else 1
            self.shards[f"{name}_kernel"] = self.add_sharded_weight(
                f"{name}_kernel", (self.d_model, self.d_model), kernel_axis, initializer
            )
            if name == "output":
                self.output_bias = self.add_home_weight("output_bias", (self.d_model,), "zeros")
            else:
                self.shards[f"{name}_bias"] = self.add_sharded_weight(
                    f"{name}_bias", (self.d_model,), 0, "zeros"
                )

    def _local_heads(self, index, name, inputs):
        """Projects `inputs` to this shard's heads: [batch, local heads, length, head size]."""
        projected = ops.matmul(inputs, self.shards[f"{name}_kernel"][index])
        projected = projected + self.shards[f"{name}_bias"][index]
        local_heads = self.num_heads // self.num_shards
        projected = ops.reshape(
            projected, (-1, ops.shape(inputs)[1], local_heads, self.d_model // self.num_heads)
        )
        return ops.transpose(projected, (0, 2, 1, 3))

    def _shard_output(self, index, inputs):
        query, key, value = (self._local_heads(index, name, inputs) for name in _PROJECTIONS[:3])
        attended = ops.transpose(attend_causally(query, key, value, self.softmax), (0, 2, 1, 3))
        attended = ops.reshape(
            attended, (-1, ops.shape(inputs)[1], self.d_model // self.num_shards)
        )
        return ops.matmul(attended, self.shards["output_kernel"][index])

    def shard_partials(self, shard_inputs):
        """The K partial outputs before their sum and the bias; shard k reads shard_inputs[k]
        (on device k) and its partial stays there."""
        return self.on_each_shard(self._shard_output, shard_inputs)

    def call(self, inputs):
        partials = self.shard_partials(fan_out(inputs, self.devices))
        summed = reduce_partial_sums(partials, self.devices)
        return run_on_device(self.devices[0], lambda total: total + self.output_bias, summed)

    def compute_output_shape(self, input_shape):
        return input_shape

    def communication_bytes(self, input_shape):
        """Forward: the input out to K-1 devices and the partial outputs all-reduced home;
        backward: the output gradient out and the input gradients all-reduced home."""
        return fan_out_bytes(input_shape, self.compute_dtype, self.num_shards) + reduction_bytes(
            input_shape, self.compute_dtype, self.num_shards
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            d_model=self.d_model,
            num_heads=self.num_heads,
            kernel_initializers=[
                keras.initializers.serialize(each) for each in self.kernel_initializers
            ],
        )
        return config
