"""Runs one pipeline schedule inside a traced TensorFlow function.

Each action becomes a group of ops under `tf.device(stage device)`. Per device, every
action's ops wait (control dependencies) for the previous action's results, as on a GPU
stream, so the device runs the actions in the schedule's order; across devices, only data
(activations forward, gradients backward) orders them.

A backward is the stage's vector-Jacobian product: a `tf.GradientTape` recorded during the
stage's F (or, with recomputation, during a replay of F inside the backward) is asked for
the gradients of the stage outputs, weighted by the gradient arriving from the next stage.
A split backward computes all gradients at I, then holds back the ops that only the weight
gradients need (found by walking the graph) until W's turn on the device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)
from tfmulti.pipeline.dependencies import run_in_order


@dataclasses.dataclass
class StepResult:
    """What one traced schedule produced.

    Args:
        outputs: last-stage outputs, one nest per micro-batch.
        losses: the unscaled loss of each micro-batch.
        gradients: gradient sum over micro-batches for each of `variables`.
        variables: the trainable variables, each once, in stage order.
        stamps: per action (start, end) timestamp tensors in seconds, when traced.
    """

    outputs: list
    losses: list
    gradients: list
    variables: list
    stamps: dict[Action, tuple[tf.Tensor, tf.Tensor]] | None


def execution_order(schedule: Schedule) -> list[Action]:
    """All actions in an order that respects each device's order and every data dependency.

    Raises:
        ValueError: the schedule deadlocks, naming the action each device waits at.
    """
    records, stuck = run_in_order(schedule, lambda action: 1.0, lambda producer, consumer: 0.0)
    if any(action is not None for action in stuck):
        waiting = {device: str(action) for device, action in enumerate(stuck) if action}
        raise ValueError(
            f"Schedule {schedule.name!r} deadlocks: devices wait forever at {waiting}. "
            "Run tfmulti.pipeline.validate_schedule on it to see why."
        )
    return [record.action for record in records]


def _now(*unused_inputs) -> np.float64:
    return np.float64(time.perf_counter())


def _timestamp(after: Sequence[tf.Tensor]) -> tf.Tensor:
    """Seconds when all of `after` are ready.

    A stateless numpy_function fed a scalar slice of each input: stateful ops would be
    chained across devices by tf.function's automatic control dependencies.
    """
    tokens = [tf.reshape(tensor, [-1])[:1] for tensor in after]
    return tf.numpy_function(_now, tokens, tf.float64, stateful=False)


def add_gradients(first, second):
    """Sums two gradients; sparse ones (e.g. of embeddings) stay sparse by concatenation."""
    if isinstance(first, tf.IndexedSlices) and isinstance(second, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([first.values, second.values], axis=0),
            tf.concat([first.indices, second.indices], axis=0),
            first.dense_shape,
        )
    return tf.convert_to_tensor(first) + tf.convert_to_tensor(second)


def _tensor_part(gradient) -> tf.Tensor:
    """A tensor that is ready when `gradient` is, for control dependencies and timestamps."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _is_differentiable(tensor) -> bool:
    return isinstance(tensor, tf.Tensor) and tensor.dtype.is_floating


def _ops_needed_only_by(
    weight_grads: Sequence[tf.Tensor], input_grads: Sequence[tf.Tensor], new_ops: set
) -> list[tf.Operation]:
    """The ops among `new_ops` that feed `weight_grads` but none of `input_grads`, roots first."""

    def ancestors(tensors):
        seen = set()
        pending = [t.op for t in tensors if t.op in new_ops]
        while pending:
            op = pending.pop()
            if op in seen:
                continue
            seen.add(op)
            pending.extend(t.op for t in op.inputs if t.op in new_ops)
            pending.extend(c for c in op.control_inputs if c in new_ops)
        return seen

    weight_only = ancestors(map(_tensor_part, weight_grads)) - ancestors(input_grads)
    return [op for op in weight_only if not any(t.op in weight_only for t in op.inputs)]


