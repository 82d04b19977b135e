"""Cost-and-memory simulation of a pipeline schedule.

Pure Python. Devices run one action at a time in schedule order; an action starts once its
device is free and its inputs have arrived (a cross-device input arrives `transfer_time`
after the producing action ends).

Memory accounting: a micro-batch's activations on a stage are live from the start of its F
to the end of its backward: the end of B, or the end of W when the backward is split (the
weight gradient still reads the stage's inputs, as in the zero-bubble paper).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)
from tfmulti.pipeline.dependencies import TimedAction, run_in_order


@dataclasses.dataclass(frozen=True)
class StageCost:
    """Costs of one stage for one micro-batch.

    Args:
        forward: time of F.
        backward: time of a full backward B.
        weight_grad: time of W, the weight-gradient part of a split backward. Defaults to
            half of `backward`.
        activation_bytes: bytes a micro-batch keeps alive on this stage from F to its
            backward.
        input_grad: time of I, the input-gradient part of a split backward. Defaults to
            backward - weight_grad; a split backward measured on its own may take longer
            than the whole one (I + W > B: each part pays its own call and reads again
            what the whole one kept).

    Example:
        >>> StageCost(forward=1, backward=2, weight_grad=1, input_grad=1.5).duration("I")
        1.5
    """

    forward: float = 1.0
    backward: float = 2.0
    weight_grad: float | None = None
    activation_bytes: float = 1.0
    input_grad: float | None = None

    def __post_init__(self):
        if self.weight_grad is None:
            object.__setattr__(self, "weight_grad", self.backward / 2)
        explicit_input_grad = self.input_grad is not None
        if not explicit_input_grad:
            object.__setattr__(self, "input_grad", self.backward - self.weight_grad)
        times = (self.forward, self.backward, self.weight_grad, self.input_grad)
        if min(*times, self.activation_bytes) < 0:
            raise ValueError(f"Stage costs must be >= 0. Received: {self}")
        if not explicit_input_grad and self.weight_grad > self.backward:
            raise ValueError(
                "weight_grad is part of backward and cannot exceed it. "
                f"Received: backward={self.backward}, weight_grad={self.weight_grad}"
            )

    def duration(self, kind: str) -> float:
        """Time of an action of `kind` ("F", "B", "I" or "W") on this stage."""
        return {
            FORWARD: self.forward,
            BACKWARD: self.backward,
            INPUT_GRAD: self.input_grad,
            WEIGHT_GRAD: self.weight_grad,
        }[kind]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Costs of every stage, plus the time to send a tensor between devices.

    Args:
        stages: one `StageCost` per stage (over all chunks).
        transfer_time: delay between a stage finishing and the next device receiving.
        pair_times: time of an overlapped F&B unit (`Schedule.overlapped_pairs`), keyed by
            (forward stage, backward stage), as measured (a step's timeline measures it:
            `timeline_report.measured_costs`); a pair not listed takes its two actions'
            time, F + B, as when nothing overlaps them.

    Example:
        >>> costs = CostModel.uniform(4, forward=1, backward=2, weight_grad=1)
        >>> costs.stages[0].input_grad
        1
    """

    stages: tuple[StageCost, ...]
    transfer_time: float = 0.0
    pair_times: Mapping[tuple[int, int], float] = dataclasses.field(
        default_factory=dict, hash=False
    )

    def __post_init__(self):
        if self.transfer_time < 0:
            raise ValueError(f"transfer_time must be >= 0. Received: {self.transfer_time}")
        if any(time < 0 for time in self.pair_times.values()):
            raise ValueError(f"pair_times must be >= 0. Received: {dict(self.pair_times)}")

    def pair_duration(self, forward: Action, backward: Action) -> float:
        """Time of the overlapped unit of `forward` and `backward`."""
        own = self.stages[forward.stage].forward
        own += self.stages[backward.stage].duration(backward.kind)
        return self.pair_times.get((forward.stage, backward.stage), own)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        forward: float = 1.0,
        backward: float = 2.0,
        weight_grad: float | None = None,
        activation_bytes: float = 1.0,
        transfer_time: float = 0.0,
    ) -> CostModel:
        """The same costs on every one of `num_stages` stages."""
        stage = StageCost(forward, backward, weight_grad, activation_bytes)
        return cls((stage,) * num_stages, transfer_time)

    def split_into_chunks(self, chunks: int) -> CostModel:
        """Costs for `chunks` times as many stages, each a 1/chunks slice of one stage here.

        Used to compare an interleaved schedule against a flat one on the same model.
        """
        sliced = [
            StageCost(
                stage.forward / chunks,
                stage.backward / chunks,
                stage.weight_grad / chunks,
                stage.activation_bytes / chunks,
                stage.input_grad / chunks,
            )
            for stage in self.stages
        ]
        return CostModel(tuple(s for s in sliced for _ in range(chunks)), self.transfer_time)


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What a simulated training step looks like.

    Args:
        schedule: the simulated schedule.
        records: every action with its device, start and end, in start order.
        makespan: time from the first start to the last end.
        busy_time: per device, total time spent in actions.
        peak_activations: per device, the most (stage, micro-batch) activations alive at
            once. With v chunks per device, divide by v for full-device micro-batches.
        peak_activation_bytes: per device, the most activation bytes alive at once.
    """

    schedule: Schedule
    records: tuple[TimedAction, ...]
    makespan: float
    busy_time: tuple[float, ...]
    peak_activations: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]

    @property
    def utilisation(self) -> tuple[float, ...]:
        """Per device, the fraction of the makespan spent in actions."""
        return tuple(busy / self.makespan if self.makespan else 0.0 for busy in self.busy_time)

    @property
    def bubble_time(self) -> float:
        """Idle time summed over devices."""
        return self.makespan * len(self.busy_time) - sum(self.busy_time)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over (devices x makespan)."""
        total = self.makespan * len(self.busy_time)
        return self.bubble_time / total if total else 0.0

    @property
    def overlapped_bubble_fraction(self) -> float:
        """Idle time inside each device's own first-start-to-last-end span, over those spans.

        The bubble left when consecutive steps overlap (each device starts the next step as
        soon as it is done, as zero-bubble pipelines do by deferring optimizer-step checks).
        """
        first = {}
        last = {}
        for record in self.records:
            first[record.device] = min(first.get(record.device, record.start), record.start)
            last[record.device] = max(last.get(record.device, record.end), record.end)
        span = sum(last[d] - first[d] for d in first)
        return (span - sum(self.busy_time)) / span if span else 0.0


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimulationResult:
    """Simulates one training step of `schedule` under `costs`.

    Args:
        schedule: a valid schedule (see `validate_schedule`).
        costs: per-stage costs; defaults to `CostModel.uniform` (F=1, B=2, W=1).

    Returns:
        A `SimulationResult`.

    Raises:
        ValueError: if the cost model does not have one entry per stage, or the schedule
            deadlocks.

    Example:
        >>> from tfmulti.pipeline import build_schedule
        >>> result = simulate(build_schedule("1f1b", 4, 8))
        >>> round(result.bubble_fraction, 4)
        0.2727
    """
    if costs is None:
        costs = CostModel.uniform(schedule.num_stages)
    if len(costs.stages) != schedule.num_stages:
        raise ValueError(
            f"The cost model must have one StageCost per stage ({schedule.num_stages}). "
            f"Received: {len(costs.stages)} stages"
        )
    stage_devices = schedule.stage_devices

    def transfer(producer: Action, consumer: Action) -> float:
        same_device = stage_devices[producer.stage] == stage_devices[consumer.stage]
        return 0.0 if same_device else costs.transfer_time

    records, stuck = run_in_order(
        schedule,
        lambda a: costs.stages[a.stage].duration(a.kind),
        transfer,
        costs.pair_duration,
    )
    if any(action is not None for action in stuck):
        waiting = ", ".join(f"device {d} at {a}" for d, a in enumerate(stuck) if a is not None)
        raise ValueError(
            f"Schedule {schedule.name!r} deadlocks: {waiting}. Run validate_schedule first."
        )
    records.sort(key=lambda r: (r.start, r.device))
    busy = [0.0] * schedule.num_devices
    for record in records:
        busy[record.device] += record.end - record.start
    peaks, peak_bytes = _peak_activations(schedule.num_devices, records, costs.stages)
    return SimulationResult(
        schedule=schedule,
        records=tuple(records),
        makespan=max((r.end for r in records), default=0.0),
        busy_time=tuple(busy),
        peak_activations=peaks,
        peak_activation_bytes=peak_bytes,
    )


def _peak_activations(
    num_devices: int, records: Sequence[TimedAction], stages: Sequence[StageCost]
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    events = []  # (time, order, device, count delta, bytes delta); frees sort before allocations
    for record in records:
        action = record.action
        size = stages[action.stage].activation_bytes
        if action.kind == FORWARD:
            events.append((record.start, 1, record.device, 1, size))
        elif action.kind in (BACKWARD, WEIGHT_GRAD):
            events.append((record.end, 0, record.device, -1, -size))
    events.sort(key=lambda e: (e[0], e[1]))
    live = [0] * num_devices
    live_bytes = [0.0] * num_devices
    peaks = [0] * num_devices
    peak_bytes = [0.0] * num_devices
    for _, _, device, count, size in events:
        live[device] += count
        live_bytes[device] += size
        peaks[device] = max(peaks[device], live[device])
        peak_bytes[device] = max(peak_bytes[device], live_bytes[device])
    return tuple(peaks), tuple(peak_bytes)
