"""Builds the model a `TrainConfig` asks for: data-parallel under a strategy, or pipelined.

Data-parallel strategies build the reference model inside `strategy.scope()`;
"pipeline" and "model_parallel" split its block list into stages on devices and
wrap them in a `PipelineModel`.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from models import registry
from tfmulti.cluster import ClusterInfo, build_multi_worker_strategy, resolve_cluster
from tfmulti.config import TrainConfig
from tfmulti.data import DataInfo
from tfmulti.devices import first_logical_devices
from tfmulti.names import HYBRID_STRATEGY_NAME, STAGED_STRATEGY_NAMES
from tfmulti.pipeline.runtime.optimizer_placement import place_optimizer_on_variable_devices
from tfmulti.strategy import get_strategy


def build_optimizer(name: str, learning_rate: float) -> keras.optimizers.Optimizer:
    """Returns a Keras optimizer by name ("sgd", "adam", ...) with `learning_rate`."""
    return keras.optimizers.get({"class_name": name, "config": {"learning_rate": learning_rate}})


def compile_model(model: keras.Model, config: TrainConfig) -> None:
    """Compiles `model` with the optimizer and settings of `config` (logits, integer labels)."""
    model.compile(
        optimizer=build_optimizer(config.optimizer, config.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=config.jit_compile,
        steps_per_execution=config.steps_per_execution,
    )


def resolve_run_cluster(config: TrainConfig) -> ClusterInfo | None:
    """The workers a multi-worker or hybrid run spans; None for a run on one host."""
    if config.strategy == "multi_worker":
        return resolve_cluster(config.worker_hosts, config.task_index)
    if config.strategy == HYBRID_STRATEGY_NAME:
        from tfmulti.hybrid import resolve_hybrid_cluster

        return resolve_hybrid_cluster(config.worker_hosts, config.task_index)
    return None


def data_parallel_replicas(config: TrainConfig, strategy: tf.distribute.Strategy) -> int:
    """How many ways the global batch is split: the mesh's data size under hybrid."""
    if config.strategy == HYBRID_STRATEGY_NAME:
        from tfmulti.mesh import parse_mesh

        return parse_mesh(config.mesh).data
    return strategy.num_replicas_in_sync


def make_strategy(config: TrainConfig, cluster: ClusterInfo | None) -> tf.distribute.Strategy:
    """Returns the strategy of `config`: multi-worker over `cluster`, data-parallel on
    this host, or the default strategy for the staged (pipeline, model-parallel) ones."""
    if config.strategy in STAGED_STRATEGY_NAMES or (
        config.strategy == HYBRID_STRATEGY_NAME and cluster is None
    ):
        return tf.distribute.get_strategy()
    if cluster is not None:
        # Under hybrid the strategy only starts the collective runtime; nothing runs in
        # its scope.
        return build_multi_worker_strategy(
            cluster, config.communication, config.collective_timeout, config.connect_timeout
        )
    return get_strategy(config.strategy, config.num_devices, config.all_reduce)


def build_compiled_model(
    config: TrainConfig,
    info: DataInfo,
    strategy: tf.distribute.Strategy,
    sample_x: np.ndarray,
    cluster: ClusterInfo | None = None,
) -> keras.Model:
    """Builds and compiles the model of `config` for data described by `info`.

    Args:
        config: the run's settings.
        info: the dataset's description (input shape, classes).
        strategy: from `make_strategy(config)`.
        sample_x: one global batch of inputs; builds the model and costs its blocks.
        cluster: the workers a hybrid run spans (None on one host).
    """
    if config.strategy == HYBRID_STRATEGY_NAME:
        model = build_hybrid(config, info, sample_x, cluster)
        compile_model(model, config)
        model(sample_x)
        return model
    if config.strategy not in STAGED_STRATEGY_NAMES:
        with strategy.scope():
            model = registry.build_model(
                config.model,
                info.input_shape,
                info.num_classes,
                config.seed,
                **config.model_options,
            )
            compile_model(model, config)
        return model
    if config.tensor_parallel > 1:
        model = build_tensor_parallel_model(config, info)
    elif config.strategy == "model_parallel" and config.placement:
        model = build_placed_model(config, info, sample_x)
    else:
        model = build_staged_model(config, info, sample_x)
    compile_model(model, config)
    # Every staged model keeps optimizer state beside its variables (idempotent).
    place_optimizer_on_variable_devices(model.optimizer)
    model(sample_x)
    return model


