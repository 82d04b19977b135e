"""Runs a rolled schedule: its prologue, its body in a `tf.while_loop` of R rounds, its epilogue.

The body (one round of every device's actions, `tfmulti.pipeline.round_loop`) is traced once,
so the step's graph holds the prologue, one body and the epilogue however many micro-batches
there are. What is in flight between rounds (stashed activations and residuals, gradients
on their way to the previous stage, I's carry, each device's order token) is the loop's
state: `roll_schedule` checked that it has the same shape at every round. Dense gradient
sums are loop variables too; sparse ones (embeddings) are collected per round in
TensorArrays and joined after the loop in micro-batch order, as the unrolled step adds
them. Last-stage outputs and losses go to TensorArrays indexed by micro-batch.

A guarded roll (`tfmulti.pipeline.round_loop.guard_roll`) has no prologue or epilogue: the
loop starts from empty stashes and runs each action that some rounds skip inside a
`tf.cond` (`guarded_actions.py`). Stashes travel packed, one TensorList per dtype
(`tensor_packing.py`).

Each device's actions keep the schedule's order: within a round by the body's order and
from round to round by the device's token. Loop iterations may overlap (TensorFlow runs
an iteration's ops as soon as their inputs are ready, and the body is traced without its
end-of-round barrier, `unbarriered_loop.py`), so devices drift apart by rounds just as the
unrolled schedule lets them.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from tfmulti.pipeline.overlapped_pairs import body_pair_partners, pair_partners
from tfmulti.pipeline.round_loop import RolledSchedule
from tfmulti.pipeline.runtime.conditional_actions import build_guarded, zero_start_state
from tfmulti.pipeline.runtime.unbarriered_loop import while_loop_without_barrier

_BACKWARD_PIECES = {BACKWARD: "backward", INPUT_GRAD: "input_grad", WEIGHT_GRAD: "weight_grad"}


def run_rolled(builder, rolled: RolledSchedule, traced_stages):
    """Builds the whole step of `rolled` with `builder` (an executor's step builder whose
    micro-batch inputs take tensor indices) and returns its `StepResult`.

    `traced_stages`: each stage's `TracedStage` for the micro-batches' signature.
    """
    summed_stages = _prepare_functions(traced_stages, rolled)
    if rolled.guarded:
        start = zero_start_state(
            rolled.start_in_flight, traced_stages, builder.executor.stage_device_names
        )
        builder.restore_state(dict(start, gates={}), traced_stages)
    partners = pair_partners(rolled.schedule)
    builder.build_all(rolled.prologue, partners)
    prologue_results = (dict(builder.outputs), dict(builder.losses))
    sums = GradientSums(builder, traced_stages, summed_stages)
    devices = builder.executor.stage_device_names
    outputs = OutputArrays(
        traced_stages[-1], len(builder.inputs), devices[-1], _output_labels(rolled)
    )
    stamps = _StampArrays(rolled, builder.trace, devices)
    stride = rolled.stride
    start_state = builder.carried_state()
    state_structure = tf.nest.map_structure(lambda _: 0, start_state)

    def body(round_index, flat_state, dense_sums, sparse_arrays, output_arrays, stamp_arrays):
        builder.restore_state(tf.nest.pack_sequence_as(start_state, flat_state), traced_stages)
        builder.index_of = lambda label: rolled.microbatch_in_round(label, round_index)
        builder.outputs, builder.losses = {}, {}
        sums.enter_round(dense_sums)
        pairing = builder.pairing(body_pair_partners(rolled))
        for action in rolled.body:
            pair_gate = pairing.gate_for(action)  # None for an action some rounds skip
            runs = rolled.rounds_run(action)
            if len(runs) == rolled.rounds:
                builder.build(action, pair_gate)
                continue
            runs_now = tf.logical_and(round_index >= runs.start, round_index < runs.stop)
            with tf.device(devices[action.stage]):  # where the cond's merges run
                build_guarded(builder, action, runs_now, traced_stages)
        next_state = builder.carried_state(shift=-stride)
        if tf.nest.map_structure(lambda _: 0, next_state) != state_structure:
            raise AssertionError("A rolled round changed what is in flight; a tfmulti bug.")
        return (
            round_index + 1,
            tf.nest.flatten(next_state),
            sums.round_dense(),
            sums.write_round(sparse_arrays, round_index),
            outputs.write(output_arrays, builder),
            stamps.write(stamp_arrays, builder, round_index),
        )

    loop_vars = (
        tf.constant(0, tf.int32),
        tf.nest.flatten(start_state),
        sums.start_dense(),
        sums.new_arrays(),
        outputs.new_arrays(),
        stamps.new_arrays(),
    )
    _, flat_state, dense_sums, sparse_arrays, output_arrays, stamp_arrays = (
        while_loop_without_barrier(
            lambda round_index, *unused: round_index < rolled.rounds,
            body,
            loop_vars,
            parallel_iterations=max(1, min(rolled.rounds, 64)),
            maximum_iterations=rolled.rounds,
        )
    )
    builder.restore_state(
        tf.nest.pack_sequence_as(start_state, flat_state),
        traced_stages,
        shift=(rolled.rounds + rolled.first_round) * stride,
    )
    builder.index_of = lambda label: label
    builder.outputs, builder.losses = prologue_results
    last_stage = len(traced_stages) - 1
    looped_outputs = [
        action.microbatch
        for r in range(rolled.rounds)
        for action in rolled.round_actions(r)
        if action.kind == FORWARD and action.stage == last_stage
    ]
    outputs.read(output_arrays, looped_outputs, builder)
    stamps.read(stamp_arrays, builder)
    sums.leave_loop(dense_sums, sparse_arrays)
    builder.build_all(rolled.epilogue, partners)
    return builder.result()


def _output_labels(rolled: RolledSchedule) -> tuple[int, int]:
    """The lowest and highest micro-batch the loop's last-stage forwards write."""
    last_stage = rolled.schedule.num_stages - 1
    written = [
        rolled.microbatch_in_round(action.microbatch, round_index)
        for action in rolled.body
        if action.kind == FORWARD and action.stage == last_stage
        for round_index in (0, rolled.rounds - 1)
    ]
    return min(written, default=0), max(written, default=0)


