"""The call graph of a functional Keras model: every operation call in run order.

Shared by layer placement (`tfmulti.parallel.place`) and pipelining any model
(`PipelineModel.from_model`). A call node is one call of a layer, nested model or
`keras.ops` operation on symbolic tensors; a layer called twice (a tied embedding) gives
two nodes. Nested functional models can be opened, so that their own calls take their
place in the order.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat import keras_internals


@dataclasses.dataclass(frozen=True)
class CallNode:
    """One call of an operation in a functional model's graph.

    Args:
        name: the operation's name, prefixed by the nested models it sits in
            ("gpt2_backbone/transformer_layer_0").
        operation: the layer, nested model or `keras.ops` operation called.
        node: the Keras node of the call (its `arguments` rebuild the call).
        argument_ids: `id` of each symbolic tensor among the call's arguments.
        input_keys: the graph tensor each argument is, after nested models are opened.
        output_keys: the graph tensor of each flat output.
    """

    name: str
    operation: keras.Operation
    node: object
    argument_ids: tuple[int, ...]
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]


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
                "to cut; start it with keras.Input(shape) or call it on data first."
            ) from error
    if not keras_internals.is_functional(model):
        raise ValueError(
            "Only a functional model has a graph to walk; a subclassed model has none. "
            f"Received: {type(model).__name__} {model.name!r}; build it with "
            "keras.Model(inputs, outputs) or keras.Sequential."
        )
    return model


@dataclasses.dataclass(frozen=True)
class CallGraph:
    """The calls of a functional model in run order, and the tensors at its ends.

    Args:
        nodes: the calls, each after every call it takes tensors from.
        input_keys: the graph tensor of each flat model input.
        output_keys: the graph tensor of each flat model output.
        masked_keys: the graph tensors that carry a Keras mask (`mask_zero=True` and the
            like), which the layers after them read.
    """

    nodes: tuple[CallNode, ...]
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]
    masked_keys: frozenset[int] = frozenset()


def call_graph(model: keras.Model, open_nested: bool = False) -> CallGraph:
    """Lists every operation call of functional `model` in an order Keras can run them.

    Args:
        model: a functional model (see `functional_view`).
        open_nested: replace the call of a nested functional model (or built Sequential)
            by its own calls, recursively; a nested model whose class overrides `call`, or
            whose inputs Keras would reshape or cast, stays one call.

    Example:
        >>> [node.name for node in call_graph(model, open_nested=True).nodes]
        ['dense', 'inner/inner_a', 'inner/inner_b', 'add', 'logits']
    """
    aliases: dict[int, int] = {}
    nodes: list[CallNode] = []
    _walk(model, "", open_nested, aliases, nodes)
    return CallGraph(
        tuple(nodes),
        tuple(id(tensor) for tensor in model.inputs),
        tuple(aliases.get(id(tensor), id(tensor)) for tensor in model.outputs),
        frozenset(
            output
            for node in nodes
            for output, tensor in zip(node.output_keys, node.node.outputs, strict=True)
            if keras_internals.keras_mask(tensor) is not None
        ),
    )


def _walk(model, prefix, open_nested, aliases, nodes) -> None:
    by_depth = keras_internals.nodes_by_depth(model)
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.is_input:
                continue
            operation = node.operation
            name = prefix + operation.name
            opened = _openable(operation, node) if open_nested else None
            if opened is not None:
                inner, flat_arguments = opened
                for reference, tensor in zip(inner.inputs, flat_arguments, strict=True):
                    aliases[id(reference)] = aliases.get(id(tensor), id(tensor))
                _walk(inner, name + "/", open_nested, aliases, nodes)
                for outer, reference in zip(node.outputs, inner.outputs, strict=True):
                    aliases[id(outer)] = aliases.get(id(reference), id(reference))
                continue
            argument_ids = tuple(id(tensor) for tensor in node.input_tensors)
            nodes.append(
                CallNode(
                    name,
                    operation,
                    node,
                    argument_ids,
                    tuple(aliases.get(key, key) for key in argument_ids),
                    tuple(id(tensor) for tensor in node.outputs),
                )
            )


def _openable(operation, node) -> tuple[keras.Model, list] | None:
    """The functional graph to open in place of `node` and its flat inputs, or None."""
    inner = keras_internals.graph_run_by(operation)
    if inner is None:
        return None
    args = node.arguments.args
    if len(args) != 1 or len(node.input_tensors) != len(inner.inputs):
        return None
    argument = args[0]
    if isinstance(argument, dict) and not isinstance(keras_internals.inputs_structure(inner), dict):
        flat = [argument.get(reference.name) for reference in inner.inputs]
    else:
        flat = keras.tree.flatten(argument)
    if len(flat) != len(inner.inputs):
        return None
    for tensor, reference in zip(flat, inner.inputs, strict=True):
        # Keras would cast or reshape such an input; keep the model whole to keep that.
        if not isinstance(tensor, keras.KerasTensor) or (
            tensor.dtype != reference.dtype or len(tensor.shape) != len(reference.shape)
        ):
            return None
    if {id(t) for t in flat} != {id(t) for t in node.input_tensors}:
        return None
    return inner, flat


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


@contextlib.contextmanager
def variables_restored(model: keras.Model):
    """Puts every variable of `model` back as it was on leaving (after measuring runs)."""
    snapshot = [(variable, variable.numpy()) for variable in model.variables]
    try:
        yield
    finally:
        for variable, value in snapshot:
            variable.assign(value)


def output_bytes(outputs) -> float:
    """Bytes of the tensors in the nest `outputs`."""
    return float(
        sum(
            t.shape.num_elements() * t.dtype.size
            for t in tf.nest.flatten(outputs)
            if tf.is_tensor(t)
        )
    )


class RecordedCall:
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

    # Plain Python over a recorded call: AutoGraph has nothing to convert here, and its
    # conversion of this method inside `time_block` has failed after many other traces.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, tensors, training=None):
        # `training` is already among the recorded keyword arguments of a layer.
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tf.nest.pack_sequence_as(self.structure, leaves)
        return self.operation(*args, **kwargs)


def recording(operation, function, record) -> callable:
    """`function` (which calls `operation`) run in training mode, each call passed to
    `record` as a `RecordedCall` that timing can replay."""

    def call(*args, **kwargs):
        if isinstance(operation, keras.layers.Layer):
            # Timing replays the call on the operation itself, in training mode.
            kwargs["training"] = True
        recorded = RecordedCall(operation, args, kwargs)
        recorded.outputs = function(*args, **kwargs)
        record(recorded)
        return recorded.outputs

    return call


def sample_tensors(model: keras.Model, sample_input) -> list[tf.Tensor]:
    """`sample_input` as the list of tensors `model`'s graph takes."""
    return [
        tf.convert_to_tensor(x) for x in keras_internals.standardize_inputs(model, sample_input)
    ]
