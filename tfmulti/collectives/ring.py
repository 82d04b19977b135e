"""A ring reduce-scatter (its backward a ring all-gather) and a ring all-gather of placed ops.

A tensor is cut into K chunks along its last axis, chunk c belonging to device c. In the
reduce-scatter, chunk c's running sum starts on device c+1 and travels the ring
c+1 -> c+2 -> ... -> c, each device adding its own piece: K-1 steps, after which device c
holds chunk c of the sum; each device receives K-1 chunks, (K-1)/K of the tensor. Its
backward is the matching ring all-gather: each chunk's gradient goes round the ring the
other way, so every device ends with the whole gradient. `all_gather` sends each chunk
round the ring the same way, so a reduce-scatter then an all-gather is a ring all-reduce:
each device receives 2(K-1)/K of the tensor.

The ops are ordinary TensorFlow ops under `tf.device`, so the transfers are graph edges
(counted by `communication.cross_device_bytes`) and no collective keys or launch order
are involved: a pipeline schedule may run the groups' steps in any order.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def chunk_sizes(length: int, num_chunks: int) -> list[int]:
    """Sizes of `num_chunks` consecutive chunks of `length` items, the first ones larger by one.

    Example:
        >>> chunk_sizes(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(length, num_chunks)
    return [base + (1 if index < extra else 0) for index in range(num_chunks)]


def can_chunk(shape: tf.TensorShape, num_chunks: int) -> bool:
    """Whether a tensor of `shape` has a known last axis of at least `num_chunks` items."""
    return shape.rank is not None and shape.rank > 0 and (shape[-1] or 0) >= num_chunks


def reduce_scatter(tensors: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Returns chunk c of `sum(tensors)` on `devices[c]`, for c in 0..K-1; tensor k is on device k.

    The tensors' last axis must be known and at least K long (`can_chunk`). Backward runs
    the ring the other way: chunk c's gradient goes to device c and back along the ring,
    so device k ends with the whole gradient of its tensor (a ring all-gather).
    """
    num_devices = len(devices)
    pieces = [
        _split_on(device, tensor, num_devices)
        for device, tensor in zip(devices, tensors, strict=True)
    ]
    sums = []
    for chunk in range(num_devices):
        holder = (chunk + 1) % num_devices
        running = pieces[holder][chunk]
        for _ in range(num_devices - 1):
            previous, holder = holder, (holder + 1) % num_devices
            running = _add_on(devices[holder], pieces[holder][chunk], running, devices[previous])
        sums.append(running)
    return sums


def all_gather(chunks: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Returns the K chunks joined along the last axis on every device; chunk c is on device c.

    Chunk c travels c -> c+1 -> ... -> c-1, each step a copy on the next device; each
    device joins its K chunks in order, so every device holds bitwise the same tensor.
    Not differentiable: callers give its gradient (`tfmulti.collectives.replicated`).
    """
    num_devices = len(devices)
    held = [[None] * num_devices for _ in devices]  # held[device][chunk]
    for chunk, value in enumerate(chunks):
        holder = chunk
        held[holder][chunk] = value
        for _ in range(num_devices - 1):
            previous, holder = holder, (holder + 1) % num_devices
            with tf.device(devices[holder]):
                held[holder][chunk] = tf.identity(held[previous][chunk])
    joined = []
    for device, pieces in zip(devices, held, strict=True):
        with tf.device(device):
            joined.append(tf.concat(pieces, axis=-1))
    return joined


def _split_on(device: str, tensor: tf.Tensor, num_chunks: int) -> list[tf.Tensor]:
    """The chunks of `tensor`, split on `device`; backward joins their gradients there."""

    @tf.custom_gradient
    def split(value):
        def gradient(*chunk_gradients):
            with tf.device(device):
                return tf.concat(chunk_gradients, axis=-1)

        # Slices rather than one Split op, so a graph's Split ops stay those of the layers.
        sizes = chunk_sizes(value.shape[-1], num_chunks)
        starts = [sum(sizes[:index]) for index in range(num_chunks)]
        chunks = [value[..., start : start + sizes[index]] for index, start in enumerate(starts)]
        return chunks, gradient

    with tf.device(device):
        return split(tensor)


def _add_on(device: str, own: tf.Tensor, incoming: tf.Tensor, sender: str) -> tf.Tensor:
    """`own + incoming` on `device`, `incoming` arriving from `sender`: one ring step.

    Backward, the sum's gradient is brought to `device` and sent on to `sender`, so the
    gradients travel the ring back instead of all coming from where the sum was read.
    """

    @tf.custom_gradient
    def add(own_value, incoming_value):
        def gradient(sum_gradient):
            with tf.device(device):
                local = tf.identity(sum_gradient)
            with tf.device(sender):
                return local, tf.identity(local)

        return own_value + incoming_value, gradient

    with tf.device(device):
        return add(own, incoming)
