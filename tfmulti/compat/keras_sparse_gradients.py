"""Sparse gradients with repeated rows: Keras 3's optimizers on TensorFlow treat each repeat
as a separate gradient.

An embedding's gradient is a `tf.IndexedSlices` that may name a row more than once (a
token id twice in a batch, or a position embedding whose gradients from several
micro-batches were gathered). The row's gradient is the sum of its repeats. Keras 3's
Adam squares each repeat before scattering it into the second moment (sum of squares, not
square of the sum), and `clipnorm` measures the repeats apart; Keras 2 merged repeats
first (`_deduplicate_indexed_slices`). Measured on Keras 3.15.1: rows [0, 0] with values
[1, 1] move a weight by 0.141 under Adam(0.1), one row [0] with value [2] by 0.100.

So a pipeline, which gathers each micro-batch's slices, trained differently from one device
under Adam, and one device differed from dense Adam. The fix merges repeated rows of every
sparse gradient before the optimizer sees it, which is exact for every optimizer: the row's
gradient is the same sum. `tests/test_compat_sparse_gradients.py` tells when upstream
merges repeats itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf
from keras.src.optimizers import base_optimizer

from tfmulti.compat.fixes import Fix, FixSet


def merge_repeated_rows(gradient):
    """A `tf.IndexedSlices` with each row once, holding the sum of its repeats; any other
    gradient unchanged.

    Example:
        >>> merged = merge_repeated_rows(tf.IndexedSlices(values, indices, dense_shape))
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def _merging_repeated_rows(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        return original(self, [merge_repeated_rows(g) for g in grads], trainable_variables)

    return apply


FIXES = (
    Fix(
        name="merge_repeated_sparse_gradient_rows",
        owner=base_optimizer.BaseOptimizer,
        attribute="apply",
        make_replacement=_merging_repeated_rows,
    ),
)

FIX_SET = FixSet(FIXES)


def original_apply() -> Callable:
    """Keras' own `BaseOptimizer.apply`, to check whether upstream still needs the fix."""
    return FIX_SET.original(FIXES[0].name)
