"""Builds and compiles the model a `TrainConfig` asks for, spread the way `--strategy` names.

The model comes from `tfmulti.spread.model_source` (a reference model or the user's
`package.module:function`); the way of spreading it from `tfmulti.spread.get_spread`.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmulti.cluster import ClusterInfo
from tfmulti.config import TrainConfig
from tfmulti.data import DataInfo
from tfmulti.spread import BuildContext, default_loss_and_metrics, get_spread, model_source


def build_optimizer(name: str, learning_rate: float) -> keras.optimizers.Optimizer:
    """Returns a Keras optimizer by name ("sgd", "adam", ...) with `learning_rate`."""
    return keras.optimizers.get({"class_name": name, "config": {"learning_rate": learning_rate}})


def compile_model(model: keras.Model, config: TrainConfig, loss=None, metrics=None) -> None:
    """Compiles `model` with the optimizer and settings of `config`.

    Args:
        model: the model to compile.
        config: the run's settings.
        loss, metrics: as for `keras.Model.compile`; by default logits against integer
            labels, with accuracy.
    """
    if loss is None:
        loss, metrics = default_loss_and_metrics()
    model.compile(
        optimizer=build_optimizer(config.optimizer, config.learning_rate),
        loss=loss,
        metrics=metrics,
        jit_compile=config.jit_compile,
        steps_per_execution=config.steps_per_execution,
    )


def resolve_run_cluster(config: TrainConfig) -> ClusterInfo | None:
    """The workers the run spans; None for a run on one host."""
    return get_spread(config.strategy).resolve_cluster(config)


def data_parallel_replicas(config: TrainConfig, strategy: tf.distribute.Strategy) -> int:
    """How many ways the global batch is split: the mesh's data size under hybrid."""
    return get_spread(config.strategy).data_replicas(config, strategy)


def make_strategy(config: TrainConfig, cluster: ClusterInfo | None) -> tf.distribute.Strategy:
    """Returns the strategy of `config`: multi-worker over `cluster`, data-parallel on
    this host, or the default strategy for ways that place the model themselves."""
    return get_spread(config.strategy).make_strategy(config, cluster)


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
        sample_x: one global batch of inputs; builds the model and costs its pieces.
        cluster: the workers the run spans (None on one host).
    """
    spread = get_spread(config.strategy)
    source = model_source(config, info)
    context = BuildContext(sample_x, strategy, cluster)
    with spread.scope(strategy):
        model = spread.build(source, config, context)
        compile_model(model, config, *source.loss_and_metrics())
    spread.prepare(model, context)
    return model
