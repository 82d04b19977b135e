"""Causal scaled dot-product attention over heads, shared by the unsplit and split layers."""

from __future__ import annotations

from keras import ops


def attend_causally(query, key, value, softmax):
    """Returns each position's softmax-weighted sum of the values at it and before it.

    Args:
        query, key, value: [batch, heads, length, head_size].
        softmax: a `keras.layers.Softmax(axis=-1)` (it carries the dtype policy).

    Example:
        >>> attended = attend_causally(q, k, v, keras.layers.Softmax(axis=-1))
    """
    length = ops.shape(query)[2]
    head_size = ops.shape(query)[-1]
    scores = ops.matmul(query, ops.transpose(key, (0, 1, 3, 2)))
    scores = scores / ops.cast(ops.sqrt(float(head_size)), scores.dtype)
    causal_mask = ops.tril(ops.ones((length, length), dtype="bool"))
    weights = softmax(scores, mask=causal_mask[None, None])
    return ops.matmul(weights, value)
