"""Summaries of a measured pipeline step: bubble, stashed activations, order followed.

Pure Python over timing records (device, action, start, end), such as
`PipelineModel.measured_actions()` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from tfmulti.pipeline.actions import BACKWARD, FORWARD, WEIGHT_GRAD, Schedule
from tfmulti.pipeline.overlapped_pairs import pair_partners


def bubble_fraction(records: Sequence, num_devices: int) -> float:
    """Share of device time idle between the step's first start and last end; a device is
    busy while any of its actions runs (an overlapped pair counts once)."""
    if not records:
        raise ValueError("bubble_fraction needs at least one record. Received: records=[]")
    span = max(r.end for r in records) - min(r.start for r in records)
    busy = 0.0
    for device in {r.device for r in records}:
        busy += _covered(sorted((r.start, r.end) for r in records if r.device == device))
    return 1.0 - busy / (num_devices * span) if span > 0 else 0.0


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of sorted (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def peak_stashed_activations(records: Sequence, num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations were alive at once.

    A micro-batch's activations on a stage are alive from the start of its F to the end of
    its backward (B, or W when the backward is split), as in `tfmulti.pipeline.simulate`.
    """
    events = []  # (time, frees before allocations at equal times, stage, change)
    for record in records:
        action = record.action
        if action.kind == FORWARD:
            events.append((record.start, 1, action.stage, 1))
        elif action.kind in (BACKWARD, WEIGHT_GRAD):
            events.append((record.end, 0, action.stage, -1))
    live = [0] * num_stages
    peaks = [0] * num_stages
    for _, _, stage, change in sorted(events):
        live[stage] += change
        peaks[stage] = max(peaks[stage], live[stage])
    return peaks


def order_deviations(records: Sequence, schedule: Schedule) -> list[str]:
    """Ways the measured step departed from `schedule`; empty when it ran as planned.

    Checks that every action ran exactly once, and that each device started its actions
    in the schedule's order with no two overlapping, but for the two actions of an
    overlapped pair (`Schedule.overlapped_pairs`), which may start in either order and
    run at once.
    """
    problems = []
    planned = {a for actions in schedule.device_actions for a in actions}
    seen = [r.action for r in records]
    if sorted(seen) != sorted(planned):
        missing = planned - set(seen)
        repeated = {a for a in seen if seen.count(a) > 1}
        problems.append(
            f"missing {sorted(map(str, missing))}, repeated {sorted(map(str, repeated))}"
        )
    partners = pair_partners(schedule)
    for device, actions in enumerate(schedule.device_actions):
        ran = sorted((r for r in records if r.device == device), key=lambda r: r.start)
        units = _units([r.action for r in ran], partners)
        if units != _units(list(actions), partners):
            problems.append(f"device {device} ran {[str(r.action) for r in ran]}")
        for before, after in zip(ran, ran[1:], strict=False):
            paired = {partners.get(after.action), partners.get(before.action)}
            if after.start < before.end and not paired & {before.action, after.action}:
                problems.append(
                    f"device {device}: {after.action} started before {before.action} ended"
                )
    return problems


def _units(actions: list, partners: dict) -> list:
    """`actions` with each overlapped pair as one unordered unit."""
    units, index = [], 0
    while index < len(actions):
        following = actions[index + 1] if index + 1 < len(actions) else None
        pair = {actions[index], following}
        if following is not None and (
            partners.get(following) == actions[index] or partners.get(actions[index]) == following
        ):
            units.append(frozenset(pair))
            index += 2
        else:
            units.append(actions[index])
            index += 1
    return units
