"""The questions every way of spreading a Keras model over devices answers."""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmulti.config import TrainConfig
from tfmulti.platform.runtime.cluster import (
    ClusterError,
    ClusterInfo,
    resolve_cluster,
    resolve_cluster_if_described,
)
from tfmulti.platform.runtime.connected_cluster import connect_to_workers
from tfmulti.platform.runtime.optimizer_devices import place_optimizer_on_variable_devices
from tfmulti.strategies.model_source import ModelSource


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a run knows when it builds its model.

    Args:
        sample_x: one global batch of inputs; builds the model and costs its pieces.
        strategy: the run's strategy, from `TrainingStrategy.make_strategy`.
        cluster: the workers the run spans; None on one host.
    """

    sample_x: np.ndarray
    strategy: tf.distribute.Strategy
    cluster: ClusterInfo | None = None


class TrainingStrategy:
    """One way of spreading a Keras model over devices, picked by `--strategy`.

    A subclass answers `build`: take the run's model (or its builder) and config, and
    return a model that `compile`/`fit` train and `save` exports. The other questions have
    defaults for ways that run outside any tf.distribute strategy.

    Example:
        >>> training_strategy = get_training_strategy("mirrored")
        >>> cluster = training_strategy.resolve_cluster(config)
        >>> strategy = training_strategy.make_strategy(config, cluster)
        >>> with training_strategy.scope(strategy):
        ...     model = training_strategy.build(source, config, BuildContext(x[:64], strategy))
    """

    def resolve_cluster(self, config: TrainConfig) -> ClusterInfo | None:
        """The workers the run spans; None for a run on one host.

        Raises:
            ValueError: this process is one of several workers (`--worker_hosts`,
                `TF_CONFIG` as `scripts/launch.py` sets it, or a SLURM step), which would
                each train alone and write the same `--model_dir`.
        """
        try:
            cluster = resolve_cluster(config.cluster.worker_hosts, config.cluster.task_index)
        except ClusterError:
            return None  # no cluster described: one host
        if cluster.num_workers > 1:
            raise ValueError(
                f"--strategy={config.distribution.strategy} trains on one host, but this "
                "process is "
                f"worker {cluster.task_index} of {cluster.num_workers} ({cluster.source}); "
                "use --strategy=multi_worker, pipeline or hybrid across workers, or run it alone."
            )
        return None

    # True when, across workers, only the chief trains and the others lend it their
    # devices (`tfmulti.platform.runtime.connected_cluster.serve_chief`, which `train` calls there).
    chief_drives_workers = False

    def serves_chief(self, cluster: ClusterInfo | None) -> bool:
        """Whether this worker of `cluster` lends its devices to a chief that drives them
        instead of training (call after `resolve_cluster`)."""
        return cluster is not None and not cluster.is_chief and self.chief_drives_workers

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        """The tf.distribute strategy the run feeds its data through."""
        return tf.distribute.get_strategy()

    def data_replicas(self, config: TrainConfig, strategy: tf.distribute.Strategy) -> int:
        """How many ways the global batch is split."""
        return strategy.num_replicas_in_sync

    def scope(self, strategy: tf.distribute.Strategy) -> contextlib.AbstractContextManager:
        """The scope the model is built and compiled in."""
        return contextlib.nullcontext()

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        """Returns the run's model spread this way, ready to compile."""
        raise NotImplementedError

    def prepare(self, model: keras.Model, context: BuildContext) -> None:
        """Finishes a compiled model before training (nothing by default)."""

    # True when each worker feeds only its own rows of every global batch (`worker_rows`)
    # instead of tf.data's auto-sharding splitting the input between workers.
    feeds_worker_rows = False

    def worker_rows(self, train: tf.data.Dataset, cluster: ClusterInfo) -> tf.data.Dataset:
        """This worker's rows of every global batch of `train` (see `feeds_worker_rows`)."""
        raise NotImplementedError

    def one_copy(self, model: keras.Model) -> keras.Model:
        """The model as one copy of the user's model, to count its parameters."""
        return model

    def finish_callbacks(
        self, callbacks: list[keras.callbacks.Callback], cluster: ClusterInfo | None
    ) -> None:
        """Adjusts the run's callbacks to this way of training (nothing by default)."""


class DevicePlacingStrategy(TrainingStrategy):
    """A way that puts pieces of the model on devices itself, without a strategy."""

    def prepare(self, model: keras.Model, context: BuildContext) -> None:
        """Keeps optimizer state beside its variables and builds the model on one batch."""
        place_optimizer_on_variable_devices(model.optimizer)
        model(context.sample_x)


class ChiefDrivenStrategy(TrainingStrategy):
    """A way that, across workers, has the chief drive every worker's devices as its own
    (`tfmulti.platform.runtime.connected_cluster`); the other workers serve it."""

    chief_drives_workers = True

    def resolve_cluster(self, config: TrainConfig) -> ClusterInfo | None:
        return resolve_cluster_if_described(config.cluster.worker_hosts, config.cluster.task_index)

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        """Connects to the workers, if any; the run feeds its data to the chief alone."""
        if cluster is not None:
            connect_to_workers(cluster, config.cluster.connect_timeout, config.cluster.agreed_flags)
        return tf.distribute.get_strategy()


def check_batch_splits(batch_size: int, parts: int, what: str) -> None:
    """Raises a one-line ValueError unless the global batch gives each of `parts` a row.

    Pipelines split any batch into near-equal parts; a part that never gets a row would
    only run empty work every step.
    """
    if batch_size < parts:
        raise ValueError(
            f"The global batch must give each of {what} at least one row. Received: "
            f"batch_size={batch_size}; use at least {parts}."
        )
