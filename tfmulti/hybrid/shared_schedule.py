"""One traced schedule for every data replica of a hybrid mesh on one host.

The first replica's schedule (its forwards, backwards and loss, as `run_schedule` builds
them) is traced once per input signature as a function of the replica's batch shard; every
other replica calls a copy of that function moved onto its own devices and given its own
variables (`remapped_functions.remapped_call`), so the step's trace does not grow with the
data axis. Evaluation and prediction call the replicas' forward the same way
(`SharedForward`). A replica whose functions cannot be moved (an op on a device of no
stage, or a variable that does not pair up with the first replica's) traces its own, as
before.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmulti.compat.remapped_functions import DeviceMap, UnmovableFunction, remapped_call
from tfmulti.compat.tf_internals import _private
from tfmulti.pipeline.runtime.executor import StepResult
from tfmulti.pipeline.runtime.loss_shares import BatchTotals
from tfmulti.pipeline.runtime.pipeline_model import PipelineModel
from tfmulti.pipeline.runtime.shared_traces import handle_map, held_variables


@dataclasses.dataclass
class _ReplicaBinding:
    """How one replica calls the first replica's traced functions on its own devices and
    variables."""

    devices: DeviceMap
    handles: dict[int, tf.Tensor]
    variables: dict[int, tf.Variable]
    first_handles: set[int]

    def covers(self, concrete) -> bool:
        """Whether every variable of the first replica `concrete` captures has a pair."""
        return all(
            id(t) in self.handles for t in concrete.captured_inputs if id(t) in self.first_handles
        )


class SharedSchedule:
    """Runs `replicas`' schedules through the first replica's traced one.

    Args:
        replicas: the data replicas on this host, copies of one pipeline.
        loss_model: the compiled model whose loss every micro-batch uses.
    """

    def __init__(self, replicas: list[PipelineModel], loss_model: keras.Model):
        self._replicas = replicas
        self._loss_model = loss_model
        self._function = tf.function(self._first_schedule, autograph=False)
        # The variables of each trace's gradients, by the trace's graph (their order may
        # differ between traces).
        self._variables_of_trace: dict[object, list] = {}
        self._copies = _MovedCopies(replicas)

    def _first_schedule(self, x, y, sample_weight, rows_total, weight_sum, rows):
        result = self._replicas[0].run_schedule(
            x,
            y,
            sample_weight,
            loss_model=self._loss_model,
            totals=BatchTotals(rows_total, weight_sum),
            rows=rows,
        )
        self._variables_of_trace[tf.compat.v1.get_default_graph()] = result.variables
        _place_returns_beside_their_inputs()
        return result.outputs, result.losses, result.gradients

    def run(self, index: int, x, y, sample_weight, totals: BatchTotals, rows) -> StepResult:
        """Replica `index`'s `run_schedule` on its batch shard (see
        `PipelineModel.run_schedule`)."""
        args = (x, y, sample_weight, totals.rows, totals.weight_sum, rows)
        concrete = self._function.get_concrete_function(*args)
        first_variables = self._variables_of_trace[concrete.graph]
        if index == 0:
            outputs, losses, gradients = concrete(*args)
            return StepResult(outputs, losses, gradients, list(first_variables), None)
        moved = self._copies.call(index, concrete, args)
        if moved is None:
            return self._replicas[index].run_schedule(
                x, y, sample_weight, loss_model=self._loss_model, totals=totals, rows=rows
            )
        outputs, losses, gradients = moved
        variables = [self._copies.variable(index, v) for v in first_variables]
        return StepResult(outputs, losses, gradients, variables, None)


class SharedForward:
    """Runs `replicas`' forward (evaluation, prediction) through the first replica's traced
    call, as `SharedSchedule` runs their training schedules."""

    def __init__(self, replicas: list[PipelineModel]):
        self._replicas = replicas
        self._functions: dict[object, tf.types.experimental.PolymorphicFunction] = {}
        self._copies = _MovedCopies(replicas)

    def call(self, index: int, inputs, training=None):
        """Replica `index` on `inputs`, as `replica(inputs, training=training)`."""
        replica = self._replicas[index]
        if not tf.inside_function():
            return replica(inputs, training=training)
        concrete = self._function(training).get_concrete_function(inputs)
        if index == 0:
            return concrete(inputs)
        moved = self._copies.call(index, concrete, (inputs,))
        return replica(inputs, training=training) if moved is None else moved

    def _function(self, training):
        if training not in self._functions:
            first = self._replicas[0]

            def first_replica_forward(inputs):
                return first(inputs, training=training)

            self._functions[training] = tf.function(first_replica_forward, autograph=False)
        return self._functions[training]


class _MovedCopies:
    """Calls of the first replica's traced functions moved onto the other replicas."""

    def __init__(self, replicas: list[PipelineModel]):
        self._replicas = replicas
        self._bindings: dict[int, _ReplicaBinding | None] = {}

    def call(self, index: int, concrete, args: tuple):
        """`concrete` (traced on replica 0) run by replica `index` on `args`; None when it
        cannot be moved there (the replica then traces its own)."""
        if index not in self._bindings:
            self._bindings[index] = _bind(self._replicas[0], self._replicas[index])
        binding = self._bindings[index]
        if binding is None or not binding.covers(concrete):
            return None
        captures = [binding.handles.get(id(t), t) for t in concrete.captured_inputs]
        try:
            return remapped_call(
                concrete, args, captures, binding.devices, tag=f"data_replica_{index}"
            )
        except UnmovableFunction:
            return None

    def variable(self, index: int, first_variable: tf.Variable) -> tf.Variable:
        """Replica `index`'s trainable variable in `first_variable`'s place."""
        return self._bindings[index].variables[id(first_variable)]


def _place_returns_beside_their_inputs() -> None:
    """Puts the Identity op TensorFlow adds to each output of the function being traced, once
    the Python function returns, on the device of that output's producer.

    Unplaced, those Identities, and the function's outputs with them, land on the step's
    default device: the chief's first device. Each gradient of a stage on another worker
    then crossed hosts to the chief and back to be summed over the replicas (issue 33:
    4 x the last stage's weights per step with data=2, pipe=2 over two workers). Call it
    last in the traced function: the device function stays on that finished graph.
    """
    graph = tf.compat.v1.get_default_graph()
    _private(graph, "_add_device_to_stack", "Graph._add_device_to_stack")(_beside_input)


def _beside_input(op: tf.Operation) -> str:
    """The device of an Identity op without one: its input's; any other op keeps its own."""
    if op.device or op.type != "Identity" or not op.inputs:
        return op.device
    return op.inputs[0].device


def _bind(first: PipelineModel, replica: PipelineModel) -> _ReplicaBinding | None:
    """How `replica` calls `first`'s traced functions; None when its stages' variables do
    not pair up with `first`'s or its devices do not map one to one."""
    handles: dict[int, tf.Tensor] = {}
    for first_stage, stage in zip(first.stages, replica.stages, strict=True):
        stage_handles = handle_map(first_stage, stage)
        if stage_handles is None:
            return None
        handles.update(stage_handles)
    try:
        devices = DeviceMap(list(zip(first.stage_devices, replica.stage_devices, strict=True)))
    except UnmovableFunction:
        return None
    variables = {
        id(reference): own
        for reference, own in zip(
            first.trainable_variables, replica.trainable_variables, strict=True
        )
    }
    first_handles = {
        id(variable.handle) for stage in first.stages for variable in held_variables(stage)
    }
    return _ReplicaBinding(devices, handles, variables, first_handles)