class ScheduleExecutor:
    """Builds the ops of a whole pipeline step, one action at a time.

    Args:
        stages: one callable Keras layer per stage.
        stage_device_names: the device name of each stage.
        schedule: the schedule to run.
        remat: per stage, whether its backward replays the forward instead of keeping the
            forward's intermediate tensors.
    """

    def __init__(
        self,
        stages: Sequence,
        stage_device_names: Sequence[str],
        schedule: Schedule,
        remat: Sequence[bool],
    ):
        self.stages = list(stages)
        self.stage_device_names = list(stage_device_names)
        self.schedule = schedule
        self.remat = list(remat)
        self.order = execution_order(schedule)
        self.device_of_stage = list(schedule.stage_devices)

    def run(
        self,
        microbatch_inputs: Sequence,
        loss_fn: Callable[[int, object], tuple[tf.Tensor, tf.Tensor]],
        trace: bool = False,
    ) -> StepResult:
        """Traces the schedule on `microbatch_inputs`.

        Args:
            microbatch_inputs: one input nest per micro-batch.
            loss_fn: `(microbatch, outputs) -> (loss, differentiated_loss)`; the second is
                what the backward differentiates (e.g. loss / m, times a loss scale).
            trace: also return start and end timestamps of every action.
        """
        run = _StepBuilder(self, microbatch_inputs, loss_fn, trace)
        for action in self.order:
            run.build(action)
        return run.result()


