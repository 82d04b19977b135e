"""Splitting a batch nest into near-equal micro-batches along axis 0, and joining them back."""

from __future__ import annotations

import tensorflow as tf


def static_batch_size(nest) -> int | None:
    """The batch dimension of the first tensor in `nest`, if known at trace time."""
    tensors = [t for t in tf.nest.flatten(nest) if t is not None]
    return tensors[0].shape[0] if tensors else None


def batch_rows(nest) -> tf.Tensor:
    """The number of rows of the first tensor in `nest`, as an int32 scalar tensor."""
    return tf.shape(next(t for t in tf.nest.flatten(nest) if t is not None))[0]


def even_sizes(batch_size, num_parts: int):
    """Sizes of `num_parts` parts of `batch_size` rows, differing by at most one row.

    The first `batch_size % num_parts` parts take one extra row; with fewer rows than
    parts, the last parts are empty.

    Args:
        batch_size: a Python int, or an int32 scalar tensor when unknown at trace time.
        num_parts: how many parts.

    Returns:
        A list of Python ints for an int `batch_size`, else an int32 tensor of shape
        [num_parts].

    Example:
        >>> even_sizes(30, 4)
        [8, 8, 7, 7]
    """
    if isinstance(batch_size, int):
        base, extra = divmod(batch_size, num_parts)
        return [base + (index < extra) for index in range(num_parts)]
    base, extra = batch_size // num_parts, batch_size % num_parts
    return base + tf.cast(tf.range(num_parts) < extra, tf.int32)


def microbatch_sizes(nest, num_microbatches: int):
    """`even_sizes` of the batch of `nest`: Python ints when its size is known at trace
    time, else a tensor."""
    batch_size = static_batch_size(nest)
    return even_sizes(batch_rows(nest) if batch_size is None else batch_size, num_microbatches)


def split_microbatches(nest, sizes) -> list:
    """Cuts every tensor of `nest` along axis 0 into parts of `sizes` rows; None stays None.

    Args:
        nest: a tensor, a nest of tensors with the same number of rows, or None.
        sizes: rows of each part, from `microbatch_sizes` or `even_sizes`.

    Example:
        >>> x_parts = split_microbatches(x, microbatch_sizes(x, 4))
    """
    num_parts = len(sizes) if isinstance(sizes, list) else int(sizes.shape[0])
    if nest is None:
        return [None] * num_parts
    if num_parts == 1:
        return [nest]
    parts = [
        None if t is None else tf.split(t, sizes, num=num_parts, axis=0)
        for t in tf.nest.flatten(nest)
    ]
    return [
        tf.nest.pack_sequence_as(nest, [None if p is None else p[index] for p in parts])
        for index in range(num_parts)
    ]


def may_be_empty(sizes) -> bool:
    """Whether a part of `sizes` has or may have no rows (fewer rows than parts)."""
    return not isinstance(sizes, list) or min(sizes) == 0


def split_padded_microbatches(nest, sizes) -> list:
    """Like `split_microbatches`, but a part of no rows gets a copy of the batch's last row.

    Layers that average over a micro-batch (BatchNorm in training) give NaN on no rows, and
    NaN times a zero loss share is still NaN in the gradients. A padded part has finite
    values; its loss share stays 0 (`loss_share` reads the real `sizes`), so it adds nothing
    to the gradients. Cut its rows from the outputs with `trim_microbatches`.

    Args:
        nest: a nest of tensors with the same number of rows (at least one), or None.
        sizes: rows of each part, from `microbatch_sizes`; rows of `nest` beyond their
            sum are padding themselves (a part of a padded batch).
    """
    if not may_be_empty(sizes):
        return split_microbatches(nest, sizes)
    num_parts = len(sizes) if isinstance(sizes, list) else int(sizes.shape[0])
    if nest is None:
        return [None] * num_parts
    sizes = tf.convert_to_tensor(sizes, tf.int32)
    starts = tf.cumsum(sizes, exclusive=True)
    rows = [starts[index] + tf.range(tf.maximum(sizes[index], 1)) for index in range(num_parts)]

    def gather(t, part_rows):
        if t is None:
            return None
        return tf.gather(t, tf.minimum(part_rows, tf.shape(t)[0] - 1))

    return [
        tf.nest.map_structure(lambda t, part_rows=part_rows: gather(t, part_rows), nest)
        for part_rows in rows
    ]


def trim_microbatches(nests: list, sizes) -> list:
    """Each nest of `nests` cut to its real rows, undoing `split_padded_microbatches`."""
    if not may_be_empty(sizes):
        return nests
    return [
        tf.nest.map_structure(lambda t, rows=sizes[index]: None if t is None else t[:rows], nest)
        for index, nest in enumerate(nests)
    ]


def concat_microbatches(nests: list):
    """Joins micro-batch nests of the same structure back into one batch nest."""
    if len(nests) == 1:
        return nests[0]
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *nests)


class MicrobatchParts:
    """A batch nest cut into micro-batches, indexable by a Python int or an int32 tensor.

    A tensor index (a micro-batch chosen inside a traced loop) needs parts of one size: the
    batch is then viewed as [parts, rows per part, ...] and the part gathered from it.

    Args:
        nest: a nest of tensors with the same number of rows, or None.
        sizes: rows of each part, from `microbatch_sizes` or `even_sizes`.

    Example:
        >>> x_parts = MicrobatchParts(x, microbatch_sizes(x, 4))
        >>> x_parts[0], x_parts[tf.constant(2)]
    """

    def __init__(self, nest, sizes):
        self.sizes = sizes
        self.parts = split_padded_microbatches(nest, sizes)
        self.equal = isinstance(sizes, list) and min(sizes) > 0 and len(set(sizes)) == 1
        self._nest = nest

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index):
        if not isinstance(index, tf.Tensor):
            return self.parts[index]
        if not self.equal:
            raise ValueError(
                "Micro-batches picked by a tensor index must all have the same size. "
                f"Received: sizes={self.sizes}; this is a tfmulti bug."
            )
        count, rows = len(self.parts), self.sizes[0]

        def part(t):
            if t is None:
                return None
            stacked = tf.reshape(t, tf.concat([[count, rows], tf.shape(t)[1:]], axis=0))
            return tf.ensure_shape(tf.gather(stacked, index), [rows, *t.shape[1:]])

        return tf.nest.map_structure(part, self._nest)

    def rows(self, index):
        """Rows of part `index` (a Python int, or an int32 tensor for equal parts)."""
        if isinstance(index, tf.Tensor):
            return self.sizes[0]
        return self.sizes[index]
