"""A pipeline stage's forward and backward, traced once per input signature.

The stage's Keras call and its tape's gradients are traced together once, into one graph;
that graph is then cut (`graph_cut.GraphCut`) into the functions a schedule's actions
call: F (the outputs, plus the tensors the backward reads, its residuals), B (all
gradients), and for split schedules I (input gradients, plus what W reads from I's work)
and W (weight gradients). Every micro-batch calls the same functions, so tracing costs one
stage call and one `tape.gradient` per stage, however many micro-batches there are. With
recomputation the forward returns no residuals and the backward functions replay the
forward ops they need from the stage inputs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import tensorflow as tf

from tfmulti.compat import tf_internals
from tfmulti.compat.keras_internals import variable_device
from tfmulti.compat.keras_whole_weights import variables_holding
from tfmulti.pipeline.runtime.shared_traces import (
    ReplicaTracedStage,
    call_on_own_variables,
    handle_map,
)
from tfmulti.pipeline.stages.graph_cut import GraphCut, ops_between


def is_differentiable(tensor) -> bool:
    """Whether gradients flow through `tensor` (float tensors; ids and masks get none)."""
    return isinstance(tensor, tf.Tensor) and tensor.dtype.is_floating


def refuse_xla_over_devices(stage) -> None:
    """Raises a one-line ValueError when `stage` holds variables on more than one device.

    XLA compiles a function for one device, so a stage split over a tensor group (its
    shards on several devices) cannot be compiled whole.
    """
    held_on = sorted(
        {variable_device(shard) for weight in stage.weights for shard in variables_holding(weight)}
    )
    if len(held_on) > 1:
        raise ValueError(
            f"Stage {stage.name!r} holds its variables on {len(held_on)} devices "
            f"({', '.join(held_on)}), and XLA compiles a stage for one device; compile "
            "without jit_compile (or use a mesh with tensor=1)."
        )


def _identity(value):
    """An identity op on `value` (an IndexedSlices keeps its parts), so a fetch never is a
    placeholder of the graph being cut."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.identity(value.values), tf.identity(value.indices), value.dense_shape
        )
    return tf.identity(value)


@dataclasses.dataclass(frozen=True)
class Feed:
    """Where a cut function's input comes from: the stage `input`s, the forward's
    `residual`s, the `output_grad`s arriving from the next stage, or I's `carry` for W."""

    source: str
    index: int


def gather_feeds(feeds: Sequence[Feed], sources: dict[str, Sequence[tf.Tensor]]) -> list:
    """The tensors `feeds` name, taken from `sources` (lists keyed by `Feed.source`)."""
    return [sources[feed.source][feed.index] for feed in feeds]


