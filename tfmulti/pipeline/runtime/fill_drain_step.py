"""Runs a fill-drain schedule (GPipe) as two loops: every forward, then every backward.

GPipe keeps each micro-batch's activations until the backward phase, so what is in flight
grows every round and no single loop rolls it (`tfmulti.pipeline.round_loop`). Its two phases
each repeat one round, though: round i of the first runs every stage's forward on
micro-batch i, round j of the second every stage's backward on micro-batch j, last stage
first. Each phase is one `tf.while_loop` whose body is traced once, so the step holds 2p
stage calls whatever m. What a forward leaves for its backward (inputs, residuals,
outputs, the loss gradient) is parked in TensorArrays by micro-batch between the loops.

Measured timelines record each round's start and end of every action, by micro-batch.
Each device keeps the schedule's order: one token per device runs through both loops.
Loop iterations overlap (the bodies are traced without TensorFlow's end-of-round barrier,
`unbarriered_loop.py`), so stage s works on micro-batch i + 1 while stage s + 1 works on
i, as in the unrolled step. Gradient sums are summed as `rolled_step` sums them: dense
ones as loop variables, sparse ones by round, joined in micro-batch order.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.pipeline.actions import BACKWARD, FORWARD, Action
from tfmulti.pipeline.runtime.round_loop_step import GradientSums, OutputArrays, new_stamp_arrays
from tfmulti.pipeline.runtime.unbarriered_loop import while_loop_without_barrier


def run_phased(builder, traced_stages):
    """Builds the whole step of a fill-drain schedule with `builder` (an executor's step
    builder whose micro-batch inputs take tensor indices) and returns its `StepResult`.

    `traced_stages`: each stage's `TracedStage` for the micro-batches' signature.
    """
    count, stages = len(builder.inputs), range(len(traced_stages))
    for traced in traced_stages:
        traced.backward  # noqa: B018 - cut B before the loop, out of its graph
    devices = builder.executor.stage_device_names
    outputs = OutputArrays(traced_stages[-1], count, devices[-1])
    start_gates = builder.carried_state()["gates"]
    forwards = _PhaseStamps([Action(FORWARD, stage, 0) for stage in stages], count, builder)
    backwards = _PhaseStamps(
        [Action(BACKWARD, stage, 0) for stage in reversed(stages)], count, builder
    )

    def forward_round(index, gates, parked, output_arrays, stamp_arrays):
        _enter_round(builder, index, gates, {}, traced_stages)
        for action in forwards.actions:
            builder.build(action)
        state = builder.carried_state(packed=False)
        parked = parking.write(parked, state["stash"], index)
        output_arrays = outputs.write(output_arrays, builder)
        return index + 1, state["gates"], parked, output_arrays, forwards.write(stamp_arrays, index)

    parking = _Parking(traced_stages, builder.executor.stage_device_names, count)
    parked = parking.new_arrays()
    _, gates, parked, output_arrays, forward_stamps = while_loop_without_barrier(
        lambda index, *unused: index < count,
        forward_round,
        (tf.constant(0), start_gates, parked, outputs.new_arrays(), forwards.new_arrays()),
        parallel_iterations=min(count, 64),
        maximum_iterations=count,
    )

    builder.accumulated = {}
    sums = GradientSums(builder, traced_stages, set(stages))

    def backward_round(index, gates, dense_sums, sparse_arrays, stamp_arrays):
        _enter_round(builder, index, gates, parking.read(parked, index), traced_stages)
        sums.enter_round(dense_sums)
        for action in backwards.actions:
            builder.build(action)
        return (
            index + 1,
            builder.carried_state()["gates"],
            sums.round_dense(),
            sums.write_round(sparse_arrays, index),
            backwards.write(stamp_arrays, index),
        )

    _, gates, dense_sums, sparse_arrays, backward_stamps = while_loop_without_barrier(
        lambda index, *unused: index < count,
        backward_round,
        (tf.constant(0), gates, sums.start_dense(), sums.new_arrays(), backwards.new_arrays()),
        parallel_iterations=min(count, 64),
        maximum_iterations=count,
    )
    _enter_round(builder, None, gates, {}, traced_stages)
    outputs.read(output_arrays, range(count), builder)
    sums.leave_loop(dense_sums, sparse_arrays)
    forwards.read(forward_stamps)
    backwards.read(backward_stamps)
    return builder.result()


class _PhaseStamps:
    """When the step is traced for a timeline: each round's start and end of `actions`
    (labelled micro-batch 0), by micro-batch, read back as the actions of every one."""

    def __init__(self, actions: list, count: int, builder):
        self.actions, self.count, self.builder = actions, count, builder
        self.recorded = actions if builder.trace else []

    def new_arrays(self) -> list:
        devices = self.builder.executor.stage_device_names
        return new_stamp_arrays(self.recorded, self.count, devices)

    def write(self, arrays, index) -> list:
        written = []
        for action, (starts, ends) in zip(self.recorded, arrays, strict=True):
            start, end = self.builder.stamps.pop(action)
            written.append((starts.write(index, start), ends.write(index, end)))
        return written

    def read(self, arrays) -> None:
        for index in range(self.count):
            for action, (starts, ends) in zip(self.recorded, arrays, strict=True):
                stamped = Action(action.kind, action.stage, index)
                self.builder.stamps[stamped] = (starts.read(index), ends.read(index))


def _enter_round(builder, index, gates, stash, traced_stages) -> None:
    """Sets `builder` to work on micro-batch `index` (labels 0) with `stash` in flight;
    `index` None leaves the loops (labels are micro-batches again)."""
    state = {"stash": stash, "gradient": {}, "carry": {}, "gates": gates}
    builder.restore_state(state, traced_stages)
    builder.index_of = (lambda label: label) if index is None else (lambda label: label + index)
    builder.outputs, builder.losses = {}, {}


class _Parking:
    """TensorArrays, by micro-batch, for what every stage's forward leaves for its
    backward: per stage its inputs, residuals and flat outputs, and for the last stage
    the loss gradient. Each stage's arrays live on its device and are written and read
    there, so nothing parked crosses devices."""

    def __init__(self, traced_stages, stage_device_names, count: int):
        self.devices, self.count = list(stage_device_names), count
        self.specs = []  # per stage: its parts' specs
        last = len(traced_stages) - 1
        for stage, traced in enumerate(traced_stages):
            output_specs, _ = traced.output_specs()
            grad_specs = [spec for spec in output_specs if spec.dtype.is_floating]
            parts = (
                list(traced.input_specs),
                list(traced.residual_specs),
                list(output_specs),
                grad_specs if stage == last else [],
            )
            self.specs.append(parts)

    def new_arrays(self) -> list:
        arrays = []
        for device, parts in zip(self.devices, self.specs, strict=True):
            with tf.device(device):
                arrays.append(
                    [
                        tf.TensorArray(spec.dtype, size=self.count, element_shape=spec.shape)
                        for part in parts
                        for spec in part
                    ]
                )
        return arrays

    def write(self, arrays, stash: dict, index) -> list:
        written = []
        for stage, (device, stage_arrays) in enumerate(zip(self.devices, arrays, strict=True)):
            flat = [t for part in stash[(stage, 0)] for t in part]
            with tf.device(device):
                written.append(
                    [array.write(index, t) for array, t in zip(stage_arrays, flat, strict=True)]
                )
        return written

    def read(self, arrays, index) -> dict:
        stash = {}
        for stage, (device, stage_arrays) in enumerate(zip(self.devices, arrays, strict=True)):
            with tf.device(device):
                flat = [array.read(index) for array in stage_arrays]
            parts, start = [], 0
            for part in self.specs[stage]:
                parts.append(flat[start : start + len(part)])
                start += len(part)
            stash[(stage, 0)] = tuple(parts)
        return stash
