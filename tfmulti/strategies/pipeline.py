"""Pipeline parallelism: the model cut into stages on devices, micro-batches on a schedule."""

from __future__ import annotations

import os

import keras
import numpy as np
from absl import logging

from tfmulti.config import TrainConfig
from tfmulti.pipeline.actions import Schedule
from tfmulti.pipeline.stages.split_summary import MEASURED_SECONDS_ATTRIBUTE, MeasuredStageSeconds
from tfmulti.platform.runtime.cluster import ClusterInfo
from tfmulti.platform.runtime.connected_cluster import devices_across_workers
from tfmulti.platform.runtime.devices import first_logical_devices
from tfmulti.strategies.base import (
    BuildContext,
    ChiefDrivenStrategy,
    DevicePlacingStrategy,
    check_batch_splits,
)
from tfmulti.strategies.model_source import ModelSource


class Pipeline(ChiefDrivenStrategy, DevicePlacingStrategy):
    """`pipeline`: `--num_stages` stages, `--microbatches` per step, on `--schedule`; over
    several workers, the chief drives the stages on every worker's devices."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        return build_staged_model(
            source, config, context.sample_x, pipelined=True, cluster=context.cluster
        )

    def prepare(self, model: keras.Model, context: BuildContext) -> None:
        """Refuses, in one line, a stage on another worker that calls Python; then builds
        the model on one batch."""
        refuse_python_calls(model, context.sample_x)
        super().prepare(model, context)


def refuse_python_calls(pipeline: keras.Model, sample_x: np.ndarray) -> None:
    """Builds a `PipelineModel`'s stages for `sample_x` and refuses a stage on another
    worker's device that calls Python (`refuse_python_calls_on_other_workers`)."""
    from tfmulti.pipeline.stages.python_calls import refuse_python_calls_on_other_workers

    pipeline.build_stages(sample_x)
    refuse_python_calls_on_other_workers(pipeline.stages, pipeline.stage_devices, sample_x)


def model_partition(partition: str) -> str | list[str]:
    """`--partition` for a whole model: a policy, or "layers:A,B" (layers where stages 1.. begin).

    Example:
        >>> model_partition("layers:block_2,block_4")
        ['block_2', 'block_4']
    """
    policy, _, names = partition.partition(":")
    if policy == "layers":
        return names.split(",")
    if policy == "manual":
        raise ValueError(
            "A model from package.module:function is cut at named layers, not block indices; "
            f"use --partition=layers:NAME,NAME. Received: --partition={partition}"
        )
    return policy


def partition_cost_cache(config: TrainConfig):
    """`<model_dir>/partition_costs.json` under `--partition=time` (read unless
    `--remeasure_partition`), so a resumed or repeated run does not time again; else None.

    A resumed run always reads the kept costs: its step checkpoint holds the stages they
    cut, and new timings could cut the model elsewhere, where the checkpoint does not load.
    """
    return kept_costs(config) if config.pipeline.partition == "time" else None


def kept_costs(config: TrainConfig):
    """The `CostCache` in `<model_dir>/partition_costs.json`: timings of blocks and layer
    calls kept between runs (re-timed with `--remeasure_partition`, except on `--resume`)."""
    from tfmulti.costing.cost_cache import COST_CACHE_FILE, CostCache

    path = os.path.join(config.run.model_dir, COST_CACHE_FILE)
    remeasure = config.pipeline.remeasure_partition
    if remeasure and config.run.resume and os.path.exists(path):
        logging.warning(
            "--remeasure_partition is ignored with --resume: the run's checkpoint holds the "
            "stages cut by the costs in %s, and new timings could cut them elsewhere. Start a "
            "new --model_dir to re-cut.",
            path,
        )
        remeasure = False
    return CostCache(path, remeasure)


def split_blocks(
    config: TrainConfig,
    blocks: list[keras.layers.Layer],
    num_stages: int,
    num_microbatches: int,
    microbatch_x: np.ndarray,
    schedule: str | Schedule,
) -> tuple[int, ...]:
    """Stage boundaries of `blocks` by `config.pipeline.partition`, costed on one micro-batch."""
    boundaries, _ = _split_and_seconds(
        config, blocks, num_stages, num_microbatches, microbatch_x, schedule
    )
    return boundaries


