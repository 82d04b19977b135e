"""Data parallelism: a copy of the whole model on every device, the batch split between them."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfmulti.config import TrainConfig
from tfmulti.platform.runtime.cluster import (
    ClusterInfo,
    build_multi_worker_strategy,
    resolve_cluster,
)
from tfmulti.platform.runtime.distribute_strategy import get_strategy
from tfmulti.strategies.base import BuildContext, TrainingStrategy
from tfmulti.strategies.model_source import ModelSource


class DataParallel(TrainingStrategy):
    """`one_device` and `mirrored`: the model built in the strategy's scope, on this host."""

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        return get_strategy(
            config.distribution.strategy,
            config.distribution.num_devices,
            config.distribution.all_reduce,
        )

    def scope(self, strategy: tf.distribute.Strategy) -> contextlib.AbstractContextManager:
        return strategy.scope()

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        """The model itself; the strategy mirrors its variables, built in `scope`."""
        return source.model()


class MultiWorkerDataParallel(DataParallel):
    """`multi_worker`: data parallelism over the devices of every worker."""

    def resolve_cluster(self, config: TrainConfig) -> ClusterInfo | None:
        return resolve_cluster(config.cluster.worker_hosts, config.cluster.task_index)

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        if cluster is None:
            return super().make_strategy(config, cluster)
        return build_multi_worker_strategy(
            cluster,
            config.cluster.communication,
            config.cluster.collective_timeout,
            config.cluster.connect_timeout,
        )