class TracedStage:
    """One stage's F, B, I and W functions for one input signature.

    Call them with flat tensor lists; each returns a flat list. The executor keeps the
    stage inputs, the forward's residuals, the output gradients and I's carry, and hands
    each function the ones its `*_feeds` name.
    """

    def __init__(
        self,
        stage,
        structure,
        input_specs: Sequence[tf.TensorSpec],
        differentiate_inputs: bool,
        remat: bool,
        jit_compile: bool = False,
    ):
        traced = {}

        def full_step(*flat_inputs):
            traced.update(
                _trace_forward_and_backward(stage, structure, flat_inputs, differentiate_inputs)
            )
            return []

        wrapped = tf.compat.v1.wrap_function(full_step, list(input_specs))
        graph = wrapped.graph
        captures = {tensor.ref() for tensor in graph.internal_captures}
        # What the functions capture from outside (the stage's variable handles).
        self.captured = [external for external, _ in graph.captures]
        # Ops the stage placed itself (a tensor group's shards): they run there whichever
        # device calls the functions.
        self.pinned_devices = sorted({op.device for op in graph.get_operations() if op.device})
        inputs = list(traced["inputs"])
        output_grads = traced["output_grads"]
        forward_ops = traced["forward_ops"]
        flat_outputs = traced["outputs"]
        input_grads = traced["input_grads"]
        weight_grads = traced["weight_grads"]
        self.output_structure = traced["output_structure"]
        self.input_specs = list(input_specs)
        self._output_specs = _specs(flat_outputs)
        self.weights = traced["weights"]
        self.num_input_grads = len(input_grads)
        self._weight_grad_structure = weight_grads
        flat_weight_grads = tf.nest.flatten(weight_grads, expand_composites=True)

        kept = {t.ref() for t in inputs} if remat else None
        input_ids = {t.ref(): i for i, t in enumerate(inputs)}
        grad_ids = {t.ref(): i for i, t in enumerate(output_grads)}
        # Weight reads and constants (and what is computed from them alone) are the same
        # in the backward: it reads them again rather than receive them from the forward.
        from_weights = _computed_from_weights(graph, forward_ops, traced["weights"])

        def from_forward(tensor) -> bool:
            if tensor.ref() in grad_ids:
                return True
            if kept is not None:
                return tensor.ref() in kept
            return tensor.op in forward_ops and tensor.op not in from_weights

        _, backward_needs = ops_between(input_grads + flat_weight_grads, from_forward, captures)
        residuals = [
            t for t in backward_needs if t.ref() not in input_ids and t.ref() not in grad_ids
        ]
        residual_ids = {t.ref(): i for i, t in enumerate(residuals)}

        def feed(tensor, carry_ids=None) -> Feed:
            if tensor.ref() in input_ids:
                return Feed("input", input_ids[tensor.ref()])
            if tensor.ref() in grad_ids:
                return Feed("output_grad", grad_ids[tensor.ref()])
            if carry_ids is not None and tensor.ref() in carry_ids:
                return Feed("carry", carry_ids[tensor.ref()])
            return Feed("residual", residual_ids[tensor.ref()])

        if jit_compile:
            refuse_xla_over_devices(stage)
        self._cutter = GraphCut(graph, jit_compile)
        self.forward = self._cutter.function(
            inputs, list(flat_outputs) + residuals, _unread_stateful_ops(forward_ops)
        )
        self.num_outputs = len(flat_outputs)
        # What F returns for the backward, beside the outputs (a fill-drain step parks it).
        self.residual_specs = _specs(residuals)
        # What B or I hands to the previous stage, and what it receives from the next.
        self.input_gradient_specs = _specs(input_grads)
        self.output_gradient_specs = _specs(output_grads)
        self.backward_feeds = [feed(t) for t in backward_needs]

        input_grad_ops, input_grad_needs = ops_between(input_grads, from_forward, captures)

        def before_weight_grad(tensor) -> bool:
            return from_forward(tensor) or tensor.op in input_grad_ops

        _, weight_grad_needs = ops_between(flat_weight_grads, before_weight_grad, captures)
        carry = [t for t in weight_grad_needs if t.op in input_grad_ops]
        carry_ids = {t.ref(): i for i, t in enumerate(carry)}
        self.carry_specs = _specs(carry)
        self.input_grad_feeds = [feed(t) for t in input_grad_needs]
        self.weight_grad_feeds = [feed(t, carry_ids) for t in weight_grad_needs]
        # Cutting a function out costs about as much as tracing it, and a schedule uses
        # either B or I and W: each is cut at its first call.
        self._cuts = {
            "backward": (backward_needs, input_grads + flat_weight_grads),
            "input_grad": (input_grad_needs, input_grads + carry),
            "weight_grad": (weight_grad_needs, flat_weight_grads),
        }

    @property
    def weight_gradient_templates(self) -> list:
        """One traced gradient per weight (an IndexedSlices for a sparse one), for its kind,
        dtype and shape."""
        return list(self._weight_grad_structure)

    def output_specs(self) -> tuple[list[tf.TensorSpec], object]:
        """The flat outputs' specs, and their nesting (the next stage's input signature)."""
        return list(self._output_specs), self.output_structure

    def stash_specs(self, last_stage: bool) -> dict[str, list[tf.TensorSpec]]:
        """What F leaves for the backward, by part: inputs, residuals, outputs and (for
        the last stage) the loss gradient with respect to the outputs."""
        return {
            "inputs": self.input_specs,
            "residuals": self.residual_specs,
            "outputs": self._output_specs,
            "output_grads": self.output_gradient_specs if last_stage else [],
        }

    def carry_part_specs(self) -> dict[str, list[tf.TensorSpec]]:
        """What I leaves for W beside the stash, by part (as `weight_grad_feeds` name their
        sources): the output gradients it was given and what it computed for W."""
        return {"output_grad": self.output_gradient_specs, "carry": self.carry_specs}

    def _cut_function(self, name: str) -> Callable:
        feeds, fetches = self._cuts[name]
        return self._cutter.function(feeds, fetches)

    @functools.cached_property
    def backward(self) -> Callable:
        """All gradients (input gradients, then weight gradients) from `backward_feeds`."""
        return self._cut_function("backward")

    @functools.cached_property
    def input_grad(self) -> Callable:
        """The input gradients, then the carry W reads, from `input_grad_feeds`."""
        return self._cut_function("input_grad")

    @functools.cached_property
    def weight_grad(self) -> Callable:
        """The weight gradients from `weight_grad_feeds`."""
        return self._cut_function("weight_grad")

    def weight_gradients(self, flat: Sequence[tf.Tensor]) -> list:
        """The weight gradients (IndexedSlices for sparse ones) from B's or W's flat outputs."""
        return tf.nest.pack_sequence_as(
            self._weight_grad_structure, list(flat), expand_composites=True
        )


