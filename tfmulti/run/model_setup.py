"""Builds and compiles the model a `TrainConfig` asks for, spread as `--strategy` names.

The model comes from `tfmulti.strategies.model_source` (a reference model or the user's
`package.module:function`); the way of spreading it from
`tfmulti.strategies.get_training_strategy`; the optimizer from the user's own compile, or
from the config (`choose_optimizer`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti.compat import keras_internals
from tfmulti.config import TrainConfig
from tfmulti.data import DataInfo
from tfmulti.platform.runtime.cluster import ClusterInfo
from tfmulti.run.lr_schedules import describe_learning_rate, learning_rate_schedule
from tfmulti.strategies import (
    BuildContext,
    default_loss_and_metrics,
    get_training_strategy,
    model_source,
)
from tfmulti.strategies.model_source import ModelSource


def build_optimizer(
    name: str,
    learning_rate: float,
    lr_schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int = 1,
) -> keras.optimizers.Optimizer:
    """Returns a Keras optimizer by name ("sgd", "adam", ...) whose rate follows `lr_schedule`.

    Args:
        name: one of `tfmulti.config.OPTIMIZER_NAMES`.
        learning_rate: the peak learning rate.
        lr_schedule, warmup_steps, total_steps: see
            `tfmulti.run.lr_schedules.learning_rate_schedule`.

    Example:
        >>> build_optimizer("sgd", 0.1, "cosine", warmup_steps=10, total_steps=100)
    """
    rate = learning_rate_schedule(lr_schedule, learning_rate, warmup_steps, total_steps)
    return keras.optimizers.get({"class_name": name, "config": {"learning_rate": rate}})


def run_steps(config: TrainConfig, info: DataInfo) -> int:
    """Steps the whole run trains: epochs times the steps of one epoch."""
    steps_per_epoch = (
        config.run.steps_per_epoch or info.num_train_examples // config.data.batch_size
    )
    return max(1, steps_per_epoch) * config.run.epochs


def choose_optimizer(
    config: TrainConfig, source: ModelSource, total_steps: int
) -> keras.optimizers.Optimizer:
    """The optimizer the run trains with, and a log line saying which it is.

    The user's function's own optimizer (a copy, schedule included) when it compiled the
    model and `config.optimizer.keep_compiled` holds; else the one `config` names.
    """
    compiled = source.compiled_optimizer() if config.optimizer.keep_compiled else None
    if compiled is not None:
        inner = getattr(compiled, "inner_optimizer", compiled)
        logging.info(
            "Optimizer: %s, learning rate %s, as --model=%s compiled it (--optimizer, "
            "--learning_rate, --lr_schedule or --warmup_steps would replace it).",
            type(inner).__name__,
            describe_learning_rate(keras_internals.learning_rate_setting(inner)),
            config.model.name,
        )
        return compiled
    optimizer = build_optimizer(
        config.optimizer.name,
        config.optimizer.learning_rate,
        config.optimizer.lr_schedule,
        config.optimizer.warmup_steps,
        total_steps,
    )
    logging.info(
        "Optimizer: %s, learning rate %s.",
        type(optimizer).__name__,
        describe_learning_rate(keras_internals.learning_rate_setting(optimizer)),
    )
    return optimizer


def compile_model(
    model: keras.Model,
    config: TrainConfig,
    optimizer: keras.optimizers.Optimizer,
    loss=None,
    metrics=None,
) -> None:
    """Compiles `model` with `optimizer` and the settings of `config`.

    Args:
        model: the model to compile.
        config: the run's settings.
        optimizer: the optimizer to train with (see `choose_optimizer`).
        loss, metrics: as for `keras.Model.compile`; by default logits against integer
            labels, with accuracy.
    """
    if loss is None:
        loss, metrics = default_loss_and_metrics()
    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=metrics,
        jit_compile=config.model.jit_compile,
        steps_per_execution=config.run.steps_per_execution,
    )


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
        strategy: from the training strategy's `make_strategy`.
        sample_x: one global batch of inputs; builds the model and costs its pieces.
        cluster: the workers the run spans (None on one host).
    """
    training_strategy = get_training_strategy(
        config.distribution.strategy, config.distribution.zero
    )
    source = model_source(config, info)
    context = BuildContext(sample_x, strategy, cluster)
    with training_strategy.scope(strategy):
        model = training_strategy.build(source, config, context)
        optimizer = choose_optimizer(config, source, run_steps(config, info))
        compile_model(model, config, optimizer, *source.loss_and_metrics())
    training_strategy.prepare(model, context)
    return model
