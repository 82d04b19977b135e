"""An einsum whose weight operand is split along one axis over devices, computed shard by shard.

A Dense layer is the einsum "...i,io->...o"; an EinsumDense has its own equation; a
reversible embedding's reverse projection is "...d,vd->...v". Splitting the weight along a
letter of the equation decides the collective:

- a letter only in the output (Megatron's column split): device k computes slice k of the
  output from the whole input, and the slices are gathered;
- a letter only in the input (row split): device k multiplies its slice of the input by its
  piece of the weight, and the partial products are summed;
- a letter in both: the input is scattered and the output slices gathered.

The steps are the tensor-parallel layers' own (`collectives`, `device_compute`). An output
gathered here remembers its slices, so a row-split einsum that reads it right away takes
the slices where they already are: the gather then feeds nothing and TensorFlow prunes it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import string
from collections.abc import Callable, Sequence

import tensorflow as tf
from keras import ops

from tfmulti.collectives.device_compute import run_on_device
from tfmulti.collectives.placed_steps import fan_out, gather, reduce_partial_sums, scatter
from tfmulti.keras_distribution.mesh_layout import UnsupportedLayout
from tfmulti.keras_distribution.row_split_shard import shard_value

OUTPUT, CONTRACTED, BOTH = "output", "contracted", "both"


@dataclasses.dataclass(frozen=True)
class EinsumSplit:
    """Where a weight split along one of its axes splits the einsum's input and output.

    `input_axis`/`output_axis` index the input/output tensor (negative after an ellipsis);
    None where the split letter does not appear.
    """

    kind: str
    input_axis: int | None
    output_axis: int | None


def _axis_of(spec: str, letter: str) -> int | None:
    if letter not in spec:
        return None
    position = spec.index(letter)
    if "..." in spec and position > spec.index("..."):
        return position - len(spec)
    return position


def analyse_split(equation: str, weight_axis: int) -> EinsumSplit:
    """Returns how `equation` ("input,weight->output") splits with its weight split at an axis.

    Raises UnsupportedLayout for a weight letter summed away without appearing in the input.

    Example:
        >>> analyse_split("...i,io->...o", 1)
        EinsumSplit(kind='output', input_axis=None, output_axis=-1)
    """
    operands, output_spec = equation.replace(" ", "").split("->")
    input_spec, weight_spec = operands.split(",")
    letter = weight_spec.replace("...", "")[weight_axis]
    input_axis, output_axis = _axis_of(input_spec, letter), _axis_of(output_spec, letter)
    if input_axis is None and output_axis is None:
        raise UnsupportedLayout(f"the split axis {letter!r} of {equation!r} is summed by itself")
    if input_axis is None:
        return EinsumSplit(OUTPUT, None, output_axis)
    if output_axis is None:
        return EinsumSplit(CONTRACTED, input_axis, None)
    return EinsumSplit(BOTH, input_axis, output_axis)


def explicit_equation(equation: str, input_rank: int) -> str:
    """`equation` with the input's and output's "..." spelled out as letters it does not use.

    TensorFlow's einsum with an ellipsis is far slower (forward and gradient) than the
    same contraction spelled out.

    Example:
        >>> explicit_equation("...i,io->...o", 3)
        'abi,io->abo'
    """
    operands, output_spec = equation.replace(" ", "").split("->")
    input_spec, weight_spec = operands.split(",")
    if "..." not in input_spec or "..." in weight_spec:
        return equation
    free = [letter for letter in string.ascii_letters if letter not in equation]
    letters = "".join(free[: input_rank - len(input_spec.replace("...", ""))])
    return (
        f"{input_spec.replace('...', letters)},{weight_spec}->{output_spec.replace('...', letters)}"
    )


def einsum(equation: str, inputs, weight):
    """`ops.einsum(equation, inputs, weight)`, with any ellipsis spelled out."""
    return ops.einsum(explicit_equation(equation, len(inputs.shape)), inputs, weight)


# Slices of recently gathered outputs, by the gathered tensor's id; the tensor itself is
# kept so an id is never reused while its entry lives.
_GATHERED_SLICES: collections.OrderedDict = collections.OrderedDict()
_MAX_REMEMBERED = 256


def _remember_slices(gathered, slices, axis: int, devices: Sequence[str]) -> None:
    if tf.executing_eagerly():
        return  # eager tensors are computed already; keeping them would only hold memory
    _GATHERED_SLICES[id(gathered)] = (gathered, list(slices), axis % gathered.shape.rank, devices)
    while len(_GATHERED_SLICES) > _MAX_REMEMBERED:
        _GATHERED_SLICES.popitem(last=False)


def _remembered_slices(tensor, axis: int, devices: Sequence[str]) -> list | None:
    entry = _GATHERED_SLICES.get(id(tensor))
    if entry is None or entry[0] is not tensor or tensor.shape.rank is None:
        return None
    _, slices, gathered_axis, gathered_devices = entry
    if gathered_axis != axis % tensor.shape.rank or tuple(gathered_devices) != tuple(devices):
        return None
    return slices


def _input_handles(inputs, split: EinsumSplit, devices: Sequence[str]) -> list:
    if split.input_axis is None:
        return fan_out(inputs, devices)
    slices = _remembered_slices(inputs, split.input_axis, devices)
    return slices if slices is not None else scatter(inputs, devices, split.input_axis)


def split_einsum(
    equation: str,
    inputs,
    weight_shards: Sequence,
    devices: Sequence[str],
    split: EinsumSplit,
    shard_finish: Callable | None = None,
    finish: Callable | None = None,
):
    """Computes `einsum(equation, inputs, weight)` from the weight's shards, one per device.

    Args:
        equation: the einsum, input first, weight second.
        inputs: the input tensor (on the home device, `devices[0]`).
        weight_shards: shard k of the weight, on `devices[k]` (or a `RowSplitShard`,
            gathered there).
        devices: one device per shard.
        split: `analyse_split(equation, axis)` for the axis the weight is split along.
        shard_finish: `(index, output_slice) -> output_slice`, run on shard k's device
            after its einsum when the output is split (e.g. its bias slice and an
            elementwise activation).
        finish: run on the home device on the whole output (after the gather or sum).

    Returns:
        The whole output on the home device.
    """
    handles = _input_handles(inputs, split, devices)

    def shard_einsum(index, piece):
        output = einsum(equation, piece, shard_value(weight_shards[index]))
        if shard_finish is not None and split.kind != CONTRACTED:
            output = shard_finish(index, output)
        return output

    outputs = [
        run_on_device(device, functools.partial(shard_einsum, index), handle)
        for index, (device, handle) in enumerate(zip(devices, handles, strict=True))
    ]
    if split.kind == CONTRACTED:
        whole = reduce_partial_sums(outputs, devices)
    else:
        whole = gather(outputs, devices, split.output_axis)
        if finish is None:
            _remember_slices(whole, outputs, split.output_axis, devices)
    if finish is None:
        return whole
    return run_on_device(devices[0], finish, whole)
