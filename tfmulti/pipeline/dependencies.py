"""Data dependencies between pipeline actions, and running per-device orders against them.

Pure Python. `validate` uses the runner with unit durations to find deadlocks; `simulate`
uses it with real costs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One action as it ran (or is planned to run) on a device.

    Args:
        device: device index.
        action: the action, or any object with `kind`, `stage`, `microbatch`.
        start: start time.
        end: end time.
    """

    device: int
    action: Action
    start: float
    end: float


class DependencyGraph:
    """Which actions each action of a schedule consumes (its device's order aside).

    F(s, m) needs F(s-1, m). B or I of (s, m) needs its own F and the input gradient of
    (s+1, m), which is that stage's B or, if it splits its backward, its I. W(s, m) needs
    I(s, m).

    Args:
        schedule: the schedule whose actions are looked up.
    """

    def __init__(self, schedule: Schedule):
        self.num_stages = schedule.num_stages
        self._split = {
            (a.stage, a.microbatch)
            for actions in schedule.device_actions
            for a in actions
            if a.kind == INPUT_GRAD
        }

    def gradient_action(self, stage: int, microbatch: int) -> Action:
        """The action producing the input gradient of (stage, microbatch): its B or its I."""
        kind = INPUT_GRAD if (stage, microbatch) in self._split else BACKWARD
        return Action(kind, stage, microbatch)

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The actions whose outputs `action` reads."""
        stage, microbatch = action.stage, action.microbatch
        if action.kind == FORWARD:
            return (Action(FORWARD, stage - 1, microbatch),) if stage > 0 else ()
        if action.kind == WEIGHT_GRAD:
            return (Action(INPUT_GRAD, stage, microbatch),)
        own_forward = Action(FORWARD, stage, microbatch)
        if stage + 1 < self.num_stages:
            return (own_forward, self.gradient_action(stage + 1, microbatch))
        return (own_forward,)


def run_in_order(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[Action, Action], float],
    pair_duration: Callable[[Action, Action], float] | None = None,
) -> tuple[list[TimedAction], list[Action | None]]:
    """Runs each device's actions in order, each as soon as its inputs have arrived.

    An overlapped F&B unit (`Schedule.overlapped_pairs`) starts once both of its actions
    have their inputs; its outputs leave when it ends. Its two records split its time in
    proportion to the actions' own durations.

    Args:
        schedule: the schedule to run.
        duration: time an action takes.
        transfer: delay between a dependency ending and its consumer being able to start.
        pair_duration: time an overlapped unit of two actions takes; defaults to the sum
            of their durations (no overlap).

    Returns:
        `(records, stuck)`: the timed actions that ran, and per device the action it is
        stuck at (None for devices that finished). Any non-None entry means deadlock.
    """
    graph = DependencyGraph(schedule)
    pair_starts = [set(schedule.pair_starts(d)) for d in range(schedule.num_devices)]
    next_index = [0] * schedule.num_devices
    device_free = [0.0] * schedule.num_devices
    end_time: dict[Action, float] = {}
    waiting_for: dict[Action, list[int]] = collections.defaultdict(list)
    records: list[TimedAction] = []
    runnable = collections.deque(range(schedule.num_devices))
    while runnable:
        device = runnable.popleft()
        actions = schedule.device_actions[device]
        while next_index[device] < len(actions):
            index = next_index[device]
            unit = actions[index : index + (2 if index in pair_starts[device] else 1)]
            inputs = [(d, a) for a in unit for d in graph.dependencies(a)]
            missing = [d for d, _ in inputs if d not in end_time]
            if missing:
                waiting_for[missing[0]].append(device)
                break
            start = max([device_free[device]] + [end_time[d] + transfer(d, a) for d, a in inputs])
            own = [duration(a) for a in unit]
            total = sum(own)
            if len(unit) == 2 and pair_duration is not None:
                total = pair_duration(*unit)
            end, shares = start, sum(own)
            for action, own_time in zip(unit, own, strict=True):
                action_end = end + (total * own_time / shares if shares else total / len(unit))
                records.append(TimedAction(device, action, end, action_end))
                end = action_end
            for action in unit:
                end_time[action] = end
                runnable.extend(waiting_for.pop(action, ()))
            device_free[device] = end
            next_index[device] += len(unit)
    stuck = [
        actions[index] if index < len(actions) else None
        for actions, index in zip(schedule.device_actions, next_index, strict=True)
    ]
    return records, stuck
