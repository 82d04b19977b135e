"""How a pipelined run split its model: per stage, its blocks, device and cost, and the
bubble the schedule is predicted to leave.

Read from a built `PipelineModel` (or a `HybridPipelineModel`'s replicas); a run logs it
once and keeps `to_dict()` in `metrics.json`.
"""

from __future__ import annotations

import dataclasses

import keras

from tfmulti.parallel.placement_summary import short_device_name
from tfmulti.pipeline.simulate import CostModel, StageCost, simulate
from tfmulti.planner.report import format_table

_LISTED_NAMES = 4  # names a log line shows per stage before eliding the middle


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """One pipeline stage.

    Args:
        stage: its index (over all chunks).
        device: the device it runs on; with data replicas, replica 0's.
        blocks: the names of its blocks (reference models) or layer calls (`from_model`).
        params: trainable parameters it holds (its counted cost).
    """

    stage: int
    device: str
    blocks: tuple[str, ...]
    params: int


@dataclasses.dataclass(frozen=True)
class SplitSummary:
    """A pipeline's split and its predicted bubble.

    Args:
        stages: per stage, in order.
        schedule: the schedule's name.
        num_microbatches: micro-batches per step.
        predicted_bubble: idle fraction of the simulated step, each stage costing in
            proportion to its parameters (F = params, B = 2 x params).
        data_replicas: copies of the pipeline (hybrid runs), 1 otherwise.
        replica_devices: per copy on this host, its stages' devices.

    Example:
        >>> print(split_summary(pipeline_model))
    """

    stages: tuple[StageSplit, ...]
    schedule: str
    num_microbatches: int
    predicted_bubble: float
    data_replicas: int = 1
    replica_devices: tuple[tuple[str, ...], ...] = ()

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
        rows = [
            (
                str(stage.stage),
                short_device_name(stage.device),
                _listed(stage.blocks),
                str(stage.params),
            )
            for stage in self.stages
        ]
        table = format_table(rows, ("stage", "device", "blocks", "params"))
        lines = [heading, table]
        lines += [
            f"replica {index} devices: {', '.join(short_device_name(d) for d in devices)}"
            for index, devices in enumerate(self.replica_devices)
            if len(self.replica_devices) > 1
        ]
        lines.append(f"predicted bubble (stage cost = parameters): {self.predicted_bubble:.1%}")
        return "\n".join(lines)


def _listed(names: tuple[str, ...]) -> str:
    if len(names) <= _LISTED_NAMES:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} ... {names[-1]} ({len(names)})"


def _stage_block_names(stage: keras.layers.Layer) -> tuple[str, ...]:
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


def predicted_bubble(schedule, stage_params: list[int]) -> float:
    """The idle fraction of `schedule`'s simulated step with stage costs ∝ parameters
    (uniform costs if no stage has any)."""
    weights = stage_params if any(stage_params) else [1] * len(stage_params)
    costs = CostModel(tuple(StageCost(forward=w, backward=2 * w) for w in weights))
    return simulate(schedule, costs).bubble_fraction


def split_summary(model: keras.Model) -> SplitSummary | None:
    """The split of a built `PipelineModel` or `HybridPipelineModel`; None for other models."""
    replicas = getattr(model, "replicas", None) or [model]
    pipeline = replicas[0]
    if not hasattr(pipeline, "stage_devices"):
        return None
    stages = tuple(
        StageSplit(index, device, _stage_block_names(stage), params)
        for index, (stage, device, params) in enumerate(
            zip(
                pipeline.stages,
                pipeline.stage_devices,
                _stage_params(pipeline.stages),
                strict=True,
            )
        )
    )
    return SplitSummary(
        stages=stages,
        schedule=pipeline.schedule.name,
        num_microbatches=pipeline.num_microbatches,
        predicted_bubble=predicted_bubble(pipeline.schedule, [s.params for s in stages]),
        data_replicas=getattr(model, "num_data_replicas", 1),
        replica_devices=tuple(tuple(replica.stage_devices) for replica in replicas),
    )
