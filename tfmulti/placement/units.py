"""The units a functional model is placed by, their edges, and their measured costs.

A unit is one top-level operation of the model's graph: a layer, a nested model (one unit,
whatever it holds) or a `keras.ops` call made on symbolic tensors. Units come in the
topological order Keras runs them in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras

from tfmulti.compat import keras_internals

# Reused so placement and pipeline partitions time blocks the same way.
from tfmulti.costing.cost_cache import CostCache
from tfmulti.costing.model_graph import (
    RecordedCall,
    call_graph,
    count_parameters,
    output_bytes,
    recording,
    sample_tensors,
    state_bytes,
    variables_restored,
)
from tfmulti.pipeline.balance import Block
from tfmulti.pipeline.stages.block_partition import BlockTimings
from tfmulti.pipeline.stages.graph_partition import call_signature


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


def graph_units(model: keras.Model) -> list[GraphUnit]:
    """Lists the top-level operations of functional `model` in topological order.

    Example:
        >>> [unit.name for unit in graph_units(model)]
        ['dense', 'dense_1', 'add', 'logits']
    """
    nodes = call_graph(model).nodes
    producer_of = {key: node.operation.name for node in nodes for key in node.output_keys}
    producers: dict[str, list[str]] = {}
    for node in nodes:
        producers.setdefault(node.operation.name, []).extend(
            producer_of[key] for key in node.input_keys if key in producer_of
        )
    return [
        GraphUnit(operation.name, operation, tuple(dict.fromkeys(producers[operation.name])))
        for operation in model.operations
        if not isinstance(operation, keras.layers.InputLayer)
    ]


def unit_blocks(
    model: keras.Model,
    units: Sequence[GraphUnit],
    sample_input=None,
    time_units: bool = False,
    cost_cache: CostCache | None = None,
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
        time_units: time forward and backward (needs `sample_input`); calls that cost the
            same are timed once, and those in `cost_cache` not at all.
        cost_cache: call timings kept between runs (`CostCache`).

    Example:
        >>> blocks = unit_blocks(model, graph_units(model), x[:32], time_units=True)
    """
    if sample_input is None:
        return [_block(unit, forward_time=1.0, backward_time=2.0) for unit in units]
    timings = BlockTimings(cost_cache) if time_units else None
    with variables_restored(model):
        calls = _record_calls(model, sample_input)
        blocks = []
        for unit in units:
            recorded = calls.get(unit.name, [])
            forward_time, backward_time = 1.0, 2.0
            if timings is not None and recorded:
                description = f"{type(unit.operation).__name__} {unit.name}"
                times = [
                    timings.seconds(call, call.tensors, call_signature(call), description)
                    for call in recorded
                ]
                forward_time = sum(time[0] for time in times)
                backward_time = sum(time[1] for time in times)
            activation_bytes = sum(output_bytes(call.outputs) for call in recorded)
            blocks.append(_block(unit, forward_time, backward_time, activation_bytes))
    if timings is not None:
        timings.report()
    return blocks


def _block(unit, forward_time, backward_time, activation_bytes=0.0):
    return Block(
        forward_time=forward_time,
        backward_time=backward_time,
        params=count_parameters(unit.operation),
        activation_bytes=activation_bytes,
        param_bytes=state_bytes(unit.operation),
        name=unit.name,
    )


def _record_calls(model, sample_input) -> dict[str, list[RecordedCall]]:
    """Each operation's calls on `sample_input`, by operation name."""
    calls: dict[str, list[RecordedCall]] = {}

    def wrap(operation):
        return recording(
            operation, operation, lambda call: calls.setdefault(operation.name, []).append(call)
        )

    keras_internals.run_through_graph(model, sample_tensors(model, sample_input), operation_fn=wrap)
    return calls
