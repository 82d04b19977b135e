"""A pipeline's forward alone (evaluation, prediction) over its micro-batches, in one loop.

Calling every stage on every micro-batch puts m x p stage calls into a traced step, and
TensorFlow inlines and optimises each copy: `evaluate` at m=32 on 4 stages optimised a
larger graph than the training step's. In a traced function with micro-batches of one
size, the first micro-batch runs through the stages as is (which gives the outputs'
structure and types) and the others go through one `tf.while_loop` whose body calls each
stage once, so the graph holds 2p calls whatever m. Loop iterations overlap (an op runs
once its inputs are ready), so stage d works on micro-batch i while stage d-1 starts
i + 1, as with the unrolled calls. Eagerly, or with unequal micro-batches, the stages run
on each micro-batch in turn.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tfmulti.pipeline.runtime.microbatches import (
    MicrobatchParts,
    concat_microbatches,
    split_microbatches,
)


def forward_microbatches(inputs, sizes, run_stages: Callable):
    """`run_stages` on each micro-batch of `inputs` (rows `sizes`), outputs joined in order.

    Args:
        inputs: the batch nest.
        sizes: rows of each micro-batch, from `microbatch_sizes`.
        run_stages: the stages on one micro-batch nest, returning the last stage's outputs
            (every output tensor has the micro-batch's rows on axis 0).

    Example:
        >>> forward_microbatches(x, microbatch_sizes(x, 8), lambda part: stages(part))
    """
    equal = isinstance(sizes, list) and min(sizes) > 0 and len(set(sizes)) == 1
    if not equal or len(sizes) < 3 or not tf.inside_function():
        return concat_microbatches([run_stages(part) for part in split_microbatches(inputs, sizes)])
    parts = MicrobatchParts(inputs, sizes)
    first = run_stages(parts[0])
    flat_first = tf.nest.flatten(first)
    rest = len(sizes) - 1
    arrays = []
    for t in flat_first:
        with tf.device(t.device):  # the last stage's: the loop keeps each array there
            arrays.append(
                tf.TensorArray(t.dtype, size=rest, element_shape=t.shape, infer_shape=False)
            )

    def body(index, arrays):
        flat = tf.nest.flatten(run_stages(parts[index + 1]))
        return index + 1, [array.write(index, t) for array, t in zip(arrays, flat, strict=True)]

    _, arrays = tf.while_loop(
        lambda index, _: index < rest,
        body,
        (tf.constant(0), arrays),
        parallel_iterations=rest,
    )
    joined = []
    for t, array in zip(flat_first, arrays, strict=True):
        stacked = array.stack()
        rows = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], axis=0))
        joined.append(tf.concat([t, rows], axis=0))
    return tf.nest.pack_sequence_as(first, joined)
