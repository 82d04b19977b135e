"""A copy of a stage calling another copy's traced functions on its own variables.

The data replicas of a hybrid mesh hold copies of the same stages, which trace to the same
graphs up to the variables they read. A traced function takes its variables as captured
inputs: the call op passes their handles after the arguments. So a copy calls the first
copy's F, B, I and W with its own variables' handles in their place, and a step over any
number of copies traces each stage once per input signature and holds one function of
each in its library (tracing and cutting a stage cost about as much as building it; on
the 6-layer reference Transformer, 1.5 CPU seconds per stage and copy).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tfmulti.compat import tf_internals
from tfmulti.compat.keras_internals import variable_storage
from tfmulti.compat.keras_whole_weights import variables_holding


def held_variables(stage) -> list:
    """The TensorFlow variables a stage's functions may capture, in the stage's order (each
    split weight as its shards)."""
    weights = list(stage.weights) + list(stage.variables)
    return distinct_storage(v for weight in weights for v in variables_holding(weight))


def distinct_storage(variables) -> list:
    """The `tf.Variable`s behind `variables`, each once, in order (a variable without Keras
    storage stands for itself)."""
    held, seen = [], set()
    for variable in variables:
        storage = variable_storage(variable)
        storage = variable if storage is None else storage
        if id(storage) not in seen:
            seen.add(id(storage))
            held.append(storage)
    return held


def handle_map(first_stage, stage) -> dict[int, tf.Tensor] | None:
    """`id(handle)` of each of `first_stage`'s variables -> the handle of `stage`'s
    variable in the same place; None when the two do not hold variables of the same names,
    shapes and dtypes in the same order (then `stage` traces its own functions)."""
    first, own = held_variables(first_stage), held_variables(stage)
    if len(first) != len(own):
        return None
    for reference, variable in zip(first, own, strict=True):
        if (
            reference.dtype != variable.dtype
            or reference.shape != variable.shape
            or _short_name(reference) != _short_name(variable)
        ):
            return None
    pairs = zip(first, own, strict=True)
    return {id(reference.handle): variable.handle for reference, variable in pairs}


def call_on_own_variables(concrete, inputs, handles: dict[int, tf.Tensor] | None):
    """`concrete` (traced for the first copy of a stage) on `inputs` and the variables
    `handles` pairs with the first copy's; None when they do not replace every variable it
    captures or it places ops on devices of its own (then the copy traces its own)."""
    if handles is None or any(op.device for op in concrete.graph.get_operations()):
        return None
    captures = [handles.get(id(t), t) for t in concrete.captured_inputs]
    if any(t.dtype == tf.resource and id(t) not in handles for t in concrete.captured_inputs):
        return None
    flat_inputs = tf.nest.flatten(inputs, expand_composites=True)
    return tf_internals.call_with_captures(concrete, flat_inputs, captures)


def _short_name(variable) -> str:
    """The variable's own name without its layer's (e.g. "kernel")."""
    return variable.name.split("/")[-1].split(":")[0]


class ReplicaTracedStage:
    """A `TracedStage` of a stage's first copy, its functions called on another copy's
    variables.

    Everything but the functions and `weights` (the variables gradients are for) is the
    first copy's: specs, feeds and structures are the same for every copy.

    Args:
        traced: the first copy's `TracedStage` for this input signature.
        weights: this copy's trainable variables, in the order of `traced.weights`.
        handles: `handle_map(first copy's stage, this copy's stage)`.
    """

    def __init__(self, traced, weights: list, handles: dict[int, tf.Tensor]):
        self._traced = traced
        self.weights = list(weights)
        self._handles = handles
        self._bound = {}

    @staticmethod
    def covers(traced, handles: dict[int, tf.Tensor] | None) -> bool:
        """Whether `handles` replaces every variable `traced` captures, and `traced`
        places no op on a device of its own (a copy's ops run on the copy's devices)."""
        if handles is None or traced.pinned_devices:
            return False
        return all(
            id(tensor) in handles for tensor in traced.captured if tensor.dtype == tf.resource
        )

    def __getattr__(self, name):
        # Specs, feeds and structures are the first copy's (called only for names not set
        # in __init__ or defined below).
        return getattr(self._traced, name)

    def _bind(self, name: str) -> Callable:
        if name not in self._bound:
            function = getattr(self._traced, name)
            captures = [self._handles.get(id(t), t) for t in function.captured_inputs]
            self._bound[name] = lambda *args: tf_internals.call_with_captures(
                function, args, captures
            )
        return self._bound[name]

    @property
    def forward(self) -> Callable:
        return self._bind("forward")

    @property
    def backward(self) -> Callable:
        return self._bind("backward")

    @property
    def input_grad(self) -> Callable:
        return self._bind("input_grad")

    @property
    def weight_grad(self) -> Callable:
        return self._bind("weight_grad")