class StageFunctions:
    """A stage's `TracedStage`s, one per input signature (shapes, dtypes, nesting).

    Args:
        stage: the stage's Keras layer (built).
        differentiate_inputs: whether the backward computes gradients for the stage's
            float inputs (not needed for the first stage).
        remat: whether the backward replays the forward instead of keeping residuals.
        jit_compile: compile each function (F, B, I, W, and the plain call) with XLA, each
            for the device the stage runs on.

    Example:
        >>> functions = StageFunctions(stage, differentiate_inputs=True, remat=False)
        >>> traced = functions.for_inputs([x], x)  # traces once; later calls reuse it
    """

    def __init__(self, stage, differentiate_inputs: bool, remat: bool, jit_compile: bool = False):
        self.stage = stage
        self.differentiate_inputs = differentiate_inputs
        self.remat = remat
        self.jit_compile = jit_compile
        self._traced = {}
        self._calls = {}  # training flag -> the stage's plain call as a tf.function
        self._first = None  # the first copy's StageFunctions, whose traces this one calls
        self._handles = None

    def share_traces_of(self, first: StageFunctions) -> None:
        """Calls the functions `first` traces (for a copy of this stage, e.g. another data
        replica's) on this stage's variables instead of tracing its own, wherever the two
        stages hold the same variables (`shared_traces.ReplicaTracedStage`)."""
        self._first = first
        self._traced = {}

    def set_jit_compile(self, jit_compile: bool) -> None:
        """Compiles the stage's functions with XLA from the next trace on (or stops)."""
        if jit_compile != self.jit_compile:
            self.jit_compile = jit_compile
            self._traced, self._calls = {}, {}

    def for_inputs(self, flat_inputs: Sequence[tf.Tensor], structure) -> TracedStage:
        """The functions for stage inputs like `flat_inputs` (nested as `structure`)."""
        return self.for_specs(_specs(flat_inputs), structure)

    def for_specs(self, specs: Sequence[tf.TensorSpec], structure) -> TracedStage:
        """The functions for flat stage inputs of `specs` (nested as `structure`)."""
        specs = list(specs)
        key = (repr(tf.nest.map_structure(lambda _: 0, structure)), tuple(specs))
        if key not in self._traced and self._first is not None:
            shared = self._shared(specs, structure)
            if shared is not None:
                self._traced[key] = shared
        if key not in self._traced:
            self._traced[key] = TracedStage(
                self.stage,
                structure,
                specs,
                self.differentiate_inputs,
                self.remat,
                self.jit_compile,
            )
        return self._traced[key]

    def _shared(self, specs, structure):
        """The first copy's `TracedStage` for these inputs, called on this stage's
        variables; None when the stages' variables do not pair up."""
        traced = self._first.for_specs(specs, structure)
        if not ReplicaTracedStage.covers(traced, self._handles_of_first()):
            return None
        return ReplicaTracedStage(traced, self.stage.trainable_variables, self._handles)

    def _handles_of_first(self) -> dict | None:
        if self._handles is None:
            self._handles = handle_map(self._first.stage, self.stage)
        return self._handles

    def call(self, inputs, training=None):
        """The stage on `inputs`, without gradients (evaluation, prediction).

        In a traced function the call goes through one function per `training` flag and
        input signature, so a step over m micro-batches does not trace the stage m times;
        eagerly the stage runs as is.
        """
        if tf.executing_eagerly():
            return self.stage(inputs, training=training)
        if self._first is not None:
            # A copy calls the first copy's traced call on its own variables.
            concrete = self._first._call_function(training).get_concrete_function(inputs)
            outputs = call_on_own_variables(concrete, inputs, self._handles_of_first())
            if outputs is not None:
                return outputs
        return self._call_function(training)(inputs)

    def _call_function(self, training) -> tf.types.experimental.PolymorphicFunction:
        """The stage's plain call for one `training` flag, as a tf.function."""
        function = self._calls.get(training)
        if function is None:
            stage = self.stage
            if self.jit_compile:
                refuse_xla_over_devices(stage)
            function = tf.function(
                lambda stage_inputs: stage(stage_inputs, training=training),
                autograph=False,
                jit_compile=self.jit_compile,
            )
            self._calls[training] = function
        return function


