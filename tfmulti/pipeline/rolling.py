"""A schedule's steady state as one loop: a prologue, R rounds of one body, an epilogue.

Pure Python. In their steady state the schedules repeat: every `stride` micro-batches each
device runs the same actions again, on micro-batches `stride` further on (1F1B: one F and
one B per round; ZB-H1: F, I and W). `roll_schedule` finds that repetition, so the
executor can trace the body once and run it in a loop instead of tracing every action of
every micro-batch: the traced step then does not grow with m.

Rounds are found on the schedule run with unit durations (each action one tick): a tick
range where every device's actions repeat `stride` micro-batches later after `period`
ticks. A roll is only returned once checked: the values in flight between actions
(stashed activations, gradients on their way to the previous stage, I's results waiting for
W) must be the same set, shifted by `stride`, at the start of every round, so the loop's
carried state has one shape; and each device's order must stay the schedule's.
"""

from __future__ import annotations

import collections
import dataclasses

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)
from tfmulti.pipeline.dependencies import run_in_order

STASH, GRADIENT, CARRY = "stash", "gradient", "carry"


@dataclasses.dataclass(frozen=True)
class RolledSchedule:
    """A schedule as `prologue`, then `rounds` runs of `body`, then `epilogue`.

    Args:
        schedule: the schedule this rolls.
        prologue: actions before the loop, in an order that respects each device's order
            and every data dependency.
        body: the actions of round 0; round r runs each with `microbatch + r * stride`.
        rounds: how many times the body runs (R >= 2).
        stride: micro-batches each round moves on.
        epilogue: actions after the loop.
    """

    schedule: Schedule
    prologue: tuple[Action, ...]
    body: tuple[Action, ...]
    rounds: int
    stride: int
    epilogue: tuple[Action, ...]

    def round_actions(self, round_index: int) -> list[Action]:
        """The body's actions as round `round_index` runs them."""
        shift = round_index * self.stride
        return [shifted(action, shift) for action in self.body]

    def unrolled(self) -> list[Action]:
        """Every action in the order the rolled step runs them."""
        looped = [a for r in range(self.rounds) for a in self.round_actions(r)]
        return list(self.prologue) + looped + list(self.epilogue)

    @property
    def traced_actions(self) -> int:
        """Actions a rolled step traces: prologue, body once, epilogue."""
        return len(self.prologue) + len(self.body) + len(self.epilogue)


def shifted(action: Action, microbatches: int) -> Action:
    """`action` on the micro-batch `microbatches` further on."""
    return Action(action.kind, action.stage, action.microbatch + microbatches)


def roll_schedule(schedule: Schedule, min_rounds: int = 2) -> RolledSchedule | None:
    """The schedule's steady state as a loop, or None when it has none of `min_rounds`.

    Tries every stride up to the number of stages; keeps the checked roll that leaves
    the fewest actions to trace.
    """
    records, stuck = run_in_order(schedule, lambda action: 1.0, lambda producer, consumer: 0.0)
    if any(action is not None for action in stuck):
        return None
    ticks = collections.defaultdict(list)
    for record in records:
        ticks[int(record.start)].append(record.action)
    rows = [tuple(sorted(ticks.get(t, ()))) for t in range(max(ticks) + 1)] if ticks else []
    per_microbatch = max(len(actions) for actions in schedule.device_actions)
    per_microbatch //= max(schedule.num_microbatches, 1)
    best = None
    for stride in range(1, schedule.num_stages + 1):
        period = stride * per_microbatch
        for start, rounds in _periodic_runs(rows, period, stride):
            if rounds < min_rounds:
                continue
            candidate = _candidate(schedule, rows, start, period, stride, rounds)
            if candidate is None:
                continue
            if best is None or candidate.traced_actions < best.traced_actions:
                best = candidate
    return best


def _periodic_runs(rows: list, period: int, stride: int) -> list[tuple[int, int]]:
    """(first tick, rounds) of each longest range of ticks that repeats every `period`
    ticks `stride` micro-batches on, tried from each phase within a period."""
    repeats = [
        t + period < len(rows)
        and bool(rows[t])
        and rows[t + period] == tuple(shifted(a, stride) for a in rows[t])
        for t in range(len(rows))
    ]
    runs = []
    t = 0
    while t < len(rows):
        if not repeats[t]:
            t += 1
            continue
        end = t
        while end < len(rows) and repeats[end]:
            end += 1
        # Ticks [t, end) each equal the tick a period later: rounds start at t + k.
        for phase in range(min(period, end - t)):
            rounds = (end - t - phase) // period + 1
            runs.append((t + phase, rounds))
        t = end
    return runs