def build_tensor_parallel_model(config: TrainConfig, info: DataInfo) -> keras.Model:
    """The reference model with its layers split over `config.tensor_parallel` devices."""
    return registry.build_model(
        config.model,
        info.input_shape,
        info.num_classes,
        config.seed,
        tensor_parallel=config.tensor_parallel,
        **config.model_options,
    )


def build_placed_model(config: TrainConfig, info: DataInfo, sample_x: np.ndarray) -> keras.Model:
    """Places each layer of the reference model on a device, by `config.placement`."""
    from tfmulti.parallel import place_reference_model

    model = registry.build_model(
        config.model, info.input_shape, info.num_classes, config.seed, **config.model_options
    )
    placed, _ = place_reference_model(
        model,
        first_logical_devices(config.num_stages, f"--num_stages={config.num_stages}"),
        config.placement,
        sample_input=sample_x,
        print_fn=logging.info,
    )
    return placed


def _reference_blocks(config: TrainConfig, info: DataInfo) -> list[keras.layers.Layer]:
    """The reference model's blocks, freshly built (same seed, same weights every call)."""
    return registry.build_blocks(
        config.model, info.input_shape, info.num_classes, config.seed, **config.model_options
    )


def _split_blocks(
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


def _check_batch_splits(batch_size: int, parts: int, what: str) -> None:
    if batch_size % parts:
        raise ValueError(
            f"The global batch must split into {what}. Received: batch_size={batch_size}; "
            f"use a multiple of {parts}."
        )


def build_staged_model(config: TrainConfig, info: DataInfo, sample_x: np.ndarray) -> keras.Model:
    """Splits the reference model's blocks into stages on devices, in a `PipelineModel`."""
    from tfmulti.pipeline.runtime import PipelineModel, stages_from_blocks

    pipelined = config.strategy == "pipeline"
    num_microbatches = config.microbatches if pipelined else 1
    schedule = config.schedule if pipelined else "model_parallel"
    chunks = config.chunks if pipelined else 1
    devices = first_logical_devices(config.num_stages, f"--num_stages={config.num_stages}")
    _check_batch_splits(
        config.batch_size, num_microbatches, f"{num_microbatches} micro-batches (--microbatches)"
    )
    blocks = _reference_blocks(config, info)
    boundaries = _split_blocks(
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


def build_hybrid(
    config: TrainConfig, info: DataInfo, sample_x: np.ndarray, cluster: ClusterInfo | None
) -> keras.Model:
    """Copies of the pipelined reference model, one per data replica of `config.mesh`."""
    from tfmulti.hybrid import build_hybrid_model
    from tfmulti.mesh import parse_mesh

    mesh = parse_mesh(config.mesh)
    rows_per_step = mesh.data * config.microbatches
    _check_batch_splits(
        config.batch_size,
        rows_per_step,
        f"data={mesh.data} replicas x {config.microbatches} micro-batches",
    )
    boundaries = _split_blocks(
        config,
        _reference_blocks(config, info),
        mesh.pipe * config.chunks,
        config.microbatches,
        sample_x[: config.batch_size // rows_per_step],
        config.schedule,
    )
    return build_hybrid_model(
        lambda: _reference_blocks(config, info),
        mesh,
        config.microbatches,
        config.schedule,
        chunks=config.chunks,
        partition_boundaries=boundaries,
        remat=config.remat,
        cluster=cluster,
        communication=config.communication,
        collective_timeout=config.collective_timeout,
    )
