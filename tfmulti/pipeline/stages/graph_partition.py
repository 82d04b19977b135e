"""Where to cut a model's call graph into pipeline stages: costs per call and the balancer.

Policies: "uniform" (equal call counts), "params" (the smallest largest stage parameter
count), "time" (measured forward and backward seconds of each call, simulated with the
schedule), "memory" (state bytes plus output bytes, as `place` measures them), or a list of
call names where stages 1, 2, ... begin, like PyTorch's `SplitPoint.BEGINNING`.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmulti.compat import keras_internals
from tfmulti.costing.cost_cache import CostCache, block_signature
from tfmulti.costing.model_graph import (
    CallGraph,
    RecordedCall,
    count_parameters,
    output_bytes,
    recording,
    sample_tensors,
    state_bytes,
    variables_restored,
)
from tfmulti.pipeline.balance import Block, balance
from tfmulti.pipeline.stages.block_partition import BlockTimings
from tfmulti.pipeline.stages.graph_stages import run_calls
from tfmulti.pipeline.stages.spec_sample import sample_from_input_specs

GRAPH_PARTITION_POLICIES = ("uniform", "params", "time", "memory")
# The balancer simulates one-stage-per-device schedules; others are balanced as 1F1B.
_SIMULATED_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h2")
_SHOWN_NAMES = 12
# Stands for a tensor argument of a call in its signature (whose inputs give its shape).
_TENSOR = "<tensor>"


def choose_boundaries(
    model: keras.Model,
    graph: CallGraph,
    num_stages: int,
    partition: str | Sequence[str],
    num_microbatches: int = 1,
    schedule: object = "1f1b",
    sample_input=None,
    cost_cache: CostCache | None = None,
) -> tuple[int, ...]:
    """Returns the index of the first call of stages 1, 2, ... of `graph`.

    Args:
        model: the functional model `graph` was walked from.
        graph: `call_graph(model, open_nested=True)`.
        num_stages: stages to make (p·v).
        partition: a policy in `GRAPH_PARTITION_POLICIES`, or the calls where stages 1..
            begin: names ("block_3", or "backbone/block_3" inside a nested model) or
            indices into `graph.nodes` (as another copy of the model was cut).
        num_microbatches: micro-batches per step, for the simulated step time.
        schedule: the pipeline's schedule (a name is simulated; anything else as 1F1B).
        sample_input: one micro-batch of model input for "time" and "memory"; made from
            the model's input specs if None (`sample_from_input_specs`).
        cost_cache: call timings kept between runs ("time" only).

    Example:
        >>> choose_boundaries(model, call_graph(model, True), 2, ["dense_3"])
        (5,)
    """
    if len(graph.nodes) < num_stages:
        raise ValueError(
            f"Model {model.name!r} has {len(graph.nodes)} calls, too few for {num_stages} "
            "stages. Use fewer devices or chunks."
        )
    if not isinstance(partition, str):
        names = list(partition)
        if len(names) != num_stages - 1:
            raise ValueError(
                f"A list partition names where each stage after the first begins: "
                f"{num_stages - 1} names for {num_stages} stages. Received: partition={names}"
            )
        boundaries = tuple(
            _call_index(graph, name) if isinstance(name, str) else int(name) for name in names
        )
        policy = "manual"
    elif partition in GRAPH_PARTITION_POLICIES:
        boundaries, policy = None, partition
    else:
        raise ValueError(
            f"partition must be one of {list(GRAPH_PARTITION_POLICIES)} or a list of layer "
            f"names where stages 1.. begin. Received: partition={partition!r}"
        )
    if policy in ("time", "memory") and sample_input is None:
        sample_input = sample_from_input_specs(model, f"partition={policy!r}")
    blocks = call_blocks(
        model,
        graph,
        sample_input if policy in ("time", "memory") else None,
        time_calls=policy == "time",
        cache=cost_cache,
    )
    if policy == "memory":
        # The "params" policy is an exact min-max over `Block.params`; given each call's
        # memory, it minimises the largest stage memory instead (as `place` does).
        blocks = [
            Block(params=int(block.param_bytes + block.activation_bytes), name=block.name)
            for block in blocks
        ]
        policy = "params"
    simulated = schedule if schedule in _SIMULATED_SCHEDULES else "1f1b"
    partition = balance(
        blocks, num_stages, num_microbatches, policy, schedule=simulated, boundaries=boundaries
    )
    return partition.boundaries


def call_blocks(
    model: keras.Model,
    graph: CallGraph,
    sample_input=None,
    time_calls: bool = True,
    cache: CostCache | None = None,
) -> list[Block]:
    """Costs each call as a balancer `Block`; a layer called twice counts its weights once.

    With `sample_input`, runs the calls once in training mode and counts each one's output
    bytes; with `time_calls` too, times each on its recorded arguments. Calls that cost
    the same (equal `block_signature`: a GPT-2's decoder layers) are timed once, and with
    `cache` calls it holds are not timed at all. Every variable is restored afterwards.

    Example:
        >>> [block.params for block in call_blocks(model, call_graph(model, True))]
    """
    seen = set()
    first_calls = []
    for node in graph.nodes:
        first_calls.append(id(node.operation) not in seen)
        seen.add(id(node.operation))
    times = [(1.0, 2.0)] * len(graph.nodes)
    activations = [0.0] * len(graph.nodes)
    if sample_input is not None:
        with variables_restored(model):
            calls = _record_calls(model, graph, sample_input)
            activations = [output_bytes(call.outputs) for call in calls]
            if time_calls:
                times = _call_seconds(graph, calls, cache)
    return [
        Block(
            forward_time=forward,
            backward_time=backward,
            params=count_parameters(node.operation) if first else 0,
            activation_bytes=activation,
            param_bytes=state_bytes(node.operation) if first else 0.0,
            name=node.name,
        )
        for node, first, (forward, backward), activation in zip(
            graph.nodes, first_calls, times, activations, strict=True
        )
    ]


def measure_calls(model: keras.Model, graph: CallGraph, sample_input, measure) -> list:
    """`measure(call, call.tensors, call_signature(call))` for each call of `model` on
    `sample_input`, in node order (`call_signature` is None for calls that cannot be
    compared). Every variable is restored afterwards.

    Example:
        >>> shares = measure_calls(model, call_graph(model, True), x[:16], SplitShares().of)
    """
    with variables_restored(model):
        calls = _record_calls(model, graph, sample_input)
        return [measure(call, call.tensors, call_signature(call)) for call in calls]


def _call_seconds(graph, calls, cache) -> list[tuple[float, float]]:
    timings = BlockTimings(cache)
    times = [
        timings.seconds(
            call,
            call.tensors,
            call_signature(call),
            f"{type(call.operation).__name__} {node.name}",
        )
        for node, call in zip(graph.nodes, calls, strict=True)
    ]
    timings.report()
    return times


def call_signature(call: RecordedCall) -> str | None:
    """`block_signature` of a recorded call, its plain arguments included; None (time the
    call on its own) when the operation's config cannot be read."""
    arguments = tf.nest.map_structure(
        lambda leaf: _TENSOR if tf.is_tensor(leaf) else leaf, call.structure
    )
    try:
        return block_signature(call.operation, call.tensors, arguments)
    # A user's layer may fail to give its config in any way; it is then just timed.
    except Exception:
        return None


def _record_calls(model, graph, sample_input) -> list[RecordedCall]:
    """Each node's call on `sample_input`, in node order."""
    calls = [None] * len(graph.nodes)

    def wrap(index, function):
        return recording(
            graph.nodes[index].operation, function, lambda call: calls.__setitem__(index, call)
        )

    values = dict(zip(graph.input_keys, sample_tensors(model, sample_input), strict=True))
    run_calls(graph.nodes, values, training=True, wrap=wrap)
    return calls


def _call_index(graph: CallGraph, name: str) -> int:
    """The first call named `name` (its full path, or its own name if that is unique)."""
    names = [node.name for node in graph.nodes]
    if name in names:
        return names.index(name)
    suffixed = [index for index, full in enumerate(names) if full.endswith("/" + name)]
    paths = {names[index] for index in suffixed}
    if len(paths) == 1:
        return suffixed[0]
    if len(paths) > 1:
        raise ValueError(
            f"Split point {name!r} names several calls: {sorted(paths)}. Use the full path."
        )
    holder = _holder_of(graph, name)
    if holder is not None:
        raise ValueError(
            f"Layer {name!r} runs inside {holder.name!r} ({type(holder.operation).__name__}), "
            f"which is one call and cannot be split. Cut before or after it: at "
            f"{holder.name!r} or at the call after it."
        )
    shown = ", ".join(repr(n) for n in names[1 : _SHOWN_NAMES + 1])
    raise ValueError(
        f"No call named {name!r} in the model. Stages may begin at any call after the "
        f"first, e.g. {shown}{', ...' if len(names) > _SHOWN_NAMES + 1 else ''}"
    )


def _holder_of(graph: CallGraph, name: str):
    for node in graph.nodes:
        if isinstance(node.operation, keras.layers.Layer) and any(
            layer.name == name
            for layer in keras_internals.layers_within(node.operation, include_self=False)
        ):
            return node
    return None
