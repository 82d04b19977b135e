"""A pre-LN Transformer block split over a tensor group, its residual stream on every device.

Megatron's layout: the block's input is replicated over the group (`replica_handoff`),
every device normalizes its own replica, the split attention and MLP read it where they
run, their partial outputs are all-reduced to every device (`replicated.all_reduce`),
and bias and residual add run on every replica. Per pass the block all-reduces its
activations twice (forward after attention and after the MLP, backward before them);
nothing goes out from a home device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import tensorflow as tf
from keras import ops

from tfmulti.collectives.device_compute import run_on_device
from tfmulti.collectives.replica_handoff import hand_on, replicas_of
from tfmulti.collectives.replicated import all_reduce, reduce_gradients, replicated_value
from tfmulti.tensor_parallel.transfer_bytes import (
    CommunicationBytes,
    all_reduce_bytes,
    tensor_bytes,
)


def pre_ln_block(inputs: tf.Tensor, attention_norm, attention, mlp_norm, feed_forward) -> tf.Tensor:
    """Returns x + attention(norm(x)), then x + mlp(norm(x)), computed on the tensor group.

    Args:
        inputs: the block's input, one tensor (replicas a previous block handed on are
            taken from the graph).
        attention_norm, mlp_norm: built `keras.layers.LayerNormalization` layers.
        attention, feed_forward: built split layers with `devices`, `shard_partials` and
            `output_bias` (`ParallelSelfAttention`, `ParallelMLP`), on the same devices.

    Example:
        >>> outputs = pre_ln_block(x, block.attention_norm, block.attention,
        ...                        block.mlp_norm, block.feed_forward)
    """
    devices = attention.devices
    replicas = replicas_of(inputs, devices)
    for norm, layer in ((attention_norm, attention), (mlp_norm, feed_forward)):
        replicas = _residual_branch(replicas, norm, layer, devices)
    return hand_on(replicas, devices)


def _residual_branch(replicas, norm, layer, devices) -> list[tf.Tensor]:
    """x + layer(norm(x)) on every replica; the layer's partial outputs all-reduced."""
    gammas, betas = (replicated_value(weight, devices) for weight in (norm.gamma, norm.beta))
    normed, carried = zip(
        *(
            run_on_device(device, functools.partial(_norm_and_carry, norm), *values)
            for device, *values in zip(devices, replicas, gammas, betas, strict=True)
        ),
        strict=True,
    )
    sums = all_reduce(layer.shard_partials(reduce_gradients(normed, devices)), devices)
    return [
        run_on_device(device, _add_bias_and_residual, *values)
        for device, *values in zip(
            devices, carried, sums, replicated_value(layer.output_bias, devices), strict=True
        )
    ]


def _norm_and_carry(norm, inputs, gamma, beta):
    """The normalized input and the input itself, so the input has one consumer outside
    (its two uses' gradients are added here, on its device)."""
    normed = ops.layer_normalization(
        inputs, gamma, beta, norm.axis, norm.epsilon, rms_scaling=norm.rms_scaling
    )
    return [ops.cast(normed, norm.compute_dtype), tf.identity(inputs)]


def _add_bias_and_residual(residual, summed, bias):
    return residual + (summed + bias)


def pre_ln_block_bytes(
    input_shape: Sequence[int],
    dtype,
    num_devices: int,
    replicated_weight_bytes: int,
    enters: bool = True,
    exits: bool = True,
) -> CommunicationBytes:
    """Bytes `pre_ln_block` moves per forward and backward pass.

    Each pass, two ring all-reduces of the activations (`all_reduce_bytes`). Forward,
    the weights every device reads (norms, output biases) go to K-1 devices and, if the
    block `enters` a stack (its input is not handed on), the input goes along the chain
    to K-1 devices; backward, if it `exits` (its output goes to a layer on one device),
    the output gradient goes along the chain.
    """
    activations = tensor_bytes(input_shape, dtype)
    chain = (num_devices - 1) * activations
    reductions = 2 * all_reduce_bytes(input_shape, dtype, num_devices)
    forward = reductions + (num_devices - 1) * replicated_weight_bytes + (chain if enters else 0)
    return CommunicationBytes(forward, reductions + (chain if exits else 0))
