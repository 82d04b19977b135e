"""A schedule's steady state as one loop: a prologue, R rounds of one body, an epilogue.

Pure Python. In their steady state the schedules repeat: every `stride` micro-batches each
device runs the same actions again, on micro-batches `stride` further on (1F1B: one F and
one B per round; ZB-H1: F, I and W). `roll_schedule` finds that repetition, so the
executor can trace the body once and run it in a loop instead of tracing every action of
every micro-batch: the traced step then does not grow with m.

`guard_roll` extends such a loop over the whole schedule: rounds before and after the steady
state run the same body, skipping actions on micro-batches outside the step's, so the step
traces one body whatever m and p; `loop_schedule` picks what the executor runs.

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
from tfmulti.pipeline.schedules import SCHEDULE_NAMES, build_schedule

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
        guarded: the loop also runs the warm-up and cool-down (`guard_roll`): prologue and
            epilogue are empty, and a round skips each body action whose micro-batch is
            outside the schedule's.
        first_round: for a guarded roll, the round of the steady loop that the first round
            runs (<= 0): round r runs each body action with `microbatch + (r + first_round)
            * stride`.
        start_in_flight: for a guarded roll, the values in flight before round 0, labelled
            as the body labels them; all are on micro-batches before the first, so the loop
            starts them as zeros.
    """

    schedule: Schedule
    prologue: tuple[Action, ...]
    body: tuple[Action, ...]
    rounds: int
    stride: int
    epilogue: tuple[Action, ...]
    guarded: bool = False
    first_round: int = 0
    start_in_flight: frozenset = frozenset()

    def microbatch_in_round(self, label, round_index):
        """The micro-batch that body label `label` stands for in round `round_index` (in a
        guarded roll, possibly outside the schedule's); ints or tensors."""
        return label + (round_index + self.first_round) * self.stride

    def round_actions(self, round_index: int) -> list[Action]:
        """The body's actions as round `round_index` runs them (without skipped ones)."""
        return [
            Action(action.kind, action.stage, microbatch)
            for action in self.body
            if 0
            <= (microbatch := self.microbatch_in_round(action.microbatch, round_index))
            < self.schedule.num_microbatches
        ]

    def rounds_run(self, action: Action) -> range:
        """The rounds in which body `action` runs (every round unless guarded)."""
        first = -((action.microbatch + self.first_round * self.stride) // self.stride)
        last = (self.schedule.num_microbatches - 1 - action.microbatch) // self.stride
        last -= self.first_round
        return range(max(first, 0), min(last, self.rounds - 1) + 1)

    def unrolled(self) -> list[Action]:
        """Every action in the order the rolled step runs them."""
        looped = [a for r in range(self.rounds) for a in self.round_actions(r)]
        return list(self.prologue) + looped + list(self.epilogue)

    @property
    def traced_actions(self) -> int:
        """Actions a rolled step traces: prologue, body once, epilogue."""
        return len(self.prologue) + len(self.body) + len(self.epilogue)


def loop_schedule(schedule: Schedule) -> RolledSchedule | None:
    """The loop a step runs `schedule` as: guarded (`guard_roll`, the whole schedule in
    one loop) where that checks out and traces fewer actions than the schedule has, else
    its steady state (`roll_schedule`), else None.

    Example:
        >>> rolled = loop_schedule(one_f_one_b(4, 32))
        >>> rolled.guarded, rolled.traced_actions, rolled.rounds
        (True, 8, 36)
    """
    steady = roll_schedule(schedule, min_rounds=1)
    guarded = guard_roll(steady) if steady else _guard_from_longer(schedule)
    if guarded and guarded.traced_actions < sum(map(len, schedule.device_actions)):
        return guarded
    return roll_schedule(schedule)


def _guard_from_longer(schedule: Schedule) -> RolledSchedule | None:
    """A guarded loop of `schedule` found on the same schedule with more micro-batches:
    with m <= p, 1F1B has no steady state of its own, but each device's order is the
    longer schedule's with the extra micro-batches left out."""
    if schedule.name not in SCHEDULE_NAMES:
        return None
    chunks = schedule.num_stages // schedule.num_devices
    longer_m = schedule.num_microbatches + 2 * schedule.num_stages
    try:
        longer = build_schedule(
            schedule.name, schedule.num_devices, longer_m, chunks=chunks if chunks > 1 else None
        )
    except ValueError:
        return None
    steady = roll_schedule(longer, min_rounds=1)
    return steady and guard_roll(dataclasses.replace(steady, schedule=schedule))


def guard_roll(rolled: RolledSchedule) -> RolledSchedule | None:
    """`rolled`'s loop run over the whole schedule, warm-up and cool-down included, or None.

    The body runs from the first round in which one of its actions reaches micro-batch 0
    to the last in which one reaches the last micro-batch; actions outside the schedule's
    micro-batches are skipped. That gives each device's order back only for some
    schedules (1F1B: device s runs F(r) and B(r - (p - 1 - s)), so its warm-up forwards
    are the rounds whose B is skipped), so the result is checked like a roll: every action
    once, each device's order, every read finds its value, and what is in flight before
    and after the loop lies wholly outside the micro-batches.
    """
    schedule, stride = rolled.schedule, rolled.stride
    m = schedule.num_microbatches
    first = min(-(action.microbatch // stride) for action in rolled.body)
    last = max((m - 1 - action.microbatch) // stride for action in rolled.body)
    before_loop = in_flight_after(rolled.prologue, set(), schedule.num_stages)
    guarded = dataclasses.replace(
        rolled,
        prologue=(),
        epilogue=(),
        rounds=last - first + 1,
        guarded=True,
        first_round=first,
        start_in_flight=frozenset(before_loop),
    )
    start = relabeled(before_loop, first * stride)
    end = relabeled(before_loop, (first + guarded.rounds) * stride)
    outside = lambda values: all(not 0 <= mb < m for _, _, mb in values)  # noqa: E731
    order = guarded.unrolled()
    checks = (
        outside(start)
        and outside(end)
        and sorted(order) == sorted(a for actions in schedule.device_actions for a in actions)
        and _keeps_device_order(guarded)
        and in_flight_after(order, set(), schedule.num_stages) == set()
    )
    return guarded if checks else None


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