def _split_and_seconds(
    config: TrainConfig,
    blocks: list[keras.layers.Layer],
    num_stages: int,
    num_microbatches: int,
    microbatch_x: np.ndarray,
    schedule: str | Schedule,
) -> tuple[tuple[int, ...], MeasuredStageSeconds | None]:
    """`split_blocks`, with each stage's measured seconds under `--partition=time`; block
    timings are kept in `partition_cost_cache(config)`."""
    from tfmulti.pipeline.stages.block_partition import block_costs, partition_blocks

    if num_stages > len(blocks):
        raise ValueError(
            f"Model {config.model.name!r} has {len(blocks)} blocks, too few for {num_stages} "
            "stages; use fewer stages (--num_stages, pipe in --mesh) or --chunks."
        )
    timed = config.pipeline.partition == "time"
    costs = block_costs(
        blocks, config.pipeline.partition, microbatch_x, partition_cost_cache(config)
    )
    partition = partition_blocks(
        blocks,
        num_stages,
        config.pipeline.partition,
        num_microbatches=num_microbatches,
        # The balancer simulates a built-in schedule of one stage per device; chunked and
        # file schedules are split by 1F1B's model.
        schedule=schedule if isinstance(schedule, str) and config.pipeline.chunks == 1 else "1f1b",
        costs=costs,
    )
    seconds = MeasuredStageSeconds.from_blocks(costs, partition.boundaries) if timed else None
    return partition.boundaries, seconds


def configured_schedule(config: TrainConfig, pipe: int | None = None):
    """`--schedule`: a built-in schedule's name, or the `Schedule` in a .csv file, checked
    against the pipeline's devices (`pipe`, default --num_stages), --chunks and
    --microbatches."""
    name = config.pipeline.schedule
    if not name.endswith(".csv"):
        return name
    from tfmulti.pipeline.schedule_files import read_schedule_csv

    schedule = read_schedule_csv(name)
    pipeline = config.pipeline
    devices_flag = "--num_stages=" if pipe is None else "pipe="
    pipe = pipeline.num_stages if pipe is None else pipe
    expected = (pipe, pipeline.chunks, pipeline.microbatches)
    if (schedule.num_devices, schedule.chunks, schedule.num_microbatches) != expected:
        raise ValueError(
            f"Schedule file {name} runs {schedule.num_stages} stages on "
            f"{schedule.num_devices} devices with {schedule.num_microbatches} micro-batches; "
            f"pass {devices_flag}{schedule.num_devices} --chunks={schedule.chunks} "
            f"--microbatches={schedule.num_microbatches}. Received: {devices_flag}"
            f"{pipe} --chunks={pipeline.chunks} --microbatches={pipeline.microbatches}"
        )
    return schedule


def build_staged_model(
    source: ModelSource,
    config: TrainConfig,
    sample_x: np.ndarray,
    pipelined: bool,
    cluster: ClusterInfo | None = None,
) -> keras.Model:
    """Splits the model's blocks into stages on devices, in a `PipelineModel`.

    A reference model's blocks are split by `partition_blocks`; any other model is cut
    by `PipelineModel.from_model`.

    Args:
        source: the run's model.
        config: the run's settings.
        sample_x: one global batch of inputs, to cost the blocks.
        pipelined: micro-batches on `config.pipeline.schedule` (True), or one batch through the
            stages in turn (False: plain model parallelism).
        cluster: the workers whose devices the stages spread over, in rank order (the
            chief connected to them); None for this host's devices.
    """
    from tfmulti.pipeline.runtime import PipelineModel, stages_from_blocks

    num_microbatches = config.pipeline.microbatches if pipelined else 1
    schedule = configured_schedule(config) if pipelined else "model_parallel"
    chunks = config.pipeline.chunks if pipelined else 1
    purpose = f"--num_stages={config.pipeline.num_stages}"
    devices = (
        devices_across_workers(cluster, config.pipeline.num_stages, purpose)
        if cluster is not None
        else first_logical_devices(config.pipeline.num_stages, purpose)
    )
    check_batch_splits(
        config.data.batch_size,
        num_microbatches,
        f"{num_microbatches} micro-batches (--microbatches)",
    )
    # A rolled step's loop state (stashes, gradient sums) would cross hosts every round:
    # about 40 times the stage-boundary bytes (scripts/benchmark_across_hosts.py).
    rolled = None if config.pipeline.rolled and cluster is None else False
    if not source.is_reference:
        return PipelineModel.from_model(
            source.model(),
            devices,
            num_microbatches,
            schedule,
            chunks=chunks,
            partition=model_partition(config.pipeline.partition),
            remat=config.pipeline.remat,
            rolled=rolled,
            sample_input=sample_x[: config.data.batch_size // num_microbatches],
            cost_cache=partition_cost_cache(config),
        )
    if config.pipeline.partition.startswith("layers:"):
        raise ValueError(
            "Reference models are cut between blocks; use --partition=manual:B1,B2 (block "
            f"indices). Received: --partition={config.pipeline.partition}"
        )
    blocks = source.blocks()
    boundaries, seconds = _split_and_seconds(
        config,
        blocks,
        config.pipeline.num_stages * chunks,
        num_microbatches,
        sample_x[: config.data.batch_size // num_microbatches],
        schedule if pipelined else "1f1b",
    )
    model = PipelineModel(
        stages_from_blocks(blocks, boundaries),
        devices,
        num_microbatches,
        schedule,
        remat=config.pipeline.remat,
        rolled=rolled,
    )
    if seconds is not None:
        setattr(model, MEASURED_SECONDS_ATTRIBUTE, seconds)
    return model