def _prepare_functions(traced_stages, rolled: RolledSchedule) -> set[int]:
    """Cuts the backward pieces the schedule uses before the loop (each is traced once, out
    of the loop's graph); returns the stages whose weight gradients the body sums."""
    kinds = {
        (action.kind, action.stage)
        for actions in rolled.schedule.device_actions
        for action in actions
    }
    for kind, stage in kinds:
        if kind in _BACKWARD_PIECES:
            getattr(traced_stages[stage], _BACKWARD_PIECES[kind])
    return {action.stage for action in rolled.body if action.kind in (BACKWARD, WEIGHT_GRAD)}


class GradientSums:
    """The weight-gradient sums of the stages the body works on, across the loop."""

    def __init__(self, builder, traced_stages, summed_stages: set[int]):
        self.builder = builder
        self.dense, self.sparse = [], []  # (variable key, variable, gradient template)
        self.devices = {}  # variable key -> the device its (first) stage runs on
        found = {}  # variable key -> (variable, its gradient templates in every stage)
        for stage in sorted(summed_stages):
            traced = traced_stages[stage]
            templates = traced.weight_gradient_templates
            for variable, template in zip(traced.weights, templates, strict=True):
                self.devices.setdefault(id(variable), builder.executor.stage_device_names[stage])
                found.setdefault(id(variable), (variable, []))[1].append(template)
        for key, (variable, templates) in found.items():
            # A weight used densely anywhere (a tied embedding's output layer) sums densely.
            dense = [t for t in templates if not isinstance(t, tf.IndexedSlices)]
            if dense:
                self.dense.append((key, variable, dense[0]))
            else:
                self.sparse.append((key, variable, templates[0]))
        # The prologue's part of each sparse sum; the loop's rounds follow it.
        self.sparse_before = {key: builder.accumulated.pop(key, None) for key, *_ in self.sparse}

    def start_dense(self) -> list:
        accumulated, variables = self.builder.accumulated, self.builder.variables
        start = []
        for key, variable, template in self.dense:
            variables.setdefault(key, variable)
            total = accumulated.get(key)
            # A loop variable starts on the device that updates it: TensorFlow runs its
            # loop bookkeeping there, so nothing crosses devices from round to round.
            with tf.device(self.devices[key]):
                if total is None:
                    total = tf.zeros(variable.shape, template.dtype)
                start.append(tf.convert_to_tensor(total))
        return start

    def new_arrays(self) -> list:
        arrays = []
        for key, _, template in self.sparse:
            with tf.device(self.devices[key]):
                arrays.append(
                    (
                        tf.TensorArray(template.values.dtype, size=0, dynamic_size=True),
                        tf.TensorArray(template.indices.dtype, size=0, dynamic_size=True),
                    )
                )
        return arrays

    def enter_round(self, dense_sums) -> None:
        accumulated = self.builder.accumulated
        for (key, _, _), total in zip(self.dense, dense_sums, strict=True):
            accumulated[key] = total
        for key, *_ in self.sparse:
            accumulated.pop(key, None)

    def round_dense(self) -> list:
        return [self.builder.accumulated[key] for key, _, _ in self.dense]

    def write_round(self, arrays, round_index) -> list:
        written = []
        for (key, _, _), (values, indices) in zip(self.sparse, arrays, strict=True):
            part = self.builder.accumulated.pop(key)
            written.append(
                (values.write(round_index, part.values), indices.write(round_index, part.indices))
            )
        return written

    def leave_loop(self, dense_sums, arrays) -> None:
        accumulated, variables = self.builder.accumulated, self.builder.variables
        for (key, _, _), total in zip(self.dense, dense_sums, strict=True):
            accumulated[key] = total
        for (key, variable, template), (values, indices) in zip(self.sparse, arrays, strict=True):
            variables.setdefault(key, variable)
            dense_shape = tf.constant(list(variable.shape), template.dense_shape.dtype)
            looped = tf.IndexedSlices(values.concat(), indices.concat(), dense_shape)
            before = self.sparse_before[key]
            accumulated[key] = looped if before is None else _joined(before, looped)