class _StepBuilder:
    """The state of one traced step: stashed tapes, gradients in flight, device gates."""

    def __init__(self, executor: ScheduleExecutor, microbatch_inputs, loss_fn, trace: bool):
        self.executor = executor
        self.inputs = list(microbatch_inputs)
        self.loss_fn = loss_fn
        self.trace = trace
        self.last_stage = len(executor.stages) - 1
        self.activations = {}  # (stage, microbatch) -> (inputs, outputs, tape, loss pair)
        self.input_grads = {}  # (stage, microbatch) -> gradients w.r.t. flat stage inputs
        self.pending_weight_grads = {}  # (stage, microbatch) -> (grads, held-back root ops)
        self.device_gate = {}  # device -> tensors the next action on it must wait for
        self.accumulated = {}  # variable id -> gradient sum
        self.variables = {}  # variable id -> variable, in first-seen order
        self.outputs = [None] * len(self.inputs)
        self.losses = [None] * len(self.inputs)
        self.stamps = {}

    def build(self, action: Action) -> None:
        device = self.executor.device_of_stage[action.stage]
        gate = self.device_gate.get(device, [])
        arriving = self._arriving_tensors(action)
        with tf.device(self.executor.stage_device_names[action.stage]):
            start = None
            if self.trace:
                start = _timestamp(list(gate) + arriving)
                gate = [start]
            with tf.control_dependencies(gate):
                if action.kind == FORWARD:
                    produced = self._forward(action)
                elif action.kind == WEIGHT_GRAD:
                    produced = self._weight_grad(action, gate)
                else:
                    produced = self._backward(action, split=action.kind == INPUT_GRAD)
            if self.trace:
                end = _timestamp(produced or [start])
                self.stamps[action] = (start, end)
                produced = [end]
        self.device_gate[device] = produced or gate

    def _arriving_tensors(self, action: Action) -> list:
        stage, microbatch = action.stage, action.microbatch
        if action.kind == FORWARD:
            source = (
                self.inputs[microbatch]
                if stage == 0
                else self.activations[(stage - 1, microbatch)][1]
            )
            return [t for t in tf.nest.flatten(source) if isinstance(t, tf.Tensor)]
        if action.kind in (BACKWARD, INPUT_GRAD) and stage < self.last_stage:
            return list(self.input_grads[(stage + 1, microbatch)])
        return []

    def _stage_call(self, stage_index: int, microbatch: int, stage_inputs):
        outputs = self.executor.stages[stage_index](stage_inputs, training=True)
        loss_pair = None
        if stage_index == self.last_stage:
            loss_pair = self.loss_fn(microbatch, outputs)
        return outputs, loss_pair

    def _recorded_call(self, stage_index: int, microbatch: int, stage_inputs):
        with tf.GradientTape() as tape:
            tape.watch([t for t in tf.nest.flatten(stage_inputs) if _is_differentiable(t)])
            outputs, loss_pair = self._stage_call(stage_index, microbatch, stage_inputs)
        return outputs, loss_pair, tape

    def _forward(self, action: Action) -> list:
        stage, microbatch = action.stage, action.microbatch
        if stage == 0:
            stage_inputs = self.inputs[microbatch]
        else:
            stage_inputs = self.activations[(stage - 1, microbatch)][1]
        if self.executor.remat[stage]:
            outputs, loss_pair = self._stage_call(stage, microbatch, stage_inputs)
            tape = None
        else:
            outputs, loss_pair, tape = self._recorded_call(stage, microbatch, stage_inputs)
        self.activations[(stage, microbatch)] = (stage_inputs, outputs, tape, loss_pair)
        produced = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor)]
        if loss_pair is not None:
            self.outputs[microbatch] = outputs
            self.losses[microbatch] = loss_pair[0]
            produced.append(loss_pair[1])
        return produced

    def _backward(self, action: Action, split: bool) -> list:
        stage, microbatch = action.stage, action.microbatch
        stage_inputs, outputs, tape, loss_pair = self.activations[(stage, microbatch)]
        if tape is None:
            outputs, loss_pair, tape = self._recorded_call(stage, microbatch, stage_inputs)
        differentiable_inputs = (
            [t for t in tf.nest.flatten(stage_inputs) if _is_differentiable(t)] if stage else []
        )
        weights = list(self.executor.stages[stage].trainable_variables)
        graph = tf.compat.v1.get_default_graph()
        ops_before = len(graph.get_operations())
        if stage == self.last_stage:
            gradients = tape.gradient(
                loss_pair[1],
                differentiable_inputs + weights,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
        else:
            flat_outputs = [t for t in tf.nest.flatten(outputs) if _is_differentiable(t)]
            gradients = tape.gradient(
                flat_outputs,
                differentiable_inputs + weights,
                output_gradients=self.input_grads.pop((stage + 1, microbatch)),
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
        input_grads = gradients[: len(differentiable_inputs)]
        weight_grads = gradients[len(differentiable_inputs) :]
        self.input_grads[(stage, microbatch)] = input_grads
        if not split:
            del self.activations[(stage, microbatch)]
            sums = self._accumulate(weights, weight_grads)
            # A whole backward hands its input gradient on when it ends, as planned; else
            # the previous stage could overlap this stage's weight-gradient work.
            with tf.control_dependencies(sums):
                input_grads = [tf.identity(_tensor_part(g)) for g in input_grads]
            self.input_grads[(stage, microbatch)] = input_grads
            return input_grads + sums
        new_ops = set(graph.get_operations()[ops_before:])
        held_back = _ops_needed_only_by(weight_grads, input_grads, new_ops)
        self.pending_weight_grads[(stage, microbatch)] = (weights, weight_grads, held_back)
        return [_tensor_part(g) for g in input_grads]

    def _weight_grad(self, action: Action, gate: Sequence[tf.Tensor]) -> list:
        key = (action.stage, action.microbatch)
        weights, weight_grads, held_back = self.pending_weight_grads.pop(key)
        gate_ops = [tensor.op for tensor in gate]
        for op in held_back:
            # The ops were created during I; W's turn on the device is only known now.
            op._add_control_inputs([g for g in gate_ops if g not in op.control_inputs])
        del self.activations[key]
        return self._accumulate(weights, weight_grads)

    def _accumulate(self, weights, weight_grads) -> list:
        sums = []
        for variable, gradient in zip(weights, weight_grads, strict=True):
            key = id(variable)
            self.variables.setdefault(key, variable)
            total = self.accumulated.get(key)
            self.accumulated[key] = gradient if total is None else add_gradients(total, gradient)
            sums.append(_tensor_part(self.accumulated[key]))
        return sums

    def result(self) -> StepResult:
        keys = list(self.variables)
        return StepResult(
            outputs=self.outputs,
            losses=self.losses,
            gradients=[self.accumulated[key] for key in keys],
            variables=[self.variables[key] for key in keys],
            stamps=self.stamps if self.trace else None,
        )
