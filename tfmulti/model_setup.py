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
from tfmulti.cluster import ClusterInfo, build_multi_worker_strategy
from tfmulti.config import TrainConfig
from tfmulti.data import DataInfo
from tfmulti.devices import logical_device_names
from tfmulti.names import STAGED_STRATEGY_NAMES
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


def make_strategy(config: TrainConfig, cluster: ClusterInfo | None) -> tf.distribute.Strategy:
    """Returns the strategy of `config`: multi-worker over `cluster`, data-parallel on
    this host, or the default strategy for the staged (pipeline, model-parallel) ones."""
    if config.strategy in STAGED_STRATEGY_NAMES:
        return tf.distribute.get_strategy()
    if cluster is not None:
        return build_multi_worker_strategy(
            cluster, config.communication, config.collective_timeout, config.connect_timeout
        )
    return get_strategy(config.strategy, config.num_devices, config.all_reduce)


def build_compiled_model(
    config: TrainConfig, info: DataInfo, strategy: tf.distribute.Strategy, sample_x: np.ndarray
) -> keras.Model:
    """Builds and compiles the model of `config` for data described by `info`.

    Args:
        config: the run's settings.
        info: the dataset's description (input shape, classes).
        strategy: from `make_strategy(config)`.
        sample_x: one global batch of inputs; builds the model and costs its blocks.
    """
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
    if config.strategy == "model_parallel" and config.placement:
        model = build_placed_model(config, info, sample_x)
    else:
        model = build_staged_model(config, info, sample_x)
    compile_model(model, config)
    model(sample_x)
    return model


def build_placed_model(config: TrainConfig, info: DataInfo, sample_x: np.ndarray) -> keras.Model:
    """Places each layer of the reference model on a device, by `config.placement`."""
    from tfmulti.parallel import place_reference_model

    model = registry.build_model(
        config.model, info.input_shape, info.num_classes, config.seed, **config.model_options
    )
    placed, _ = place_reference_model(
        model,
        _stage_devices(config.num_stages),
        config.placement,
        sample_input=sample_x,
        print_fn=logging.info,
    )
    return placed


def _stage_devices(num_stages: int) -> list[str]:
    devices = logical_device_names()
    if num_stages > len(devices):
        raise ValueError(
            f"--num_stages={num_stages} needs {num_stages} devices but "
            f"{len(devices)} exist; lower --num_stages or raise --virtual_devices."
        )
    return devices[:num_stages]


def build_staged_model(config: TrainConfig, info: DataInfo, sample_x: np.ndarray) -> keras.Model:
    """Splits the reference model's blocks into stages on devices, in a `PipelineModel`."""
    from tfmulti.pipeline.runtime import PipelineModel, partition_blocks, stages_from_blocks

    pipelined = config.strategy == "pipeline"
    num_microbatches = config.microbatches if pipelined else 1
    schedule = config.schedule if pipelined else "model_parallel"
    chunks = config.chunks if pipelined else 1
    devices = _stage_devices(config.num_stages)
    if config.batch_size % num_microbatches:
        raise ValueError(
            f"The global batch must split into {num_microbatches} equal micro-batches. "
            f"Received: batch_size={config.batch_size}; use a multiple of --microbatches."
        )
    blocks = registry.build_blocks(
        config.model, info.input_shape, info.num_classes, config.seed, **config.model_options
    )
    num_stages = config.num_stages * chunks
    if num_stages > len(blocks):
        raise ValueError(
            f"Model {config.model!r} has {len(blocks)} blocks, too few for {num_stages} "
            "stages; lower --num_stages or --chunks."
        )
    partition = partition_blocks(
        blocks,
        num_stages,
        config.partition,
        sample_input=sample_x[: config.batch_size // num_microbatches],
        num_microbatches=num_microbatches,
        schedule=schedule if pipelined and chunks == 1 else "1f1b",
    )
    return PipelineModel(
        stages_from_blocks(blocks, partition.boundaries),
        devices,
        num_microbatches,
        schedule,
        remat=config.remat,
    )
