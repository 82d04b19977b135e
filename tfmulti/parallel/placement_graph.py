"""The units a functional model is placed by, their edges, and their measured costs.

A unit is one top-level operation of the model's graph: a layer, a nested model (one unit,
whatever it holds) or a `keras.ops` call made on symbolic tensors. Units come in the
topological order Keras runs them in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmulti.pipeline.balance import Block

# Reused so placement and pipeline partitions time blocks the same way.
from tfmulti.pipeline.runtime.partition import time_block


@dataclasses.dataclass(frozen=True)
class GraphUnit:
    """One top-level operation of a functional model.

    Args:
        name: the operation's name, unique within the model.
        operation: the layer, nested model or `keras.ops` operation.
        producers: names of the units whose outputs it takes (model inputs not listed).
    """

    name: str
    operation: keras.Operation
    producers: tuple[str, ...]

    @property
    def has_weights(self) -> bool:
        """Whether the unit owns variables (a weightless unit may follow its neighbours)."""
        return bool(getattr(self.operation, "variables", ()))


def functional_view(model: keras.Model) -> keras.Model:
    """Returns `model` as a functional model: itself, or a built Sequential's graph.

    Raises:
        ValueError: the model is subclassed, or a Sequential without a known input shape.

    Example:
        >>> functional_view(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    """
    if isinstance(model, keras.Sequential):
        try:
            return keras.Model(model.inputs[0], model.outputs[0], name=model.name)
        except (AttributeError, ValueError) as error:
            raise ValueError(
                f"Sequential model {model.name!r} has no known input shape, so it has no graph "
                "to place; start it with keras.Input(shape) or call it on data first."
            ) from error
    if not hasattr(model, "_nodes_by_depth"):
        raise ValueError(
            "place() walks a functional model's graph; a subclassed model has none. "
            f"Received: {type(model).__name__} {model.name!r}; build it with "
            "keras.Model(inputs, outputs) or keras.Sequential."
        )
    return model


def graph_units(model: keras.Model) -> list[GraphUnit]:
    """Lists the top-level operations of functional `model` in topological order.

    Example:
        >>> [unit.name for unit in graph_units(model)]
        ['dense', 'dense_1', 'add', 'logits']
    """
    producers: dict[str, list[str]] = {}
    for nodes in model._nodes_by_depth.values():
        for node in nodes:
            if node.is_input:
                continue
            names = producers.setdefault(node.operation.name, [])
            for tensor in node.input_tensors:
                producer = tensor._keras_history.operation
                if not isinstance(producer, keras.layers.InputLayer):
                    names.append(producer.name)
    return [
        GraphUnit(operation.name, operation, tuple(dict.fromkeys(producers[operation.name])))
        for operation in model.operations
        if not isinstance(operation, keras.layers.InputLayer)
    ]


def count_parameters(operation: keras.Operation) -> int:
    """Returns the number of trainable values of `operation` (0 for a `keras.ops` call)."""
    return int(sum(np.prod(v.shape) for v in getattr(operation, "trainable_variables", ())))


def state_bytes(operation: keras.Operation) -> float:
    """Returns the bytes of all of `operation`'s variables, trainable or not."""
    return float(
        sum(np.prod(v.shape) * tf.as_dtype(v.dtype).size for v in operation.variables)
        if hasattr(operation, "variables")
        else 0.0
    )


def unit_blocks(
    model: keras.Model,
    units: Sequence[GraphUnit],
    sample_input=None,
    time_units: bool = False,
) -> list[Block]:
    """Costs each unit as a balancer `Block`: parameters, and with a sample, activations and time.

    Runs `model` once on `sample_input` in training mode, recording every unit's
    arguments; output bytes give the activation memory, and with `time_units` each unit's
    forward and backward are timed on its recorded arguments. Every variable (moving
    statistics, seed states) is restored afterwards, so measuring leaves the model as it
    was.

    Args:
        model: the functional model `units` came from.
        units: `graph_units(model)`.
        sample_input: one batch of model input, or None to count parameters only.
        time_units: time forward and backward (needs `sample_input`).

    Example:
        >>> blocks = unit_blocks(model, graph_units(model), x[:32], time_units=True)
    """
    if sample_input is None:
        return [_block(unit, forward_time=1.0, backward_time=2.0) for unit in units]
    snapshot = [(variable, variable.numpy()) for variable in model.variables]
    try:
        calls = _record_calls(model, sample_input)
        blocks = []
        for unit in units:
            recorded = calls.get(unit.name, [])
            forward_time, backward_time = 1.0, 2.0
            if time_units and recorded:
                times = [time_block(call, call.tensors) for call in recorded]
                forward_time = sum(time[0] for time in times)
                backward_time = sum(time[1] for time in times)
            activation_bytes = sum(
                t.shape.num_elements() * t.dtype.size
                for call in recorded
                for t in tf.nest.flatten(call.outputs)
                if tf.is_tensor(t)
            )
            blocks.append(_block(unit, forward_time, backward_time, float(activation_bytes)))
        return blocks
    finally:
        for variable, value in snapshot:
            variable.assign(value)


def _block(unit, forward_time, backward_time, activation_bytes=0.0):
    return Block(
        forward_time=forward_time,
        backward_time=backward_time,
        params=count_parameters(unit.operation),
        activation_bytes=activation_bytes,
        param_bytes=state_bytes(unit.operation),
        name=unit.name,
    )


class _RecordedCall:
    """One call of an operation with the arguments it got, callable the way `time_block` calls."""

    def __init__(self, operation, args, kwargs):
        self.operation = operation
        self.structure = (args, kwargs)
        leaves = tf.nest.flatten(self.structure)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]
        self.leaves = leaves
        self.tensors = [leaves[i] for i in self.tensor_positions]
        self.outputs = None

    @property
    def trainable_variables(self):
        return getattr(self.operation, "trainable_variables", [])

    def __call__(self, tensors, training=None):
        # `training` is already among the recorded keyword arguments of a layer.
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tf.nest.pack_sequence_as(self.structure, leaves)
        return self.operation(*args, **kwargs)


def _record_calls(model, sample_input) -> dict[str, list[_RecordedCall]]:
    calls: dict[str, list[_RecordedCall]] = {}

    def recording(operation):
        def call(*args, **kwargs):
            if isinstance(operation, keras.layers.Layer):
                kwargs["training"] = True
            recorded = _RecordedCall(operation, args, kwargs)
            recorded.outputs = operation(*args, **kwargs)
            calls.setdefault(operation.name, []).append(recorded)
            return recorded.outputs

        return call

    inputs = [tf.convert_to_tensor(x) for x in model._standardize_inputs(sample_input)]
    model._run_through_graph(inputs, operation_fn=recording)
    return calls
