"""Actions a rolled loop runs in some rounds only: each inside a `tf.cond`.

A guarded roll (`tfmulti.pipeline.round_loop.guard_roll`) runs the warm-up and cool-down in
the loop too: round r skips each body action whose micro-batch lies outside the step's.
Skipping must leave the loop's state the shape a run would: every value the action would
add or change comes out of the `tf.cond`, as the action made it or, when skipped, as it was
(or zeros for a new one). Values it would consume are dropped either way: a skipped action
consumes only values of skipped micro-batches.

The loop therefore starts from what a prologue would leave, on micro-batches before the
first, as empty stashes and zero gradients (`zero_start_state`); no action that runs ever
reads them.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.pipeline.actions import Action
from tfmulti.pipeline.round_loop import CARRY, GRADIENT, STASH
from tfmulti.pipeline.runtime.tensor_packing import empty_packing


def zero_start_state(in_flight, traced_stages, stage_device_names) -> dict:
    """A `carried_state` of zeros (without gates) for the values `in_flight`, each a
    (kind, stage, label) as `tfmulti.pipeline.round_loop.in_flight_after` names them, each on
    its stage's device (where the loop then keeps it)."""
    last = len(traced_stages) - 1
    state = {"stash": {}, "gradient": {}, "carry": {}}
    for kind, stage, label in sorted(in_flight):
        with tf.device(stage_device_names[stage]):
            _add_zeros(state, kind, stage, label, traced_stages[stage], stage == last)
    return state


def _add_zeros(state, kind, stage, label, traced, last: bool) -> None:
    if kind == STASH:  # packed, as the loop carries stashes and carries: empty lists
        state["stash"][(stage, label)] = _empty_packing(traced.stash_specs(last))
    elif kind == GRADIENT:
        state["gradient"][(stage, label)] = _zeros(traced.input_gradient_specs)
    elif kind == CARRY:
        state["carry"][(stage, label)] = _empty_packing(traced.carry_part_specs())


def _empty_packing(part_specs: dict) -> dict:
    return empty_packing({spec.dtype for specs in part_specs.values() for spec in specs})


def _zeros(specs) -> list[tf.Tensor]:
    return [tf.zeros(spec.shape, spec.dtype) for spec in specs]


def build_guarded(builder, action: Action, runs: tf.Tensor, traced_stages) -> None:
    """Builds `action` with `builder` to run only when `runs` (a scalar bool) is true."""
    before = builder.snapshot()
    made = {}

    def run_action() -> dict:
        builder.restore_snapshot(before, traced_stages)
        # The device's gate enters the branch as data: TensorFlow lowers a cond's control
        # inputs onto its predicate only, so ops that wait on an outside tensor by control
        # would start as soon as their data is ready, out of the device's order.
        device = builder.executor.device_of_stage[action.stage]
        builder.device_gate[device] = [tf.identity(t) for t in builder.device_gate[device]]
        builder.build(action)
        after = builder.snapshot()
        made["removed"] = [key for key in before if key not in after]
        made["changed"] = {
            key: value
            for key, value in after.items()
            if key not in before or not _same(value, before[key])
        }
        return made["changed"]

    def skip_action() -> dict:
        # Traced after `run_action` (tf.cond traces the true branch first).
        zeros = _Zeros()
        return {
            key: before[key] if key in before else zeros.like(value, builder.variables, key)
            for key, value in made["changed"].items()
        }

    changed = tf.cond(runs, run_action, skip_action)
    after = {key: value for key, value in before.items() if key not in made["removed"]}
    after.update(changed)
    builder.restore_snapshot(after, traced_stages)


def _same(first, second) -> bool:
    flat_first = tf.nest.flatten(first, expand_composites=True)
    flat_second = tf.nest.flatten(second, expand_composites=True)
    return len(flat_first) == len(flat_second) and all(
        a is b for a, b in zip(flat_first, flat_second, strict=True)
    )


def _empty_like(packed: dict) -> dict:
    """Empty lists in place of the lists of `packed` (keyed by dtype names)."""
    return empty_packing(tf.as_dtype(name) for name in packed)


class _Zeros:
    """Zeros shaped like the values a skipped action leaves, one tensor per shape and
    dtype (a stage's residuals share a few shapes); a sparse gradient sum as a slice of
    no rows, so it adds nothing."""

    def __init__(self):
        self.made = {}

    def like(self, value, variables: dict, key):
        def zeros(leaf):
            if isinstance(leaf, tf.IndexedSlices):
                shape = variables[key[1]].shape
                return tf.IndexedSlices(
                    self.tensor([0, *leaf.values.shape[1:]], leaf.values.dtype),
                    self.tensor([0], leaf.indices.dtype),
                    tf.constant(list(shape), leaf.dense_shape.dtype),
                )
            return self.tensor(leaf.shape, leaf.dtype)

        if key[0] in ("stash", "carry"):  # packed lists: empty ones
            return _empty_like(value)
        return tf.nest.map_structure(zeros, value)

    def tensor(self, shape, dtype) -> tf.Tensor:
        key = (tuple(shape), dtype)
        if key not in self.made:
            self.made[key] = tf.zeros(shape, dtype)
        return self.made[key]
