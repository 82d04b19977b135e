"""`--zero=1|2|3` under `mirrored` and `multi_worker`: data parallelism with sharded state.

The model is built whole on the host, then handed to `ZeroDataParallel`, which cuts its
weights into blocks over the data-parallel devices. On one host those are its logical
devices; across workers the chief drives every worker's devices in one program (as a
pipeline across workers does), so the blocks, and the optimizer state beside them, sit
on every worker.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfmulti.config import TrainConfig
from tfmulti.platform.runtime.cluster import ClusterInfo
from tfmulti.platform.runtime.connected_cluster import devices_across_workers
from tfmulti.platform.runtime.devices import (
    accelerator_type,
    first_logical_devices,
    logical_device_names,
)
from tfmulti.strategies.base import (
    BuildContext,
    ChiefDrivenStrategy,
    TrainingStrategy,
    check_batch_splits,
)
from tfmulti.strategies.model_source import ModelSource


class ZeroDataParallelStrategy(ChiefDrivenStrategy):
    """`mirrored` or `multi_worker` with `--zero` > 0; across workers the chief drives."""

    def __init__(self, across_workers: bool):
        self.across_workers = across_workers

    def resolve_cluster(self, config: TrainConfig) -> ClusterInfo | None:
        if not self.across_workers:
            return TrainingStrategy.resolve_cluster(self, config)
        return super().resolve_cluster(config)

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        strategy = super().make_strategy(config, cluster)
        self._devices = _data_devices(config, cluster)
        return strategy

    def data_replicas(self, config: TrainConfig, strategy: tf.distribute.Strategy) -> int:
        return len(self._devices)

    def scope(self, strategy: tf.distribute.Strategy) -> contextlib.AbstractContextManager:
        # The whole model is built once, on the host, before its weights are cut up.
        return tf.device(logical_device_names("CPU")[0])

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        from tfmulti.zero import ZeroDataParallel

        check_batch_splits(config.data.batch_size, len(self._devices), "the data-parallel devices")
        model = source.model()
        if not model.built:
            model(context.sample_x[:1])
        return ZeroDataParallel(model, self._devices, config.distribution.zero)

    def one_copy(self, model: keras.Model) -> keras.Model:
        return model.plain_model


def _data_devices(config: TrainConfig, cluster: ClusterInfo | None) -> tuple[str, ...]:
    """The data axis: this host's devices (`--num_devices`), or every worker's alike."""
    if cluster is None:
        count = config.distribution.num_devices or len(logical_device_names(accelerator_type()))
        return tuple(first_logical_devices(count, f"--zero={config.distribution.zero}"))
    # Connected, the chief lists every worker's devices as its own.
    every_device = len(logical_device_names(accelerator_type()))
    per_worker = config.distribution.num_devices
    count = per_worker * cluster.num_workers if per_worker else every_device
    return tuple(devices_across_workers(cluster, count, f"--zero={config.distribution.zero}"))
