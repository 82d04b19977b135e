"""Many tensors as a few: one TensorList per dtype, for what a pipeline loop carries.

A forward's stash (its inputs, the tensors its backward reads, its outputs) is dozens of
tensors. Carried as they are, each is a loop variable, with TensorFlow's loop bookkeeping
every round, and each passes a Switch and a Merge in a guarded action's `tf.cond`. Packed,
a stash is one list per dtype: the lists hold references to the tensors (nothing is
copied), and only the parts an action reads are taken out again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tensorflow as tf

_ANY_SHAPE = -1


def pack(tensors: Sequence[tf.Tensor]) -> dict[str, tf.Tensor]:
    """`tensors` as one TensorList per dtype (keyed by the dtype's name), in order."""
    lists = {}
    for tensor in tensors:
        key = tensor.dtype.name
        if key not in lists:
            lists[key] = _empty(tensor.dtype)
        lists[key] = tf.raw_ops.TensorListPushBack(input_handle=lists[key], tensor=tensor)
    return lists


def empty_packing(dtypes: Iterable[tf.DType]) -> dict[str, tf.Tensor]:
    """Lists with the keys `pack` gives tensors of `dtypes`, holding nothing (a loop's
    placeholder for values no action will read)."""
    return {dtype.name: _empty(dtype) for dtype in dtypes}


def unpack(lists: dict, specs: Sequence[tf.TensorSpec], wanted: range) -> list[tf.Tensor]:
    """The tensors at positions `wanted` of what `pack` made of tensors like `specs`."""
    position_in_list, counts = [], {}
    for spec in specs:
        position_in_list.append(counts.get(spec.dtype.name, 0))
        counts[spec.dtype.name] = position_in_list[-1] + 1
    tensors = []
    for index in wanted:
        spec = specs[index]
        tensor = tf.raw_ops.TensorListGetItem(
            input_handle=lists[spec.dtype.name],
            index=position_in_list[index],
            element_shape=_ANY_SHAPE,
            element_dtype=spec.dtype,
        )
        tensor.set_shape(spec.shape)
        tensors.append(tensor)
    return tensors


def _empty(dtype: tf.DType) -> tf.Tensor:
    return tf.raw_ops.EmptyTensorList(
        element_shape=_ANY_SHAPE, max_num_elements=-1, element_dtype=dtype
    )
