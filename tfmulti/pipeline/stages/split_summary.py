"""How a pipelined run split its model: per stage, its blocks, device and cost, and the
bubble the schedule is predicted to leave.

Read from a built `PipelineModel` (or a `HybridPipelineModel`'s replicas); a run logs it
once and keeps `to_dict()` in `metrics.json`. A split chosen by measured block times
(`--partition=time`) carries them in `MeasuredStageSeconds`; each stage then shows its
seconds and share, and the bubble is simulated with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras

from tfmulti.pipeline.balance import Block
from tfmulti.pipeline.simulate import CostModel, StageCost, simulate
from tfmulti.platform.runtime.devices import short_device_name, worker_device_name
from tfmulti.text_table import format_table

_LISTED_NAMES = 4  # names a log line shows per stage before eliding the middle
MEASURED_SECONDS_ATTRIBUTE = "measured_stage_seconds"


@dataclasses.dataclass(frozen=True)
class MeasuredStageSeconds:
    """Per stage, the measured seconds of one micro-batch's forward and backward.

    Set on a pipeline model as `measured_stage_seconds` by whoever split it by time.

    Args:
        forward: per stage, forward seconds.
        backward: per stage, backward seconds.

    Example:
        >>> MeasuredStageSeconds.from_blocks(costs, partition.boundaries)
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]

    @classmethod
    def from_blocks(cls, costs: Sequence[Block], boundaries: Sequence[int]) -> MeasuredStageSeconds:
        """Sums the blocks' measured seconds over the stages that start at 0 and `boundaries`."""
        edges = [0, *boundaries, len(costs)]
        stages = [costs[start:end] for start, end in zip(edges, edges[1:], strict=False)]
        return cls(
            forward=tuple(sum(block.forward_time for block in stage) for stage in stages),
            backward=tuple(sum(block.backward_time for block in stage) for stage in stages),
        )


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """One pipeline stage.

    Args:
        stage: its index (over all chunks).
        device: the device it runs on; with data replicas, replica 0's.
        blocks: the names of its blocks (reference models) or layer calls (`from_model`).
        params: trainable parameters it holds.
        seconds: measured forward+backward seconds of one micro-batch, if split by time.
        seconds_share: `seconds` over all stages' seconds, if split by time.
    """

    stage: int
    device: str
    blocks: tuple[str, ...]
    params: int
    seconds: float | None = None
    seconds_share: float | None = None


@dataclasses.dataclass(frozen=True)
class SplitSummary:
    """A pipeline's split and its predicted bubble.

    Args:
        stages: per stage, in order.
        schedule: the schedule's name.
        num_microbatches: micro-batches per step.
        predicted_bubble: idle fraction of the simulated step, each stage costing its
            measured seconds, or else in proportion to its parameters (F = params,
            B = 2 x params).
        data_replicas: copies of the pipeline (hybrid runs), 1 otherwise.
        replica_devices: per copy on this host, its stages' devices.
        stage_cost: what costs a stage in the simulated bubble: "parameters" or
            "measured seconds".

    Example:
        >>> print(split_summary(pipeline_model))
    """

    stages: tuple[StageSplit, ...]
    schedule: str
    num_microbatches: int
    predicted_bubble: float
    data_replicas: int = 1
    replica_devices: tuple[tuple[str, ...], ...] = ()
    stage_cost: str = "parameters"

    def to_dict(self) -> dict:
        """The summary as plain JSON values (for `metrics.json`)."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        heading = (
            f"Pipeline split: {len(self.stages)} stages, schedule {self.schedule}, "
            f"{self.num_microbatches} micro-batch{'' if self.num_microbatches == 1 else 'es'}"
        )
        if self.data_replicas > 1:
            heading += f", {self.data_replicas} data replicas"
        measured = all(stage.seconds is not None for stage in self.stages)
        rows = [
            (
                str(stage.stage),
                worker_device_name(stage.device),
                _listed(stage.blocks),
                str(stage.params),
                *((f"{stage.seconds * 1e3:.2f}", f"{stage.seconds_share:.1%}") if measured else ()),
            )
            for stage in self.stages
        ]
        columns = ("stage", "device", "blocks", "params")
        table = format_table(rows, columns + (("F+B ms", "share") if measured else ()))
        lines = [heading, table]
        lines += [
            f"replica {index} devices: {', '.join(worker_device_name(d) for d in devices)}"
            for index, devices in enumerate(self.replica_devices)
            if len(self.replica_devices) > 1
        ]
        lines.append(
            f"predicted bubble (stage cost = {self.stage_cost}): {self.predicted_bubble:.1%}"
        )
        return "\n".join(lines)


def _listed(names: tuple[str, ...]) -> str:
    if len(names) <= _LISTED_NAMES:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} ... {names[-1]} ({len(names)})"


def stage_block_names(stage: keras.layers.Layer) -> tuple[str, ...]:
    """The names a stage's rows list: its blocks, its layer calls, or its own name."""
    if hasattr(stage, "blocks"):  # BlockStage: a reference model's blocks
        return tuple(block.name for block in stage.blocks)
    if hasattr(stage, "call_names"):  # GraphStage: calls of a user's model
        return tuple(stage.call_names)
    return (stage.name,)