def _trace_forward_and_backward(stage, structure, flat_inputs, differentiate_inputs) -> dict:
    """Calls `stage` under a tape and asks for all gradients, weighted by placeholders."""
    graph = tf.compat.v1.get_default_graph()
    flat_inputs = list(flat_inputs)
    watched = [t for t in flat_inputs if is_differentiable(t)] if differentiate_inputs else []
    with tf.GradientTape() as tape:
        tape.watch(watched)
        outputs = stage(tf.nest.pack_sequence_as(structure, flat_inputs), training=True)
        outputs = tf.nest.map_structure(_identity, outputs)
    forward_ops = set(graph.get_operations())
    flat_outputs = tf.nest.flatten(outputs)
    differentiable = [t for t in flat_outputs if is_differentiable(t)]
    output_grads = [
        tf.compat.v1.placeholder(t.dtype, t.shape, name="output_grad") for t in differentiable
    ]
    weights = list(stage.trainable_variables)
    gradients = tape.gradient(
        differentiable,
        watched + weights,
        output_gradients=output_grads,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    # Gradients handed to the previous stage travel dense; weight gradients may be sparse.
    input_grads = [tf.identity(tf.convert_to_tensor(g)) for g in gradients[: len(watched)]]
    weight_grads = [_identity(g) for g in gradients[len(watched) :]]
    return {
        "inputs": flat_inputs,
        "outputs": flat_outputs,
        "output_structure": outputs,
        "output_grads": output_grads,
        "forward_ops": forward_ops,
        "input_grads": input_grads,
        "weight_grads": weight_grads,
        "weights": weights,
    }


def _computed_from_weights(graph, forward_ops: set, weights) -> set:
    """Forward ops whose results depend only on the stage's trainable weights and on
    constants: reads of the weights, constants, and stateless ops on those (casts,
    transposes). They are the same whenever they run in a step (the optimizer updates the
    weights after it). Reads of other variables (a dropout's seed, moving statistics) and
    of any variable the forward writes are not among them, nor random ops."""
    handles = {id(getattr(weight, "value", weight).handle) for weight in weights}
    internal = {t.ref() for t in graph.internal_captures}
    steady_reads = {inside.ref() for outside, inside in graph.captures if id(outside) in handles}
    for op in forward_ops:
        if tf_internals.is_stateful(op) and op.type != "ReadVariableOp":
            steady_reads -= {t.ref() for t in op.inputs if t.dtype == tf.resource}
    found = set()
    for op in graph.get_operations():  # in creation order: inputs come first
        if op not in forward_ops or op.type == "Placeholder" or op.control_inputs:
            continue
        if op.type == "ReadVariableOp":
            if op.inputs[0].ref() in steady_reads:
                found.add(op)
            continue
        if not tf_internals.is_stateful(op) and all(
            t.ref() in internal or t.op in found for t in op.inputs
        ):
            found.add(op)
    return found


def _specs(tensors) -> list[tf.TensorSpec]:
    return [tf.TensorSpec(t.shape, t.dtype) for t in tensors]


def _unread_stateful_ops(forward_ops: set) -> list[tf.Operation]:
    """Forward ops that only change state (BatchNorm's moving statistics, seed updates):
    the forward function must run them although no output reads them."""
    return [
        op
        for op in forward_ops
        if tf_internals.is_stateful(op)
        and op.type not in ("Placeholder", "VarHandleOp", "ReadVariableOp")
        and not any(t.consumers() for t in op.outputs)
    ]
