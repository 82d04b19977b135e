"""Megatron's f and g operators on a tensor replicated over a tensor group, and its entry and exit.

A replicated tensor is K tensors of equal value, replica k on device k, so the elementwise
work between split layers (bias, residual add, layer norm) runs on every device and each
shard reads its input where it runs. Gradients follow Megatron: each replica's gradient
is the whole gradient of the tensor (all replicas hold the same one), hence

- `all_reduce` (g, after a row-parallel layer): forward, the ring all-reduce of the K
  partial results, the sum on every device; backward, each partial's gradient is its
  replica's, nothing moves.
- `reduce_gradients` (f, before a column-parallel layer): forward, nothing moves;
  backward, the shards' gradients (each a part of the whole) are ring all-reduced.
- `broadcast` (entry): a tensor copied along the chain 0 -> 1 -> ... -> K-1; backward,
  replica 0's gradient is the tensor's.
- `first_replica` (exit): replica 0, for a consumer on one device; backward, its gradient
  is copied along the chain to every replica.

The chains send each device at most one copy, so no device is a hot spot. All replicas
of a sum are bitwise equal: each chunk is added once and copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfmulti.collectives import collective_all_reduce, ring
from tfmulti.collectives.multi_device_op import multi_device_op, zeros_where_missing
from tfmulti.collectives.tensor_reduction import tensor_reduction


def sum_on_every_device(tensors: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Returns the sum of the K tensors (tensor k on device k) on every device; not differentiable.

    A ring reduce-scatter then a ring all-gather, each device receiving 2(K-1)/K of the
    tensor; a last axis shorter than K (or unknown) is summed on every device from all K.
    Under `tensor_reduction()` "collective", TensorFlow's collective all-reduce instead.
    """
    if tensor_reduction() == "collective":
        return collective_all_reduce.sum_on_every_device(tensors, devices)
    if ring.can_chunk(tensors[0].shape, len(devices)):
        return ring.all_gather(ring.reduce_scatter(tensors, devices), devices)
    sums = []
    for device in devices:
        with tf.device(device):
            sums.append(tf.add_n(list(tensors)))
    return sums


def _identities(tensors: Sequence[tf.Tensor | None], devices: Sequence[str]) -> list:
    copies = []
    for device, tensor in zip(devices, tensors, strict=True):
        if tensor is None:
            copies.append(None)
            continue
        with tf.device(device):
            copies.append(tf.identity(tensor))
    return copies


def _chain(tensor: tf.Tensor, devices: Sequence[str]) -> list[tf.Tensor]:
    """`tensor` copied to devices[0], then from each device to the next."""
    copies = []
    for device in devices:
        with tf.device(device):
            copies.append(tf.identity(copies[-1] if copies else tensor))
    return copies


def all_reduce(partials: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Megatron's g: the sum of the K partials on every device; backward, each replica's
    gradient is its partial's.

    Example:
        >>> sums = all_reduce([partial_on_cpu0, partial_on_cpu1], ["/CPU:0", "/CPU:1"])
    """
    return multi_device_op(
        "all_reduce",
        lambda values: sum_on_every_device(values, devices),
        lambda gradients: _identities(gradients, devices),
        partials,
    )


def reduce_gradients(replicas: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Megatron's f: the replicas unchanged; backward, their gradients ring all-reduced.

    Example:
        >>> shard_inputs = reduce_gradients(normed_replicas, devices)
    """
    return multi_device_op(
        "reduce_gradients",
        lambda values: _identities(values, devices),
        lambda gradients: sum_on_every_device(
            zeros_where_missing(gradients, replicas, devices), devices
        ),
        replicas,
    )


def broadcast(tensor: tf.Tensor, devices: Sequence[str]) -> list[tf.Tensor]:
    """One replica of `tensor` per device, copied along the chain; backward, replica 0's
    gradient.

    Example:
        >>> replicas = broadcast(embedded, ["/CPU:0", "/CPU:1", "/CPU:2", "/CPU:3"])
    """
    return multi_device_op(
        "broadcast_replicas",
        lambda values: _chain(values[0], devices),
        lambda gradients: gradients[:1],
        [tensor],
    )


def first_replica(replicas: Sequence[tf.Tensor], devices: Sequence[str]) -> tf.Tensor:
    """Replica 0, on devices[0]; backward, its gradient copied along the chain to every replica.

    Example:
        >>> output = first_replica(replicas, devices)  # for a layer on one device
    """

    def copy_gradient_along_chain(gradients):
        if gradients[0] is None:
            return [None] * len(devices)
        return _chain(gradients[0], devices)

    return multi_device_op(
        "first_replica",
        lambda values: _identities(values[:1], devices[:1]),
        copy_gradient_along_chain,
        replicas,
    )[0]


def replicated_value(variable, devices: Sequence[str]) -> list[tf.Tensor]:
    """The value of a weight that every device reads, one per device.

    Read once where the variable lives; replica 0 carries the gradient and the others
    are copies without one: under Megatron's rule every replica's gradient is the whole
    one, so one replica's counts.
    """
    value = variable.value
    frozen = tf.stop_gradient(value)
    return [value, *_identities([frozen] * (len(devices) - 1), devices[1:])]
