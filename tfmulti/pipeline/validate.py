"""Checks that a schedule is complete, correctly placed and free of deadlock.

Pure Python. Used on built-in schedules in tests and on custom schedules given as text.
"""

from __future__ import annotations

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)
from tfmulti.pipeline.dependencies import DependencyGraph, run_in_order


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the offending action."""


def validate_schedule(schedule: Schedule) -> None:
    """Raises `ScheduleError` unless `schedule` can run and computes every gradient once.

    Rules: every (stage, micro-batch) has exactly one F and exactly one backward (a B, or an
    I and a W); each action is on the device its stage is mapped to; on one device, F of
    stage s comes after F of stage s-1, a backward after its own F and after the backward
    of stage s+1, and I before W (same micro-batch); and running every device's actions
    in order never leaves a device waiting for an input that cannot arrive (deadlock).

    Args:
        schedule: the schedule to check.

    Example:
        >>> from tfmulti.pipeline import build_schedule
        >>> validate_schedule(build_schedule("zb_h1", 4, 8))
    """
    _check_shape(schedule)
    _check_pairs(schedule)
    positions = _check_placement_and_uniqueness(schedule)
    _check_completeness(schedule, positions)
    _check_device_order(schedule, positions)
    _check_deadlock_free(schedule)


def _check_shape(schedule: Schedule) -> None:
    if schedule.num_microbatches < 1:
        raise ScheduleError(
            f"num_microbatches must be >= 1. Received: num_microbatches={schedule.num_microbatches}"
        )
    if not schedule.stage_devices or not schedule.device_actions:
        raise ScheduleError(
            "A schedule needs at least one stage and one device. Received: "
            f"stage_devices={schedule.stage_devices}, "
            f"{len(schedule.device_actions)} device action lists"
        )
    for stage, device in enumerate(schedule.stage_devices):
        if not 0 <= device < schedule.num_devices:
            raise ScheduleError(
                f"Stage {stage} is mapped to device {device}, but the schedule has action "
                f"lists for devices 0..{schedule.num_devices - 1}."
            )


def _check_pairs(schedule: Schedule) -> None:
    if schedule.overlapped_pairs and len(schedule.overlapped_pairs) != schedule.num_devices:
        raise ScheduleError(
            f"overlapped_pairs needs one entry per device ({schedule.num_devices}). "
            f"Received: {len(schedule.overlapped_pairs)} entries"
        )
    for device, actions in enumerate(schedule.device_actions):
        previous = -2
        for index in sorted(schedule.pair_starts(device)):
            if not 0 <= index < len(actions) - 1 or index == previous + 1:
                raise ScheduleError(
                    f"Overlapped pair at position {index} on device {device} does not name "
                    f"two actions of its own; positions 0..{len(actions) - 2} that do not "
                    "share an action would."
                )
            first, second = actions[index], actions[index + 1]
            if first.kind != FORWARD or second.kind not in (BACKWARD, INPUT_GRAD):
                raise ScheduleError(
                    f"Overlapped pair {first}+{second} on device {device} must be a forward "
                    "followed by a backward (B or I)."
                )
            if first.stage == second.stage:
                raise ScheduleError(
                    f"Overlapped pair {first}+{second} on device {device} runs one stage twice "
                    "at once; pair the forward of one stage with the backward of another."
                )
            previous = index


def _check_placement_and_uniqueness(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    positions: dict[Action, tuple[int, int]] = {}
    for device, actions in enumerate(schedule.device_actions):
        for index, action in enumerate(actions):
            if action.stage >= schedule.num_stages:
                raise ScheduleError(
                    f"Action {action} on device {device} names stage {action.stage}, but the "
                    f"schedule has stages 0..{schedule.num_stages - 1}."
                )
            if action.microbatch >= schedule.num_microbatches:
                raise ScheduleError(
                    f"Action {action} on device {device} names micro-batch "
                    f"{action.microbatch}, but the schedule has micro-batches "
                    f"0..{schedule.num_microbatches - 1}."
                )
            expected_device = schedule.stage_devices[action.stage]
            if device != expected_device:
                raise ScheduleError(
                    f"Action {action} is on device {device}, but stage {action.stage} is "
                    f"mapped to device {expected_device}."
                )
            if action in positions:
                raise ScheduleError(
                    f"Action {action} appears twice on device {device} (positions "
                    f"{positions[action][1]} and {index}); each action must run once."
                )
            positions[action] = (device, index)
    return positions


def _check_completeness(schedule: Schedule, positions: dict[Action, tuple[int, int]]) -> None:
    for stage in range(schedule.num_stages):
        for microbatch in range(schedule.num_microbatches):
            present = {
                kind
                for kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
                if Action(kind, stage, microbatch) in positions
            }
            label = f"{stage}.{microbatch}"
            if FORWARD not in present:
                raise ScheduleError(
                    f"Missing forward F{label} (stage {stage}, micro-batch {microbatch})."
                )
            if BACKWARD in present and present & {INPUT_GRAD, WEIGHT_GRAD}:
                raise ScheduleError(
                    f"Stage {stage}, micro-batch {microbatch} has both B{label} and a split "
                    f"backward ({', '.join(sorted(present - {FORWARD, BACKWARD}))}{label}); "
                    "use either B or I and W."
                )
            if present == {FORWARD}:
                raise ScheduleError(
                    f"Missing backward for F{label}: expected B{label}, or I{label} and W{label}."
                )
            for half, other in ((INPUT_GRAD, WEIGHT_GRAD), (WEIGHT_GRAD, INPUT_GRAD)):
                if half in present and other not in present:
                    raise ScheduleError(
                        f"{half}{label} has no matching {other}{label}: a split backward "
                        "needs both halves."
                    )


def _check_device_order(schedule: Schedule, positions: dict[Action, tuple[int, int]]) -> None:
    graph = DependencyGraph(schedule)
    for action, (device, index) in positions.items():
        for dependency in graph.dependencies(action):
            dependency_device, dependency_index = positions[dependency]
            if dependency_device == device and dependency_index > index:
                raise ScheduleError(
                    f"Action {action} comes before {dependency} on device {device}, but it "
                    f"needs {dependency}'s result: move {action} after it."
                )


def _check_deadlock_free(schedule: Schedule) -> None:
    records, stuck = run_in_order(schedule, duration=lambda action: 1.0, transfer=lambda a, b: 0.0)
    if all(action is None for action in stuck):
        return
    graph = DependencyGraph(schedule)
    done = {record.action for record in records}
    details = "; ".join(
        f"device {device} stuck at {action} waiting for "
        + " and ".join(str(d) for d in graph.dependencies(action) if d not in done)
        for device, action in enumerate(stuck)
        if action is not None
    )
    raise ScheduleError(f"Schedule {schedule.name!r} deadlocks: {details}.")
