"""How much of a batch's loss each micro-batch's loss stands for.

Keras averages a loss over the batch: "sum_over_batch_size" (the default) divides the sum
of weighted per-row losses by the number of rows, "mean_with_sample_weight" by the sum of
the sample weights. A micro-batch's loss is the same average over its own rows, so
weighting it by its share of the rows (or of the sample weights) makes the weighted
micro-batch losses sum to exactly the batch loss, and their gradients to its gradient,
however unevenly the batch was cut. The shares sum to 1, so losses added by layers
(regularization) count once, as on one device.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmulti.pipeline.runtime.microbatches import batch_rows

ROW_SHARE_REDUCTIONS = ("sum_over_batch_size", "mean")
WEIGHT_SHARE_REDUCTION = "mean_with_sample_weight"


@dataclasses.dataclass(frozen=True)
class BatchTotals:
    """What a batch's loss is averaged over.

    Args:
        rows: rows of the batch, a float32 scalar tensor.
        weight_sum: sum of its sample weights, a float32 scalar tensor, or None when the
            batch has none.
    """

    rows: tf.Tensor
    weight_sum: tf.Tensor | None


def batch_totals(x, sample_weight=None) -> BatchTotals:
    """The `BatchTotals` of a batch with inputs `x` and optional `sample_weight`."""
    rows = tf.cast(batch_rows(x), tf.float32)
    if sample_weight is None:
        return BatchTotals(rows, None)
    return BatchTotals(rows, _weight_sum(sample_weight))


def loss_reduction(model: keras.Model) -> str:
    """The one reduction of the losses `model` was compiled with.

    Raises:
        ValueError: the losses reduce differently, or by a sum (a sum over micro-batches
            would count regularization losses once per micro-batch).
    """
    losses = [loss for loss in tf.nest.flatten(model.loss) if loss is not None]
    # Loss names and plain functions are wrapped by Keras with its default reduction.
    reductions = sorted({getattr(loss, "reduction", ROW_SHARE_REDUCTIONS[0]) for loss in losses})
    if not reductions:
        return ROW_SHARE_REDUCTIONS[0]
    if len(reductions) > 1 or reductions[0] not in (*ROW_SHARE_REDUCTIONS, WEIGHT_SHARE_REDUCTION):
        raise ValueError(
            "A pipeline weights each micro-batch's loss by its share of the batch, which "
            "needs every loss averaged the same way. Received: loss reductions="
            f"{reductions}; use reduction='sum_over_batch_size' (the default) or "
            f"'{WEIGHT_SHARE_REDUCTION}' for all losses."
        )
    return reductions[0]


def loss_share(reduction: str, rows, sample_weight, totals: BatchTotals) -> tf.Tensor:
    """The fraction of the batch loss a micro-batch's loss stands for: its share of the
    rows, or of the sample weights under "mean_with_sample_weight"; 0 when it is empty.

    Args:
        reduction: from `loss_reduction`.
        rows: the micro-batch's rows, an int or int32 scalar tensor.
        sample_weight: the micro-batch's sample weights, or None.
        totals: the `BatchTotals` of the whole batch (over every replica and worker that
            shares one update).

    Example:
        >>> share = loss_share("sum_over_batch_size", 8, None, batch_totals(x))
    """
    if reduction == WEIGHT_SHARE_REDUCTION and sample_weight is not None:
        return tf.math.divide_no_nan(_weight_sum(sample_weight), totals.weight_sum)
    return tf.math.divide_no_nan(tf.cast(rows, tf.float32), totals.rows)


def _weight_sum(sample_weight) -> tf.Tensor:
    return tf.add_n(
        [tf.reduce_sum(tf.cast(weights, tf.float32)) for weights in tf.nest.flatten(sample_weight)]
    )
