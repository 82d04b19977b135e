"""Turns the `schedule` argument of PipelineModel (a name, text or Schedule) into a Schedule."""

from __future__ import annotations

from tfmulti.pipeline.actions import BACKWARD, FORWARD, Action, Schedule
from tfmulti.pipeline.schedules import SCHEDULE_NAMES, build_schedule
from tfmulti.pipeline.text import schedule_from_text
from tfmulti.pipeline.validate import validate_schedule

MODEL_PARALLEL = "model_parallel"


def model_parallel_schedule(num_stages: int, num_devices: int) -> Schedule:
    """One micro-batch through every stage and back, stage i on device i mod num_devices.

    The baseline a pipeline must beat: the same placement, with one device busy at a time.
    """
    stage_devices = tuple(stage % num_devices for stage in range(num_stages))
    orders = [[] for _ in range(num_devices)]
    for stage in range(num_stages):
        orders[stage_devices[stage]].append(Action(FORWARD, stage, 0))
    for stage in reversed(range(num_stages)):
        orders[stage_devices[stage]].append(Action(BACKWARD, stage, 0))
    return Schedule(MODEL_PARALLEL, 1, stage_devices, tuple(tuple(o) for o in orders))


def resolve_schedule(
    schedule: str | Schedule, num_stages: int, num_devices: int, num_microbatches: int
) -> Schedule:
    """The validated Schedule for `num_stages` stages on `num_devices` devices.

    Args:
        schedule: a name in `SCHEDULE_NAMES` or "model_parallel", a schedule in the text
            form of `tfmulti.pipeline.schedule_from_text`, or a `Schedule`.
        num_stages: number of stages passed to the model.
        num_devices: number of devices passed to the model.
        num_microbatches: micro-batches per step.

    Raises:
        ValueError: the schedule is unknown, or disagrees with the stages, devices or
            micro-batches.
    """
    if num_stages % num_devices:
        raise ValueError(
            f"The number of stages must be a multiple of the number of devices (chunks per "
            f"device). Received: {num_stages} stages for {num_devices} devices; pass "
            f"{num_devices} or {2 * num_devices} stages, or {num_stages} devices."
        )
    chunks = num_stages // num_devices
    if isinstance(schedule, str) and schedule == MODEL_PARALLEL:
        if num_microbatches != 1:
            raise ValueError(
                "model_parallel runs the whole batch at once, so num_microbatches must be 1. "
                f"Received: num_microbatches={num_microbatches}"
            )
        resolved = model_parallel_schedule(num_stages, num_devices)
    elif isinstance(schedule, str) and schedule in SCHEDULE_NAMES:
        resolved = build_schedule(
            schedule, num_devices, num_microbatches, chunks if chunks > 1 else None
        )
    elif isinstance(schedule, str) and "device" in schedule:
        resolved = schedule_from_text(schedule)
    elif isinstance(schedule, Schedule):
        resolved = schedule
    else:
        raise ValueError(
            f"Unknown schedule. Use one of {SCHEDULE_NAMES + (MODEL_PARALLEL,)}, schedule "
            f"text or a tfmulti.pipeline.Schedule. Received: schedule={schedule!r}"
        )
    expected = (num_stages, num_devices, num_microbatches)
    received = (resolved.num_stages, resolved.num_devices, resolved.num_microbatches)
    if received != expected:
        raise ValueError(
            f"Schedule {resolved.name!r} is for {received[0]} stages on {received[1]} devices "
            f"with {received[2]} micro-batches, but the model has {num_stages} stages on "
            f"{num_devices} devices with num_microbatches={num_microbatches}."
        )
    validate_schedule(resolved)
    return resolved