def _candidate(
    schedule: Schedule, rows: list, start: int, period: int, stride: int, rounds: int
) -> RolledSchedule | None:
    end = start + rounds * period
    flatten = lambda tick_rows: [action for row in tick_rows for action in row]  # noqa: E731
    rolled = RolledSchedule(
        schedule=schedule,
        prologue=tuple(flatten(rows[:start])),
        body=tuple(flatten(rows[start : start + period])),
        rounds=rounds,
        stride=stride,
        epilogue=tuple(flatten(rows[end:])),
    )
    return rolled if _carries_one_shape(rolled) and _keeps_device_order(rolled) else None


def _keeps_device_order(rolled: RolledSchedule) -> bool:
    schedule = rolled.schedule
    device_of = schedule.stage_devices
    order = collections.defaultdict(list)
    for action in rolled.unrolled():
        order[device_of[action.stage]].append(action)
    return all(
        tuple(order[device]) == actions for device, actions in enumerate(schedule.device_actions)
    )


def in_flight_after(actions, in_flight: set, num_stages: int) -> set | None:
    """The values in flight after `actions` run from `in_flight`, or None if one reads a
    value that is not there.

    Values are (kind, stage, microbatch): F leaves its stage's stash (read by the next
    stage's F, taken by B or W); B or I of a stage after the first leaves a gradient for the
    previous stage, which takes it; I leaves a carry for W.
    """
    in_flight = set(in_flight)
    last = num_stages - 1

    def take(key, keep=False) -> bool:
        if key not in in_flight:
            return False
        if not keep:
            in_flight.remove(key)
        return True

    for action in actions:
        stage, microbatch = action.stage, action.microbatch
        if action.kind == FORWARD:
            if stage > 0 and not take((STASH, stage - 1, microbatch), keep=True):
                return None
            in_flight.add((STASH, stage, microbatch))
            continue
        if action.kind in (BACKWARD, INPUT_GRAD):
            own = take((STASH, stage, microbatch), keep=action.kind == INPUT_GRAD)
            arriving = stage == last or take((GRADIENT, stage + 1, microbatch))
            if not (own and arriving):
                return None
            if stage > 0:
                in_flight.add((GRADIENT, stage, microbatch))
            if action.kind == INPUT_GRAD:
                in_flight.add((CARRY, stage, microbatch))
            continue
        if action.kind == WEIGHT_GRAD:
            if not (take((STASH, stage, microbatch)) and take((CARRY, stage, microbatch))):
                return None
    return in_flight


def relabeled(in_flight: set, microbatches: int) -> set:
    """`in_flight` with every value's micro-batch moved by `microbatches`."""
    return {(kind, stage, microbatch + microbatches) for kind, stage, microbatch in in_flight}


def _carries_one_shape(rolled: RolledSchedule) -> bool:
    num_stages = rolled.schedule.num_stages
    before_loop = in_flight_after(rolled.prologue, set(), num_stages)
    if before_loop is None:
        return False
    after_body = in_flight_after(rolled.body, before_loop, num_stages)
    if after_body is None or relabeled(after_body, -rolled.stride) != before_loop:
        return False
    after_loop = relabeled(before_loop, rolled.rounds * rolled.stride)
    return in_flight_after(rolled.epilogue, after_loop, num_stages) == set()


def is_fill_drain(schedule: Schedule) -> bool:
    """Whether every device runs all its forwards, then all its backwards, in micro-batch
    order, on one stage of its own (GPipe): such a step runs as two loops, one per phase,
    though what is in flight grows each round and so no single loop rolls it.

    Example:
        >>> is_fill_drain(gpipe(4, 8)), is_fill_drain(one_f_one_b(4, 8))
        (True, False)
    """
    m = schedule.num_microbatches
    if m < 2 or schedule.num_stages != schedule.num_devices:
        return False
    for device, actions in enumerate(schedule.device_actions):
        stages = [stage for stage, owner in enumerate(schedule.stage_devices) if owner == device]
        if len(stages) != 1:
            return False
        expected = [Action(FORWARD, stages[0], index) for index in range(m)]
        expected += [Action(BACKWARD, stages[0], index) for index in range(m)]
        if list(actions) != expected:
            return False
    return True
