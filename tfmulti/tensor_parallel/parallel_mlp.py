"""The Transformer MLP split over devices: column-split hidden layer, row-split output."""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfmulti.tensor_parallel.shard_devices import check_divisible
from tfmulti.tensor_parallel.sharded_layer import TensorParallelLayer
from tfmulti.tensor_parallel.split_dense import ColumnParallelDense, RowParallelDense


@keras.saving.register_keras_serializable(package="tfmulti")
class ParallelMLP(TensorParallelLayer):
    """Dense(mlp_dim, activation) then Dense(d_model), with one reduction in forward.

    Device k holds mlp_dim/K hidden units: their columns of the first kernel and rows
    of the second. The hidden activations never leave their device; only the input
    (sent out) and the partial outputs (all-reduced to the home device) cross.

    Args:
        d_model: input and output width.
        mlp_dim: hidden width; must be divisible by K.
        devices: one device per shard (K = len(devices)).
        activation: of the hidden layer.
        hidden_initializer, output_initializer: kernel initializers of the two layers.

    Example:
        >>> mlp = ParallelMLP(8, 32, ["/CPU:0", "/CPU:1"])
        >>> mlp(keras.ops.ones((2, 5, 8))).shape
        TensorShape([2, 5, 8])
    """

    def __init__(
        self,
        d_model: int,
        mlp_dim: int,
        devices: Sequence[str],
        activation="gelu",
        hidden_initializer="glorot_uniform",
        output_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(devices, **kwargs)
        check_divisible("mlp_dim", mlp_dim, self.num_shards)
        self.d_model = d_model
        self.mlp_dim = mlp_dim
        self.hidden = ColumnParallelDense(
            mlp_dim,
            self.devices,
            activation=activation,
            kernel_initializer=hidden_initializer,
            gather_output=False,
            dtype=self.dtype_policy,
        )
        self.output_projection = RowParallelDense(
            d_model,
            self.devices,
            kernel_initializer=output_initializer,
            input_is_parallel=True,
            dtype=self.dtype_policy,
        )

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.output_projection.build(self.hidden.compute_output_shape(input_shape))

    def call(self, inputs):
        return self.output_projection(self.hidden(inputs))

    def shard_partials(self, shard_inputs):
        """The K partial outputs before their sum and the bias; shard k reads shard_inputs[k]
        (on device k) and its hidden units and partial stay there."""
        return self.output_projection.shard_partials(self.hidden.shard_outputs(shard_inputs))

    @property
    def output_bias(self):
        """The bias added once the partial outputs are summed."""
        return self.output_projection.bias

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.d_model)

    def communication_bytes(self, input_shape):
        """Forward: the input out to K-1 devices and the partial outputs all-reduced home;
        backward: the output gradient out and the input gradients all-reduced home."""
        hidden_shape = (*input_shape[:-1], self.mlp_dim)
        return self.hidden.communication_bytes(
            input_shape
        ) + self.output_projection.communication_bytes(hidden_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            d_model=self.d_model,
            mlp_dim=self.mlp_dim,
            activation=keras.activations.serialize(self.hidden.activation),
            hidden_initializer=keras.initializers.serialize(self.hidden.kernel_initializer),
            output_initializer=keras.initializers.serialize(
                self.output_projection.kernel_initializer
            ),
        )
        return config
