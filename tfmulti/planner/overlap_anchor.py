"""The model's overlap curve anchored on `scripts/train.py`'s data-parallel step.

Pure Python. The curve (`MachineCosts.serial_fractions`, the model's own when measured)
is timed inside `plan.py`'s process, and train.py's layouts meet more overlap in some
sessions and less in others. A data-parallel run of train.py (`DataParallelStep`, timed
in the anchor's rounds) says how much its n devices overlapped: the curve is scaled in
speed-up, 1 + a x (speed-up - 1) at each device count (one device stays at 1), with the
one `a` that makes the n x 1 x 1 layout's prediction equal that step. Layouts without a
pipe axis (data, tensor and data x tensor) are scored on the scaled curve; pipelines keep
the curve timed in `plan.py`, since a data-parallel run's overlap is not a pipeline's
(re-scoring past validations with every layout on the scaled curve overshot pipelines by
up to 1.42x; see docs/design/planner_accuracy.md).
"""

from __future__ import annotations

import dataclasses

from tfmulti.planner.costs import DataParallelStep, Hardware, ModelCosts, blocks_at
from tfmulti.planner.machine import MachineCosts
from tfmulti.planner.scoring import score_layout
from tfmulti.platform.mesh import HybridMesh

# Bisection steps for the scale: far below a microsecond on any step this finds.
_BISECTION_STEPS = 60
# The largest scale tried: past it every device count runs fully in parallel anyway.
_LARGEST_SCALE = 1e3


def scaled_overlap(machine: MachineCosts, scale: float) -> MachineCosts:
    """`machine` with its overlap curve scaled in speed-up by `scale`.

    Example:
        >>> scaled_overlap(MachineCosts(serial_fractions=(1.0, 0.5)), 0.5).serial_fractions
        (1.0, 0.6666666666666666)
    """
    if scale < 0:
        raise ValueError(f"An overlap scale is >= 0. Received: {scale}")

    def scaled(fraction: float) -> float:
        return 1.0 / (1.0 + scale * (1.0 / fraction - 1.0)) if fraction > 0 else fraction

    return dataclasses.replace(
        machine,
        serial_fraction=scaled(machine.serial_fraction),
        serial_fractions=tuple(scaled(fraction) for fraction in machine.serial_fractions),
    )


def overlap_scale(costs: ModelCosts, hardware: Hardware, step: DataParallelStep) -> float:
    """The scale of `hardware.machine`'s overlap curve under which `costs`' data-parallel
    layout on `step.devices` devices at `step.batch` predicts `step.seconds`: 0 (no overlap)
    if even that predicts less, `_LARGEST_SCALE` if even that predicts more.

    Example:
        >>> from tfmulti.planner.costs import AffineTime, BlockCost
        >>> block = BlockCost("b", 10, AffineTime(0.0, 1.0), AffineTime(0.0, 1.0), 4.0)
        >>> costs = ModelCosts("mlp", {}, "digits", None, (block,))
        >>> hardware = Hardware(machine=MachineCosts(serial_fractions=(1.0, 0.5)))
        >>> # Two replicas of 2 s each: 2 s fully parallel, 4 s serial; measured 3 s.
        >>> round(overlap_scale(costs, hardware, DataParallelStep(2, 2, 3.0)), 6)
        0.333333
    """
    machine = _machine(hardware)
    mesh = HybridMesh(data=step.devices)
    blocks = blocks_at(costs, step.batch / step.devices, 1, hardware)
    variables = sum(block.variables for block in costs.blocks)

    def predicted(scale: float) -> float:
        scaled = dataclasses.replace(hardware, machine=scaled_overlap(machine, scale))
        return score_layout(
            blocks, mesh, None, 1, 1, (), scaled, variables, run_overhead=costs.run_overhead
        ).step_time

    low, high = 0.0, _LARGEST_SCALE
    if predicted(low) <= step.seconds:
        return low
    if predicted(high) >= step.seconds:
        return high
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) > step.seconds else (low, middle)
    return (low + high) / 2


def anchored_overlap(costs: ModelCosts, hardware: Hardware) -> tuple[Hardware, float | None]:
    """(the hardware the layouts without a pipe axis are scored on, the overlap scale):
    `hardware` with its curve scaled to `costs.data_parallel_step`, or `hardware` and None
    when the model has no data-parallel step or the hardware no measured machine."""
    step = costs.data_parallel_step
    if step is None or hardware.machine is None:
        return hardware, None
    scale = overlap_scale(costs, hardware, step)
    return dataclasses.replace(hardware, machine=scaled_overlap(hardware.machine, scale)), scale


def _machine(hardware: Hardware) -> MachineCosts:
    if hardware.machine is None:
        raise ValueError("Anchoring the overlap curve needs measured machine costs.")
    return hardware.machine
