"""Which actions the executor runs as overlapped F&B pairs (DualPipe's units).

Pure Python. A schedule marks pairs by position (`Schedule.overlapped_pairs`); the executor
builds actions one at a time, so it needs each pair's second action mapped to its first.
Inside a rolled loop the body is traced once for every round, so a body pair overlaps
only where it is a pair of the schedule in every round.
"""

from __future__ import annotations

from collections.abc import Callable

from tfmulti.pipeline.actions import Action, Schedule
from tfmulti.pipeline.round_loop import RolledSchedule


def pair_partners(schedule: Schedule) -> dict[Action, Action]:
    """The second action of each overlapped pair, mapped to the first.

    Example:
        >>> from tfmulti.pipeline.schedules import dualpipev
        >>> partners = pair_partners(dualpipev(2, 4))
        >>> str(partners[Action("B", 3, 1)])
        'F0.3'
    """
    partners = {}
    for device, actions in enumerate(schedule.device_actions):
        for start in schedule.pair_starts(device):
            partners[actions[start + 1]] = actions[start]
    return partners


def pair_times(
    schedule: Schedule, pair_seconds: Callable[[Action, Action], float]
) -> dict[tuple[int, int], float]:
    """`CostModel.pair_times` for `schedule`: each (forward stage, backward stage) of its
    overlapped pairs, timed by `pair_seconds(forward, backward)`."""
    return {
        (first.stage, second.stage): pair_seconds(first, second)
        for second, first in pair_partners(schedule).items()
    }


def body_pair_partners(rolled: RolledSchedule) -> dict[Action, Action]:
    """The pairs of a rolled loop's body (labelled as the body labels them) that are
    overlapped pairs of the schedule in every round, each run in every round."""
    partners = pair_partners(rolled.schedule)
    if not partners:
        return {}
    every_round = range(rolled.rounds)
    previous: dict[int, Action] = {}
    body_partners = {}
    for action in rolled.body:
        device = rolled.schedule.stage_devices[action.stage]
        first, previous[device] = previous.get(device), action
        if first is None or not all(rolled.rounds_run(a) == every_round for a in (first, action)):
            continue
        if all(
            partners.get(_in_round(rolled, action, r)) == _in_round(rolled, first, r)
            for r in every_round
        ):
            body_partners[action] = first
    return body_partners


def _in_round(rolled: RolledSchedule, action: Action, round_index: int) -> Action:
    microbatch = rolled.microbatch_in_round(action.microbatch, round_index)
    return Action(action.kind, action.stage, microbatch)