def _joined(first: tf.IndexedSlices, second: tf.IndexedSlices) -> tf.IndexedSlices:
    return tf.IndexedSlices(
        tf.concat([first.values, second.values], axis=0),
        tf.concat([first.indices, second.indices], axis=0),
        first.dense_shape,
    )


class OutputArrays:
    """The last stage's outputs and losses of the looped micro-batches, by micro-batch.

    `extent`: the lowest and highest micro-batch written, when a guarded loop also writes
    (zeros) for micro-batches outside the step's; by default 0 to m - 1.
    """

    def __init__(
        self,
        last_traced,
        num_microbatches: int,
        device: str,
        extent: tuple[int, int] | None = None,
    ):
        self.specs, self.structure = last_traced.output_specs()
        self.device = device
        lowest, highest = extent or (0, num_microbatches - 1)
        self.offset = -min(lowest, 0)
        self.size = self.offset + max(highest + 1, num_microbatches)
        self.loss_dtype = None

    def new_arrays(self) -> list:
        with tf.device(self.device):
            arrays = [tf.TensorArray(spec.dtype, size=self.size) for spec in self.specs]
            return arrays + [tf.TensorArray(tf.float32, size=self.size)]

    def write(self, arrays, builder) -> list:
        output_arrays, loss_array = list(arrays[:-1]), arrays[-1]
        for label, outputs in builder.outputs.items():
            index = builder.index_of(label) + self.offset
            output_arrays = [
                array.write(index, t)
                for array, t in zip(output_arrays, tf.nest.flatten(outputs), strict=True)
            ]
            loss = builder.losses[label]
            self.loss_dtype = loss.dtype
            loss_array = loss_array.write(index, tf.cast(loss, tf.float32))
        return output_arrays + [loss_array]

    def read(self, arrays, microbatches, builder) -> None:
        output_arrays, loss_array = arrays[:-1], arrays[-1]
        for microbatch in microbatches:
            flat = [
                tf.ensure_shape(array.read(microbatch + self.offset), spec.shape)
                for array, spec in zip(output_arrays, self.specs, strict=True)
            ]
            builder.outputs[microbatch] = tf.nest.pack_sequence_as(self.structure, flat)
            loss = loss_array.read(microbatch + self.offset)
            builder.losses[microbatch] = tf.cast(loss, self.loss_dtype)


def new_stamp_arrays(actions, size: int, devices: list[str]) -> list:
    """Start and end TensorArrays of `size` for each of `actions`, on its stage's device."""
    arrays = []
    for action in actions:
        with tf.device(devices[action.stage]):
            arrays.append(
                (tf.TensorArray(tf.float64, size=size), tf.TensorArray(tf.float64, size=size))
            )
    return arrays


class _StampArrays:
    """When the step is traced for a timeline: each body action's start and end, by round."""

    def __init__(self, rolled: RolledSchedule, enabled: bool, devices: list[str]):
        self.rolled, self.devices = rolled, devices
        self.body = rolled.body if enabled else ()

    def new_arrays(self) -> list:
        return new_stamp_arrays(self.body, self.rolled.rounds, self.devices)

    def write(self, arrays, builder, round_index) -> list:
        written = []
        for action, (starts, ends) in zip(self.body, arrays, strict=True):
            start, end = builder.stamps.pop(action)
            written.append((starts.write(round_index, start), ends.write(round_index, end)))
        return written

    def read(self, arrays, builder) -> None:
        for action, (starts, ends) in zip(self.body, arrays, strict=True):
            for round_index in self.rolled.rounds_run(action):
                microbatch = self.rolled.microbatch_in_round(action.microbatch, round_index)
                builder.stamps[Action(action.kind, action.stage, microbatch)] = (
                    starts.read(round_index),
                    ends.read(round_index),
                )
