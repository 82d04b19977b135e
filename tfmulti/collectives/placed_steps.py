"""The cross-device steps of standalone tensor-parallel layers, each gradient placed explicitly.

Shards live on `devices`; a standalone split layer's input and output live on `devices[0]`
(the home device). Inside a split Transformer block the activations are replicated on
every device instead (`tfmulti.collectives.replicated`, `parallel_block`), with no home.
`fan_out` and `reduce_partial_sums` are the broadcast and reduce of Megatron's f and g
operators; `scatter` and `gather` split and join along an axis. `fan_out`, `scatter` and
`gather` are one group of ops on the home device; the tensor a shard reads crosses to the
shard's device once (TensorFlow sends one copy per tensor and destination device).
`reduce_partial_sums` is a ring reduce-scatter then a gather home (`ring`): each device
receives (K-1)/K of the tensor, the home device twice that. In backward the roles swap:
a fan-out's gradients are reduced, a scatter's gathered and vice versa.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfmulti.collectives import collective_all_reduce, ring
from tfmulti.collectives.tensor_reduction import tensor_reduction


def reduce_partial_sums(partials: Sequence[tf.Tensor], devices: Sequence[str]) -> tf.Tensor:
    """Returns the sum of the K partial results (partial k on device k) on devices[0].

    A ring reduce-scatter of placed ops (device c sums chunk c of the last axis) whose
    gather delivers to the home device only, as a standalone layer's output is read
    there (a split Transformer block all-reduces to every device instead,
    `replicated.all_reduce`). Every device receives (K-1)/K of the tensor, the home
    device twice that; backward, the gradient is scattered from home and all-gathered
    round the ring. A last axis shorter than K (or unknown) is summed on the home device.
    Under `tensor_reduction()` "collective", a collective all-reduce over the group
    (`collective_all_reduce.reduce_to_first`) instead.
    """
    if tensor_reduction() == "collective" and len(devices) > 1:
        return collective_all_reduce.reduce_to_first(partials, devices)
    if not ring.can_chunk(partials[0].shape, len(devices)) or len(devices) == 1:
        with tf.device(devices[0]):
            return tf.add_n(list(partials))
    return gather(ring.reduce_scatter(partials, devices), devices)


def fan_out(tensor: tf.Tensor, devices: Sequence[str]) -> list[tf.Tensor]:
    """Returns one handle of `tensor` per device, read there; backward sums their gradients.

    Each handle is a separate tensor on the home device, so each shard's device receives
    its own copy and the gradients arriving from the shards meet in `reduce_partial_sums`.
    """
    if not tensor.dtype.is_floating:
        return [tensor] * len(devices)

    @tf.custom_gradient
    def fan_out_with_reduced_gradient(value):
        def gradient(*handle_gradients):
            return reduce_partial_sums(handle_gradients, devices)

        return [tf.identity(value) for _ in devices], gradient

    with tf.device(devices[0]):
        return fan_out_with_reduced_gradient(tensor)


def scatter(tensor: tf.Tensor, devices: Sequence[str], axis: int = -1) -> list[tf.Tensor]:
    """Splits `tensor` into K equal pieces along `axis` on the home device, piece k for device k.

    Backward joins the pieces' gradients on the home device.
    """

    @tf.custom_gradient
    def split_with_joined_gradient(value):
        def gradient(*piece_gradients):
            return tf.concat(piece_gradients, axis)

        return tf.split(value, len(devices), axis), gradient

    with tf.device(devices[0]):
        return split_with_joined_gradient(tensor)


def gather(shards: Sequence[tf.Tensor], devices: Sequence[str], axis: int = -1) -> tf.Tensor:
    """Joins the K shards along `axis` on the home device; backward splits the gradient there."""

    @tf.custom_gradient
    def concat_with_split_gradient(*pieces):
        def gradient(joined_gradient):
            sizes = [piece.shape[axis] for piece in pieces]
            return tf.split(joined_gradient, len(pieces) if None in sizes else sizes, axis)

        return tf.concat(pieces, axis), gradient

    with tf.device(devices[0]):
        return concat_with_split_gradient(*shards)