def _stage_params(stages: list[keras.layers.Layer]) -> list[int]:
    """Trainable parameters per stage; a weight two stages share (a tied embedding)
    counts in the first, which holds and updates it."""
    counted, params = set(), []
    for stage in stages:
        own = [v for v in stage.trainable_variables if id(v) not in counted]
        counted.update(id(v) for v in own)
        params.append(int(sum(v.numpy().size for v in own)))
    return params


def predicted_bubble(
    schedule, stage_params: list[int], measured: MeasuredStageSeconds | None = None
) -> float:
    """The idle fraction of `schedule`'s simulated step with the `measured` stage seconds,
    or else stage costs ∝ parameters (uniform costs if no stage has any)."""
    if measured is not None:
        stages = zip(measured.forward, measured.backward, strict=True)
    else:
        weights = stage_params if any(stage_params) else [1] * len(stage_params)
        stages = ((w, 2 * w) for w in weights)
    costs = CostModel(tuple(StageCost(forward=f, backward=b) for f, b in stages))
    return simulate(schedule, costs).bubble_fraction


def split_summary(model: keras.Model) -> SplitSummary | None:
    """The split of a built `PipelineModel` or `HybridPipelineModel`; None for other models."""
    replicas = getattr(model, "replicas", None) or [model]
    pipeline = replicas[0]
    if not hasattr(pipeline, "stage_devices"):
        return None
    measured = getattr(model, MEASURED_SECONDS_ATTRIBUTE, None)
    if measured is not None and len(measured.forward) != len(pipeline.stages):
        measured = None
    seconds = _stage_seconds(measured, len(pipeline.stages))
    total = sum(s for s in seconds if s is not None)
    stages = tuple(
        StageSplit(
            index,
            device,
            stage_block_names(stage),
            params,
            stage_seconds,
            stage_seconds / total if stage_seconds is not None and total > 0 else None,
        )
        for index, (stage, device, params, stage_seconds) in enumerate(
            zip(
                pipeline.stages,
                pipeline.stage_devices,
                _stage_params(pipeline.stages),
                seconds,
                strict=True,
            )
        )
    )
    return SplitSummary(
        stages=stages,
        schedule=pipeline.schedule.name,
        num_microbatches=pipeline.num_microbatches,
        predicted_bubble=predicted_bubble(pipeline.schedule, [s.params for s in stages], measured),
        data_replicas=getattr(model, "num_data_replicas", 1),
        replica_devices=tuple(tuple(replica.stage_devices) for replica in replicas),
        stage_cost="parameters" if measured is None else "measured seconds",
    )


def placement_table(model: keras.Model) -> str:
    """One line per block or layer call of a `PipelineModel` or `HybridPipelineModel`: its
    stage and device (each replica's, for several).

    Example:
        >>> print(placement_table(pipeline_model))
    """
    replicas = getattr(model, "replicas", None) or [model]
    stages = replicas[0].stages
    rows = [
        (name, str(index), ", ".join(short_device_name(r.stage_devices[index]) for r in replicas))
        for index, stage in enumerate(stages)
        for name in stage_block_names(stage)
    ]
    devices = "device" if len(replicas) == 1 else f"devices (replicas 0-{len(replicas) - 1})"
    return format_table(rows, ("layer", "stage", devices))


def _stage_seconds(measured: MeasuredStageSeconds | None, num_stages: int) -> list:
    if measured is None:
        return [None] * num_stages
    return [f + b for f, b in zip(measured.forward, measured.backward, strict=True)]
