"""Runs one pipeline schedule inside a traced TensorFlow function.

Each action becomes a group of ops under `tf.device(stage device)`. Per device, every
action's ops wait (control dependencies) for the previous action's results, as on a GPU
stream, so the device runs the actions in the schedule's order; across devices, only data
(activations forward, gradients backward) orders them.

Every action calls one of its stage's traced functions (`stage_functions.py`): F returns
the stage outputs and the residuals its backward reads; B (or I then W, for a split
backward) is the stage's vector-Jacobian product, weighted by the gradient arriving from
the next stage. The functions are traced once per stage and input signature, so the step's
graph grows by one call per action, not by a copy of the stage. The last stage's loss is
computed per micro-batch outside the functions; its gradient starts that stage's backward.
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
from tfmulti.pipeline.overlapped_pairs import pair_partners
from tfmulti.pipeline.round_loop import is_fill_drain, loop_schedule
from tfmulti.pipeline.runtime.fill_drain_step import run_phased
from tfmulti.pipeline.runtime.round_loop_step import run_rolled
from tfmulti.pipeline.runtime.stage_functions import (
    StageFunctions,
    gather_feeds,
    is_differentiable,
)
from tfmulti.pipeline.runtime.tensor_packing import PackedParts


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
    stamp = tf.numpy_function(_now, tokens, tf.float64, stateful=False)
    stamp.set_shape([])
    return stamp


def add_gradients(first, second):
    """Sums two gradients; sparse ones (e.g. of embeddings) stay sparse by concatenation."""
    if isinstance(first, tf.IndexedSlices) and isinstance(second, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([first.values, second.values], axis=0),
            tf.concat([first.indices, second.indices], axis=0),
            first.dense_shape,
        )
    return tf.convert_to_tensor(first) + tf.convert_to_tensor(second)


def _when_ready(produced: list, calls: list) -> list:
    """A gate the next action waits on (by control) that opens once `produced` hold data
    and the stage-function `calls` that made them have run their stateful ops.

    Waiting on a stage function's outputs by control waits on its call op; TensorFlow
    inlines the call and keeps for that edge only the function's stateful ops, so the next
    action could start before this one's stateless work (most of it) is done. An IdentityN
    of the outputs is an op that runs only once they are computed; its control edge from
    the calls keeps stateful ops (a dropout's seed update) in the device's order, which a
    loop round no longer enforces (`unbarriered_loop`)."""
    if not produced:
        return []
    with tf.control_dependencies(calls):
        return [tf.identity_n(produced)[0]]


def _tensor_part(gradient) -> tf.Tensor:
    """A tensor that is ready when `gradient` is, for control dependencies and timestamps."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _tensors(nest) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(nest) if isinstance(t, tf.Tensor)]


class ScheduleExecutor:
    """Builds the ops of a whole pipeline step, one action at a time.

    Args:
        stages: one callable Keras layer per stage.
        stage_device_names: the device name of each stage.
        schedule: the schedule to run.
        remat: per stage, whether its backward replays the forward instead of keeping the
            forward's intermediate tensors.
        rolled: run the schedule as a loop of rounds (`loop_schedule`: the whole schedule,
            or its steady state), so the traced step does not grow with micro-batches;
            None or True: whenever the schedule has one and the micro-batches are equal,
            False: never.
    """

    def __init__(
        self,
        stages: Sequence,
        stage_device_names: Sequence[str],
        schedule: Schedule,
        remat: Sequence[bool],
        rolled: bool | None = None,
    ):
        self.stages = list(stages)
        self.stage_device_names = list(stage_device_names)
        self.schedule = schedule
        self.remat = list(remat)
        self.order = execution_order(schedule)
        self.device_of_stage = list(schedule.stage_devices)
        self.stage_functions = [
            StageFunctions(stage, index > 0, self.remat[index])
            for index, stage in enumerate(self.stages)
        ]
        self.rolled = loop_schedule(schedule) if rolled is not False else None
        # GPipe: no loop rolls it, but its two phases each run as one (`phased_step`).
        self.fill_drain = rolled is not False and is_fill_drain(schedule)

    def set_jit_compile(self, jit_compile: bool) -> None:
        """Compiles every stage's functions with XLA, each for its own device (or stops)."""
        for functions in self.stage_functions:
            functions.set_jit_compile(jit_compile)

    def run(
        self,
        microbatch_inputs: Sequence,
        loss_fn: Callable[[int, object], tuple[tf.Tensor, tf.Tensor]],
        trace: bool = False,
    ) -> StepResult:
        """Traces the schedule on `microbatch_inputs`.

        Args:
            microbatch_inputs: one input nest per micro-batch; a `MicrobatchParts` of
                equal parts also takes a tensor index, which lets a rolled schedule run its
                steady state as a loop.
            loss_fn: `(microbatch, outputs) -> (loss, differentiated_loss)`; the second is
                what the backward differentiates (e.g. loss / m, times a loss scale).
                `microbatch` is an int, or an int32 tensor inside a rolled loop.
            trace: also return start and end timestamps of every action.
        """
        run = _StepBuilder(self, microbatch_inputs, loss_fn, trace)
        loops = self.rolled is not None or self.fill_drain
        if loops and getattr(microbatch_inputs, "equal", False):
            traced_stages = self.traced_stages(microbatch_inputs[0])
            if traced_stages is not None and self.rolled is not None:
                return run_rolled(run, self.rolled, traced_stages)
            if traced_stages is not None:  # a fill-drain schedule: GPipe's two loops
                return run_phased(run, traced_stages)
        run.build_all(self.order, pair_partners(self.schedule))
        return run.result()

    def traced_stages(self, first_inputs) -> list | None:
        """Each stage's `TracedStage` for micro-batches like `first_inputs`, traced in
        stage order (each stage's inputs are the previous stage's outputs); None when a
        stage's output shape is not fully known before it runs."""
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(first_inputs)]
        specs, structure = [tf.TensorSpec(t.shape, t.dtype) for t in flat], first_inputs
        traced_stages = []
        for functions in self.stage_functions:
            if not all(spec.shape.is_fully_defined() for spec in specs):
                return None
            traced = functions.for_specs(specs, structure)
            traced_stages.append(traced)
            specs, structure = traced.output_specs()
        return traced_stages


