"""Pipeline schedules as data: actions and per-device action lists.

Pure Python, no TensorFlow import: planners, simulators, pictures and the
TensorFlow executor all read the same `Schedule`.
"""

from __future__ import annotations

import dataclasses

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"
WEIGHT_GRAD = "W"
ACTION_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: `kind` of `stage` on `microbatch`.

    Args:
        kind: "F" forward, "B" full backward, "I" input-gradient half of a
            backward, "W" weight-gradient half of a backward.
        stage: index of the model stage (chunk), 0-based, over all chunks.
        microbatch: index of the micro-batch, 0-based.
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(
                f"Action kind must be one of {ACTION_KINDS}. Received: kind={self.kind!r}"
            )
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                "Action stage and microbatch must be >= 0. "
                f"Received: stage={self.stage}, microbatch={self.microbatch}"
            )

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: for each device, the ordered actions it runs.

    Args:
        name: schedule name, e.g. "1f1b".
        num_microbatches: micro-batches per training step (m).
        stage_devices: device index of each stage; `len(stage_devices)` is the
            number of stages (p·v), `max + 1` the number of devices (p).
        device_actions: per device, the actions in execution order.
        overlapped_pairs: per device (or empty for none), the positions i at which
            actions i and i+1, a forward and a backward of different stages, form one
            overlapped F&B unit (DualPipe): both start once both have their inputs, and
            their outputs leave when the unit ends. The executor builds the backward to wait
            for what the forward waits for, not for the forward, so TensorFlow may run the
            two at once (`tfmulti.pipeline.overlapped_pairs`).
    """

    name: str
    num_microbatches: int
    stage_devices: tuple[int, ...]
    device_actions: tuple[tuple[Action, ...], ...]
    overlapped_pairs: tuple[tuple[int, ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def num_devices(self) -> int:
        return len(self.device_actions)

    @property
    def chunks(self) -> int:
        return self.num_stages // self.num_devices

    def pair_starts(self, device: int) -> tuple[int, ...]:
        """Positions on `device` where an overlapped F&B unit starts (see `overlapped_pairs`)."""
        return self.overlapped_pairs[device] if self.overlapped_pairs else ()

    @property
    def splits_backward(self) -> bool:
        return any(
            action.kind in (INPUT_GRAD, WEIGHT_GRAD)
            for actions in self.device_actions
            for action in actions
        )
