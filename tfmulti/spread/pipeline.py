"""Pipeline parallelism: the model cut into stages on devices, micro-batches on a schedule."""

from __future__ import annotations

import keras
import numpy as np

from tfmulti.config import TrainConfig
from tfmulti.devices import first_logical_devices
from tfmulti.spread.base import BuildContext, DeviceSpread, check_batch_splits
from tfmulti.spread.model_source import ModelSource


class Pipeline(DeviceSpread):
    """`pipeline`: `--num_stages` stages, `--microbatches` per step, on `--schedule`."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        return build_staged_model(source, config, context.sample_x, pipelined=True)


def require_blocks(source: ModelSource, config: TrainConfig) -> None:
    """Raises a one-line ValueError for a model that has no block list to cut into stages."""
    # Connect PipelineModel.from_model here when it lands: it cuts any functional model,
    # so a user's model will no longer need a block list.
    if not source.is_reference:
        raise ValueError(
            f"--strategy={config.strategy} cuts the reference models' block lists; a model "
            "from package.module:function cannot be pipelined from the script yet. Use "
            "--strategy=model_parallel (layer placement) or a data-parallel strategy. "
            f"Received: --model={source.name}"
        )


def split_blocks(
    config: TrainConfig,
    blocks: list[keras.layers.Layer],
    num_stages: int,
    num_microbatches: int,
    microbatch_x: np.ndarray,
    schedule: str,
) -> tuple[int, ...]:
    """Stage boundaries of `blocks` by `config.partition`, costed on one micro-batch."""
    from tfmulti.pipeline.runtime import partition_blocks

    if num_stages > len(blocks):
        raise ValueError(
            f"Model {config.model!r} has {len(blocks)} blocks, too few for {num_stages} "
            "stages; use fewer stages (--num_stages, pipe in --mesh) or --chunks."
        )
    partition = partition_blocks(
        blocks,
        num_stages,
        config.partition,
        sample_input=microbatch_x,
        num_microbatches=num_microbatches,
        # The balancer simulates one stage per device; interleaved splits use 1F1B's model.
        schedule=schedule if config.chunks == 1 else "1f1b",
    )
    return partition.boundaries


def build_staged_model(
    source: ModelSource, config: TrainConfig, sample_x: np.ndarray, pipelined: bool
) -> keras.Model:
    """Splits the model's blocks into stages on devices, in a `PipelineModel`.

    Args:
        source: the run's model; must have a block list.
        config: the run's settings.
        sample_x: one global batch of inputs, to cost the blocks.
        pipelined: micro-batches on `config.schedule` (True), or one batch through the
            stages in turn (False: plain model parallelism).
    """
    from tfmulti.pipeline.runtime import PipelineModel, stages_from_blocks

    require_blocks(source, config)
    num_microbatches = config.microbatches if pipelined else 1
    schedule = config.schedule if pipelined else "model_parallel"
    chunks = config.chunks if pipelined else 1
    devices = first_logical_devices(config.num_stages, f"--num_stages={config.num_stages}")
    check_batch_splits(
        config.batch_size, num_microbatches, f"{num_microbatches} micro-batches (--microbatches)"
    )
    blocks = source.blocks()
    boundaries = split_blocks(
        config,
        blocks,
        config.num_stages * chunks,
        num_microbatches,
        sample_x[: config.batch_size // num_microbatches],
        config.schedule if pipelined else "1f1b",
    )
    return PipelineModel(
        stages_from_blocks(blocks, boundaries),
        devices,
        num_microbatches,
        schedule,
        remat=config.remat,
    )