class _StepBuilder:
    """The state of one traced step: stashed residuals, gradients in flight, device gates.

    Actions name micro-batches by labels; `index_of(label)` is the micro-batch a label
    stands for (the label itself, or label + round * stride inside a rolled loop's body).
    """

    def __init__(self, executor: ScheduleExecutor, microbatch_inputs, loss_fn, trace: bool):
        self.executor = executor
        self.inputs = microbatch_inputs
        self.loss_fn = loss_fn
        self.trace = trace
        self.index_of = lambda label: label
        self.last_stage = len(executor.stages) - 1
        self.activations = {}  # (stage, microbatch) -> _Stash
        self.input_grads = {}  # (stage, microbatch) -> gradients w.r.t. flat stage inputs
        self.carried = {}  # (stage, microbatch) -> what I computed for W
        self.device_gate = {}  # device -> tensors the next action on it must wait for
        self.accumulated = {}  # variable id -> gradient sum
        self.variables = {}  # variable id -> variable, in first-seen order
        self.outputs = {}  # microbatch -> last-stage outputs
        self.losses = {}  # microbatch -> loss
        self.stamps = {}
        self._waits_for = []  # what the action being built waits for (`_in_order`)
        self._calls = []  # the stage-function calls of the action being built

    def build(self, action: Action, pair_gate: list | None = None) -> None:
        """Builds `action` after the device's previous action; with `pair_gate` (what the
        previous action itself waited for), as the second of an overlapped pair: it
        waits for that instead, so both run at once, and the next action waits for both."""
        device = self.executor.device_of_stage[action.stage]
        previous = self.device_gate.get(device, [])
        gate, first_done = (previous, []) if pair_gate is None else (list(pair_gate), previous)
        arriving = self._arriving_tensors(action)
        with tf.device(self.executor.stage_device_names[action.stage]):
            start = None
            if self.trace:
                start = _timestamp(list(gate) + arriving)
                gate = [start]
            self._waits_for, self._calls = gate, []
            if action.kind == FORWARD:
                produced = self._forward(action)
            elif action.kind == WEIGHT_GRAD:
                produced = self._weight_grad(action)
            else:
                produced = self._backward(action, split=action.kind == INPUT_GRAD)
            if self.trace:
                end = _timestamp(produced or [start])
                self.stamps[action] = (start, end)
                produced = [end]
            self.device_gate[device] = (_when_ready(produced, self._calls) or gate) + first_done

    def pairing(self, partners: dict[Action, Action]) -> PairGates:
        """A fresh `PairGates` for building actions with this builder."""
        return PairGates(self, partners)

    def build_all(self, actions: Sequence[Action], partners: dict[Action, Action]) -> None:
        """Builds `actions` in order; an action `partners` maps to the device's previous
        action runs overlapped with it (`tfmulti.pipeline.overlapped_pairs`)."""
        pairing = self.pairing(partners)
        for action in actions:
            self.build(action, pairing.gate_for(action))

    def _in_order(self, stage_function, args: list):
        """Calls `stage_function` once the device's previous action is done.

        The control edge must be on the call itself: inside a `tf.control_dependencies`
        block, TensorFlow leaves it off ops with an input made in the block (unpacking a
        stash), keeping it only on the constants those read, and such a path did not hold
        the call back at run time."""
        with tf.control_dependencies(self._waits_for):
            results = stage_function(*args)
        self._calls.extend(dict.fromkeys(t.op for t in tf.nest.flatten(results)))
        return results

    def _stage_inputs(self, stage: int, microbatch: int):
        if stage == 0:
            return self.inputs[self.index_of(microbatch)]
        return self.activations[(stage - 1, microbatch)].outputs

    def _arriving_tensors(self, action: Action) -> list:
        stage, microbatch = action.stage, action.microbatch
        if action.kind == FORWARD:
            return _tensors(self._stage_inputs(stage, microbatch))
        if action.kind in (BACKWARD, INPUT_GRAD) and stage < self.last_stage:
            return list(self.input_grads[(stage + 1, microbatch)])
        return []

    def _forward(self, action: Action) -> list:
        stage, microbatch = action.stage, action.microbatch
        stage_inputs = self._stage_inputs(stage, microbatch)
        # One copy on this stage's device (the caller's device scope), read by the forward
        # now and by the backward later: each arrives once. Passed as it came, the backward's
        # inlined input Identity sat on the sending device and the tensor crossed again.
        flat_inputs = [tf.identity(t) for t in tf.nest.flatten(stage_inputs)]
        traced = self.executor.stage_functions[stage].for_inputs(flat_inputs, stage_inputs)
        results = self._in_order(traced.forward, flat_inputs)
        outputs = tf.nest.pack_sequence_as(traced.output_structure, results[: traced.num_outputs])
        residuals = list(results[traced.num_outputs :])
        last = stage == self.last_stage
        stash = _Stash(traced, last, (flat_inputs, residuals, tf.nest.flatten(outputs), []))
        self.activations[(stage, microbatch)] = stash
        produced = _tensors(outputs)
        if stage == self.last_stage:
            # The loss and its gradient are computed with the forward: the backward may run
            # in a later round of a rolled loop, which carries tensors, not tapes.
            differentiable = [t for t in _tensors(outputs) if is_differentiable(t)]
            with tf.GradientTape() as loss_tape:
                loss_tape.watch(differentiable)
                loss, differentiated = self.loss_fn(self.index_of(microbatch), outputs)
            stash.output_grads = loss_tape.gradient(
                differentiated, differentiable, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            self.outputs[microbatch] = outputs
            self.losses[microbatch] = loss
            produced.append(differentiated)
        return produced

    def _output_grads(self, stage: int, microbatch: int, stash: _Stash) -> list:
        if stage < self.last_stage:
            return self.input_grads.pop((stage + 1, microbatch))
        return stash.output_grads

    def _backward(self, action: Action, split: bool) -> list:
        key = (action.stage, action.microbatch)
        stash = self.activations[key]
        traced = stash.traced
        sources = {
            "input": stash.inputs,
            "residual": stash.residuals,
            "output_grad": list(self._output_grads(*key, stash)),
        }
        if split:
            results = self._in_order(
                traced.input_grad, gather_feeds(traced.input_grad_feeds, sources)
            )
            input_grads = results[: traced.num_input_grads]
            self._hand_back(key, input_grads)
            # W reads the inputs and residuals from the stash, which stays until W.
            carry = {"output_grad": sources["output_grad"]}
            carry["carry"] = list(results[traced.num_input_grads :])
            self.carried[key] = PackedParts(traced.carry_part_specs(), carry)
            return list(input_grads)
        results = self._in_order(traced.backward, gather_feeds(traced.backward_feeds, sources))
        del self.activations[key]
        sums = self._accumulate(
            traced.weights, traced.weight_gradients(results[traced.num_input_grads :])
        )
        # A whole backward hands its input gradient on when its sums are done, as planned.
        with tf.control_dependencies(sums):
            input_grads = [tf.identity(g) for g in results[: traced.num_input_grads]]
        self._hand_back(key, input_grads)
        return input_grads + sums

    def _hand_back(self, key: tuple[int, int], input_grads) -> None:
        """Keeps a stage's input gradients for the previous stage (the first has none)."""
        if key[0] > 0:
            self.input_grads[key] = list(input_grads)

    def _weight_grad(self, action: Action) -> list:
        key = (action.stage, action.microbatch)
        stash = self.activations.pop(key)
        traced = stash.traced
        sources = {"input": stash.inputs, "residual": stash.residuals}
        sources.update(self.carried.pop(key).parts())
        results = self._in_order(
            traced.weight_grad, gather_feeds(traced.weight_grad_feeds, sources)
        )
        return self._accumulate(traced.weights, traced.weight_gradients(results))

    def _accumulate(self, weights, weight_grads) -> list:
        sums = []
        for variable, gradient in zip(weights, weight_grads, strict=True):
            key = id(variable)
            self.variables.setdefault(key, variable)
            total = self.accumulated.get(key)
            self.accumulated[key] = gradient if total is None else add_gradients(total, gradient)
            sums.append(_tensor_part(self.accumulated[key]))
        return sums

    def carried_state(self, shift: int = 0, packed: bool = True) -> dict:
        """What is in flight between actions, as a nest of tensors keyed by (stage, label),
        each label moved by `shift`; each device's gate becomes one token tensor. Stashes
        and carries are packed (`PackedParts.packed`) unless `packed` is False (then a
        tuple of their parts)."""
        tokens = {device: self._gate_token(device) for device in self._devices()}
        executor = self.executor
        stashes, carries = {}, {}
        for kept, held in ((stashes, self.activations), (carries, self.carried)):
            for (stage, label), value in held.items():
                value = value.held if isinstance(value, _Stash) else value
                with tf.device(executor.stage_device_names[stage]):
                    kept[(stage, label + shift)] = (
                        value.packed() if packed else tuple(value.parts().values())
                    )
        return {
            "stash": stashes,
            "gradient": {
                (stage, label + shift): list(grads)
                for (stage, label), grads in self.input_grads.items()
            },
            "carry": carries,
            "gates": tokens,
        }

    def _devices(self) -> dict:
        """Each device, with the name of its first stage's device."""
        devices = {}
        for stage, device in enumerate(self.executor.device_of_stage):
            devices.setdefault(device, self.executor.stage_device_names[stage])
        return devices

    def _gate_token(self, device) -> tf.Tensor:
        """One scalar that is ready when everything the device's next action waits for is."""
        gate = self.device_gate.get(device, [])
        if len(gate) == 1 and gate[0].shape.rank == 0 and gate[0].dtype == tf.float32:
            return gate[0]
        with tf.device(self._devices()[device]), tf.control_dependencies(gate):
            return tf.zeros([], tf.float32)

    def snapshot(self) -> dict:
        """Every value the step holds between actions, by key: the `carried_state`, and the
        gradient sums, last-stage outputs and losses, and timeline stamps made so far."""
        state = self.carried_state()
        flat = {}
        for kind in ("stash", "gradient", "carry"):
            flat.update({(kind, *key): value for key, value in state[kind].items()})
        flat.update({("gate", device): token for device, token in state["gates"].items()})
        flat.update({("sum", key): total for key, total in self.accumulated.items()})
        flat.update({("output", label): value for label, value in self.outputs.items()})
        flat.update({("loss", label): value for label, value in self.losses.items()})
        flat.update({("stamp", action): value for action, value in self.stamps.items()})
        return flat

    def restore_snapshot(self, flat: dict, traced_stages: Sequence) -> None:
        """Takes back a `snapshot`."""
        state = {"stash": {}, "gradient": {}, "carry": {}, "gates": {}}
        named = {"sum": {}, "output": {}, "loss": {}, "stamp": {}}
        for (kind, *key), value in flat.items():
            if kind == "gate":
                state["gates"][key[0]] = value
            elif kind in named:
                named[kind][key[0]] = value
            else:
                state[kind][tuple(key)] = value
        self.restore_state(state, traced_stages)
        self.accumulated = named["sum"]
        self.outputs, self.losses, self.stamps = named["output"], named["loss"], named["stamp"]

    def restore_state(self, state: dict, traced_stages: Sequence, shift: int = 0) -> None:
        """Takes back a `carried_state` (labels moved by `shift`), e.g. a loop's variables."""
        self.activations, self.carried = {}, {}
        last = len(traced_stages) - 1
        for (stage, label), stash in state["stash"].items():
            form = {"packed": dict(stash)} if isinstance(stash, dict) else {"parts": stash}
            stash = _Stash(traced_stages[stage], stage == last, **form)
            self.activations[(stage, label + shift)] = stash
        self.input_grads = {
            (stage, label + shift): list(grads)
            for (stage, label), grads in state["gradient"].items()
        }
        for (stage, label), carry in state["carry"].items():
            specs = traced_stages[stage].carry_part_specs()
            form = {"packed": dict(carry)} if isinstance(carry, dict) else {"parts": carry}
            if "parts" in form:
                form["parts"] = dict(zip(specs, carry, strict=True))
            self.carried[(stage, label + shift)] = PackedParts(specs, **form)
        self.device_gate = {device: [token] for device, token in state["gates"].items()}

    def result(self) -> StepResult:
        keys = list(self.variables)
        count = len(self.inputs)
        return StepResult(
            outputs=[self.outputs[index] for index in range(count)],
            losses=[self.losses[index] for index in range(count)],
            gradients=[self.accumulated[key] for key in keys],
            variables=[self.variables[key] for key in keys],
            stamps=self.stamps if self.trace else None,
        )


class _Stash:
    """What a stage's forward on one micro-batch leaves for its backward
    (`TracedStage.stash_specs`), held as tensors or packed as a loop carries it."""

    def __init__(self, traced, last_stage: bool, parts=None, packed: dict | None = None):
        self.traced = traced
        specs = traced.stash_specs(last_stage)
        if parts is not None and not isinstance(parts, dict):
            parts = dict(zip(specs, parts, strict=True))
        self.held = PackedParts(specs, parts, packed)

    @property
    def inputs(self) -> list:
        return self.held.part("inputs")

    @property
    def residuals(self) -> list:
        return self.held.part("residuals")

    @property
    def outputs(self):
        return tf.nest.pack_sequence_as(self.traced.output_structure, self.held.part("outputs"))

    @property
    def output_grads(self) -> list:
        return self.held.part("output_grads")

    @output_grads.setter
    def output_grads(self, gradients) -> None:
        self.held.replace("output_grads", gradients)


class PairGates:
    """Tracks, per device, the last action built and what it waited for, so the second
    action of an overlapped pair can wait for what the first waited for."""

    def __init__(self, builder: _StepBuilder, partners: dict[Action, Action]):
        self.builder = builder
        self.partners = partners
        self.last: dict[int, Action] = {}
        self.waited: dict[int, list] = {}

    def gate_for(self, action: Action) -> list | None:
        """Call before building `action`: the pair gate to build it with, or None."""
        device = self.builder.executor.device_of_stage[action.stage]
        first = self.partners.get(action)
        paired = first is not None and self.last.get(device) == first
        pair_gate = self.waited[device] if paired else None
        self.last[device] = action
        self.waited[device] = self.builder.device_gate.get(device, [])
        return pair_gate
