"""Splitting a batch nest into equal micro-batches along axis 0, and joining them back."""

from __future__ import annotations

import tensorflow as tf


def static_batch_size(nest) -> int | None:
    """The batch dimension of the first tensor in `nest`, if known at trace time."""
    tensors = [t for t in tf.nest.flatten(nest) if t is not None]
    return tensors[0].shape[0] if tensors else None


def check_divisible(nest, num_microbatches: int) -> None:
    """Raises ValueError when the batch cannot be cut into `num_microbatches` equal parts."""
    batch_size = static_batch_size(nest)
    if batch_size is not None and batch_size % num_microbatches:
        nearest = batch_size - batch_size % num_microbatches or num_microbatches
        raise ValueError(
            f"A batch of {batch_size} rows cannot be split into num_microbatches="
            f"{num_microbatches} equal micro-batches. Use a batch size that is a multiple of "
            f"{num_microbatches} (e.g. {nearest}), or `drop_remainder=True` when batching "
            "the dataset."
        )


def split_microbatches(nest, num_microbatches: int) -> list:
    """Cuts every tensor of `nest` into `num_microbatches` equal parts; None stays None."""
    if nest is None:
        return [None] * num_microbatches
    check_divisible(nest, num_microbatches)
    parts = [
        None if t is None else tf.split(t, num_microbatches, axis=0) for t in tf.nest.flatten(nest)
    ]
    return [
        tf.nest.pack_sequence_as(nest, [None if p is None else p[index] for p in parts])
        for index in range(num_microbatches)
    ]


def concat_microbatches(nests: list):
    """Joins micro-batch nests of the same structure back into one batch nest."""
    if len(nests) == 1:
        return nests[0]
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *nests)
