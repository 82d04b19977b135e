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


class PackedParts:
    """Named lists of tensors with known specs, held as tensors or packed (`pack`), each
    part taken out only when it is read.

    Args:
        specs: each part's name and the specs of its tensors, in order.
        parts: the tensors of each part; or
        packed: what `packed()` returned for parts like these.
    """

    def __init__(
        self,
        specs: dict[str, Sequence[tf.TensorSpec]],
        parts: dict[str, Sequence[tf.Tensor]] | None = None,
        packed: dict | None = None,
    ):
        self.specs = {name: list(part_specs) for name, part_specs in specs.items()}
        self._parts = {name: list(part) for name, part in (parts or {}).items()}
        self._packed = packed

    def part(self, name: str) -> list[tf.Tensor]:
        """The tensors of part `name`."""
        if name not in self._parts:
            names = list(self.specs)
            start = sum(len(self.specs[n]) for n in names[: names.index(name)])
            flat_specs = [spec for n in names for spec in self.specs[n]]
            wanted = range(start, start + len(self.specs[name]))
            self._parts[name] = unpack(self._packed, flat_specs, wanted)
        return self._parts[name]

    def parts(self) -> dict[str, list[tf.Tensor]]:
        """Every part's tensors."""
        return {name: self.part(name) for name in self.specs}

    def packed(self) -> dict[str, tf.Tensor]:
        """The parts as one TensorList per dtype (made once)."""
        if self._packed is None:
            self._packed = pack([t for name in self.specs for t in self.part(name)])
        return self._packed

    def replace(self, name: str, tensors: Sequence[tf.Tensor]) -> None:
        """Sets part `name` (then packs again when asked)."""
        self.parts()
        self._parts[name] = list(tensors)
        self._packed = None
