"""A traced multi-device function called on other devices and variables without tracing it
again.

A hybrid mesh runs the same pipeline schedule once per data replica, on other devices and
other variables each time. Tracing that schedule is most of a step's trace (about 3 CPU
seconds per replica on the 6-layer reference Transformer). A traced function is data: its
`FunctionDef` names the devices its ops run on, and its variables come in as captured
handles after its arguments. So a replica takes the first replica's `FunctionDef`, moves
every op from the first replica's devices to its own (in the function and in every function
it calls that places ops, each under a new name), and calls the copy with its own
variables' handles. Functions that place nothing (the stages' F, B, I, W, whose call op's
device places them) stay shared.

TensorFlow has no public way to register such a copy or to call a function with other
captured inputs; the private names used are behind `tf_internals._private`, and
`tests/test_hybrid_startup.py` checks the whole on the installed TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from tensorflow.core.framework import function_pb2
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import function_type_utils

from tfmulti.compat.tf_internals import _private

_FUNCTION_ATTRS = ("f", "body", "cond", "then_branch", "else_branch", "branches")


class DeviceMap:
    """Moves device names of the first replica to another replica's.

    Args:
        pairs: (first replica's device, this replica's device) for every device the first
            replica's function may place ops on.
    """

    def __init__(self, pairs: Sequence[tuple[str, str]]):
        targets: dict[str, str] = {}
        for source, target in pairs:
            if targets.setdefault(source, target) != target:
                raise UnmovableFunction(
                    f"{source} would move to both {targets[source]} and {target}"
                )
        self._pairs = [
            (tf.DeviceSpec.from_string(source), tf.DeviceSpec.from_string(target))
            for source, target in targets.items()
        ]

    def move(self, device: str) -> str | None:
        """The device `device` moves to ("" stays ""); None when it is on none of the first
        replica's devices, or on more than one (a partial name)."""
        if not device:
            return device
        spec = tf.DeviceSpec.from_string(device)
        matches = [target for source, target in self._pairs if _compatible(spec, source)]
        if len(matches) != 1:
            return None
        return spec.make_merged_spec(matches[0]).to_string()


def _compatible(spec: tf.DeviceSpec, other: tf.DeviceSpec) -> bool:
    """Whether every field both name is the same (a missing field matches any)."""
    for field in ("job", "replica", "task", "device_type", "device_index"):
        mine, theirs = getattr(spec, field), getattr(other, field)
        if mine is not None and theirs is not None and mine != theirs:
            return False
    return True


class UnmovableFunction(ValueError):
    """The function places an op on a device the map does not move."""


def remapped_call(concrete, args: Sequence, captures: Sequence, devices: DeviceMap, tag: str):
    """Calls the traced `concrete` on `args` with `captures` in place of the tensors it
    captured, every op it or its callees place moved by `devices`.

    Args:
        concrete: a `ConcreteFunction` traced for the first replica.
        args: the arguments, as `concrete` was traced with (Python values equal).
        captures: one tensor per `concrete.captured_inputs`.
        devices: where the first replica's devices move.
        tag: names this replica's copies of the functions (unique per replica).

    Raises:
        UnmovableFunction: an op sits on a device `devices` does not move.
    """
    atomic = _private(concrete, "_inference_function", "ConcreteFunction._inference_function")
    moved = _moved_function(atomic, devices, tag)
    function_type = concrete.function_type
    canonicalize = _private(
        function_type_utils, "canonicalize_function_inputs", "canonicalize_function_inputs"
    )
    flat_args = function_type.unpack_inputs(canonicalize(tuple(args), {}, function_type))
    return moved.call_preflattened(list(flat_args) + list(captures))


_MOVED: dict[tuple[bytes, str], object] = {}


def _moved_function(atomic, devices: DeviceMap, tag: str):
    key = (atomic.name, tag)
    if key not in _MOVED:
        _MOVED[key] = _register_moved(atomic, devices, tag)
    return _MOVED[key]


def _register_moved(atomic, devices: DeviceMap, tag: str):
    atomic_class = type(atomic)
    children = {child.name: child for child in atomic.children}
    definitions = {name: child.cached_definition for name, child in children.items()}
    definitions[atomic.name] = atomic.cached_definition
    places = {name: _places_ops(definition, devices) for name, definition in definitions.items()}
    calls = {name: _called_names(definition) for name, definition in definitions.items()}
    renamed = {name for name, placing in places.items() if placing}
    renamed.add(atomic.name)
    while True:
        callers = {name for name, callees in calls.items() if callees & renamed} - renamed
        if not callers:
            break
        renamed |= callers
    new_names = {name: name + b"_" + tag.encode() for name in renamed}
    bound_context = context.context()
    for name in renamed:
        if not bound_context.has_function(new_names[name]):
            bound_context.add_function_def(_moved_definition(definitions[name], devices, new_names))
    new_children = [
        atomic_class(
            new_names[name], bound_context, child.function_type, call_options=child.call_options
        )
        if name in renamed
        else child
        for name, child in children.items()
    ]
    return atomic_class(
        new_names[atomic.name],
        bound_context,
        atomic.function_type,
        new_children,
        atomic.call_options,
        cached_graph=atomic.graph,
    )


def _places_ops(definition: function_pb2.FunctionDef, devices: DeviceMap) -> bool:
    placing = False
    for node in definition.node_def:
        if not node.device:
            continue
        if devices.move(node.device) is None:
            raise UnmovableFunction(
                f"op {node.name} of {definition.signature.name} runs on {node.device}, "
                "a device of no stage"
            )
        placing = True
    return placing


def _called_names(definition: function_pb2.FunctionDef) -> set[bytes]:
    names = set()
    for node in definition.node_def:
        for attr_name in _FUNCTION_ATTRS:
            if attr_name not in node.attr:
                continue
            value = node.attr[attr_name]
            if value.HasField("func"):
                names.add(value.func.name.encode())
            names.update(func.name.encode() for func in value.list.func)
    return names


def _moved_definition(
    definition: function_pb2.FunctionDef, devices: DeviceMap, new_names: dict[bytes, bytes]
) -> function_pb2.FunctionDef:
    moved = function_pb2.FunctionDef()
    moved.CopyFrom(definition)
    moved.signature.name = new_names[definition.signature.name.encode()].decode()
    for node in moved.node_def:
        node.device = devices.move(node.device)
        for attr_name in _FUNCTION_ATTRS:
            if attr_name not in node.attr:
                continue
            value = node.attr[attr_name]
            if value.HasField("func"):
                value.func.name = _renamed(value.func.name, new_names)
            for func in value.list.func:
                func.name = _renamed(func.name, new_names)
    return moved


def _renamed(name: str, new_names: dict[bytes, bytes]) -> str:
    return new_names.get(name.encode(), name.encode()).decode()
