"""Pipeline stages cut from a functional model's call graph.

A stage runs a contiguous run of the graph's calls (`tfmulti.costing.model_graph.call_graph`, nested
models opened). Whatever a cut crosses travels to the next stage as a tuple of tensors: every
tensor made before the cut and needed after it, so a residual stream made in stage 0 and
read in stage 3 passes through stages 1 and 2 unchanged, and masks, token ids and positions
travel like activations (the executor differentiates only float tensors).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import keras

from tfmulti.compat import keras_internals
from tfmulti.costing.model_graph import CallGraph, CallNode


class GraphStage(keras.layers.Layer):
    """Consecutive calls of a functional model's graph, run as one pipeline stage.

    Takes the tensors live at its start (the model's inputs, for the first stage) and
    returns those live at its end as a tuple (the model's outputs, as the model returns
    them, for the last stage). Holds the model's own layers, so it trains their weights.

    Args:
        model: the functional model the calls come from.
        nodes: the stage's calls, in run order.
        input_keys: the graph tensors it receives; None for the model's inputs.
        output_keys: the graph tensors it returns; None for the model's outputs.
        masked_keys: graph tensors that carry a Keras mask; a boundary tensor's mask
            travels after all the boundary tensors, and is put back on it on arrival.
        **kwargs: passed to `keras.layers.Layer` (e.g. `name`).

    Example:
        >>> graph = call_graph(model, open_nested=True)
        >>> stages = graph_stages(model, graph, [4])  # two stages
    """

    def __init__(
        self,
        model: keras.Model,
        nodes: Sequence[CallNode],
        input_keys: Sequence[int] | None,
        output_keys: Sequence[int] | None,
        masked_keys: frozenset[int] = frozenset(),
        **kwargs,
    ):
        # Boundary tensors keep their dtypes: a float32 residual must not be autocast.
        super().__init__(autocast=False, **kwargs)
        # A plain holder: tracking the model would make every stage own all its weights.
        self._graph = types.SimpleNamespace(
            model=model,
            nodes=tuple(nodes),
            input_keys=None if input_keys is None else tuple(input_keys),
            output_keys=None if output_keys is None else tuple(output_keys),
            masked_keys=frozenset(masked_keys),
        )
        layers = [node.operation for node in nodes]
        self.stage_layers = [
            layer
            for layer in dict.fromkeys(layers)
            if isinstance(layer, keras.layers.Layer) and layer.variables
        ]
        self.built = True

    @property
    def call_names(self) -> list[str]:
        """The names of the stage's calls, in run order."""
        return [node.name for node in self._graph.nodes]

    def compute_mask(self, inputs, previous_mask=None):
        # Masks travel as tensors of their own and are put back in `call`; Keras need not
        # attach any to the stage's outputs.
        return None

    def call(self, inputs, training=None):
        graph = self._graph
        if graph.input_keys is None:
            flat = keras_internals.standardize_inputs(graph.model, inputs)
            keys = [id(tensor) for tensor in graph.model.inputs]
        else:
            keys = graph.input_keys
            flat = list(inputs)[: len(keys)]
            masks = list(inputs)[len(keys) :]
            for key, mask in zip(_masked(keys, graph), masks, strict=True):
                keras_internals.attach_keras_mask(flat[keys.index(key)], mask)
        values = dict(zip(keys, flat, strict=True))
        run_calls(graph.nodes, values, training)
        if graph.output_keys is None:
            outputs = [values[id(tensor)] for tensor in graph.model.outputs]
            structure = keras_internals.outputs_structure(graph.model)
            return keras_internals.unpack_singleton(keras.tree.pack_sequence_as(structure, outputs))
        masks = [
            keras_internals.keras_mask(values[key]) for key in _masked(graph.output_keys, graph)
        ]
        return tuple(values[key] for key in graph.output_keys) + tuple(masks)


def run_calls(
    nodes: Sequence[CallNode],
    values: dict,
    training=None,
    wrap: Callable[[int, Callable], Callable] | None = None,
) -> None:
    """Runs `nodes` in order, reading and adding their tensors to `values` (by graph key).

    Args:
        nodes: the calls to run.
        values: graph key -> tensor; holds every tensor the calls read, and gets theirs.
        training: passed to the calls that take it, as a functional model does.
        wrap: `(node index, call) -> call`, e.g. to record each call's arguments.
    """
    for index, node in enumerate(nodes):
        arguments = {
            argument: values[key]
            for argument, key in zip(node.argument_ids, node.input_keys, strict=True)
        }
        args, kwargs = node.node.arguments.fill_in(arguments)
        function = keras_internals.operation_call(node.operation, training=training)
        if wrap is not None:
            function = wrap(index, function)
        outputs = function(*args, **kwargs)
        values.update(zip(node.output_keys, keras.tree.flatten(outputs), strict=True))


def graph_stages(
    model: keras.Model, graph: CallGraph, boundaries: Sequence[int]
) -> list[GraphStage]:
    """Cuts `graph` into stages that start at call 0 and at each of `boundaries`.

    Args:
        model: the functional model `graph` was walked from.
        graph: `call_graph(model, open_nested=True)`.
        boundaries: index of the first call of stages 1, 2, ...; strictly increasing.

    Example:
        >>> stages = graph_stages(model, call_graph(model, True), [3, 7])  # 3 stages
    """
    edges = [0, *boundaries, len(graph.nodes)]
    if any(start >= end for start, end in zip(edges, edges[1:], strict=False)):
        raise ValueError(
            f"boundaries must increase strictly within 1..{len(graph.nodes) - 1} so that "
            f"every stage has a call. Received: boundaries={list(boundaries)} for "
            f"{len(graph.nodes)} calls"
        )
    cuts = [None, *(_live_keys(graph, cut) for cut in boundaries), None]
    return [
        GraphStage(
            model,
            graph.nodes[start:end],
            cuts[index],
            cuts[index + 1],
            graph.masked_keys,
            name=f"{model.name}_stage_{index}",
        )
        for index, (start, end) in enumerate(zip(edges, edges[1:], strict=False))
    ]


def _masked(keys: Sequence[int], graph) -> list[int]:
    return [key for key in keys if key in graph.masked_keys]


def _live_keys(graph: CallGraph, cut: int) -> tuple[int, ...]:
    """Tensors made before call `cut` (or fed to the model) and needed from it on."""
    made = [*graph.input_keys, *(key for node in graph.nodes[:cut] for key in node.output_keys)]
    needed = {key for node in graph.nodes[cut:] for key in node.input_keys}
    needed.update(graph.output_keys)
    return tuple(dict.fromkeys(key for key in made if key in needed))
