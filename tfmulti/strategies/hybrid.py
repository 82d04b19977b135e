"""Hybrid parallelism: copies of a pipelined model, one per data replica of `--mesh`."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.compat import worker_paths
from tfmulti.config import TrainConfig
from tfmulti.platform.mesh import HybridMesh, parse_mesh, resolve_data_axis
from tfmulti.platform.runtime.cluster import (
    ClusterInfo,
    build_multi_worker_strategy,
    resolve_cluster_if_described,
)
from tfmulti.platform.runtime.connected_cluster import connect_to_workers
from tfmulti.strategies.base import BuildContext, TrainingStrategy, check_batch_splits
from tfmulti.strategies.model_source import ModelSource
from tfmulti.strategies.pipeline import (
    configured_schedule,
    model_partition,
    partition_cost_cache,
    refuse_python_calls,
    split_blocks,
)


class Hybrid(TrainingStrategy):
    """`hybrid`: data x pipe over the devices of this host, or of every worker.

    Across workers, `--cross_host_axis` picks the mesh axis that crosses hosts: "data"
    (each worker trains whole pipelines and the workers sum gradients with collectives) or
    "pipe" (the chief connects to the cluster and drives every replica's stages on all
    workers' devices; the other workers only serve).
    """

    def __init__(self):
        self._pipe_crosses_hosts = False
        self._cluster = None

    def resolve_cluster(self, config: TrainConfig) -> ClusterInfo | None:
        cluster = resolve_cluster_if_described(
            config.cluster.worker_hosts, config.cluster.task_index
        )
        # Kept for `chief_drives_workers` and `feeds_worker_rows`, which the run reads
        # without its config, after this call.
        self._pipe_crosses_hosts = _pipe_crosses_hosts(config, cluster)
        self._cluster = cluster
        if config.distribution.zero:
            from tfmulti.hybrid.data_owners import check_zero_stage

            # Before any worker connects: each worker would otherwise wait for the others.
            check_zero_stage(
                config.distribution.zero,
                data_axis_across_workers=cluster is not None and not self._pipe_crosses_hosts,
            )
        return cluster

    @property
    def chief_drives_workers(self) -> bool:
        return self._pipe_crosses_hosts

    @property
    def feeds_worker_rows(self) -> bool:
        """Each worker feeds its own rows of every global batch when the data axis crosses
        the workers; with the pipe axis across them the chief alone feeds every row."""
        return not self._pipe_crosses_hosts

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        if cluster is None:
            return tf.distribute.get_strategy()
        if _pipe_crosses_hosts(config, cluster):
            connect_to_workers(cluster, config.cluster.connect_timeout, config.cluster.agreed_flags)
            return tf.distribute.get_strategy()
        # The strategy only starts the collective runtime; nothing runs in its scope.
        return build_multi_worker_strategy(
            cluster,
            config.cluster.communication,
            config.cluster.collective_timeout,
            config.cluster.connect_timeout,
        )

    def data_replicas(self, config: TrainConfig, strategy: tf.distribute.Strategy) -> int:
        return self.mesh(config).data

    def mesh(self, config: TrainConfig) -> HybridMesh:
        """`--mesh`, with `data=auto` filled by the replicas the run's devices hold: every
        worker's (an elastic job's mesh follows the workers it has)."""
        from tfmulti.hybrid.build import local_device_names
        from tfmulti.platform.runtime.devices import logical_device_names

        text = config.distribution.mesh
        if resolve_data_axis(text, None) == text:
            return parse_mesh(text)
        if self._cluster is None or self._pipe_crosses_hosts:
            num_devices = len(logical_device_names())
        else:
            num_devices = len(local_device_names(self._cluster)) * self._cluster.num_workers
        return parse_mesh(resolve_data_axis(text, num_devices))

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        """A `HybridPipelineModel` over fresh copies of the model's blocks, or of the
        user's whole model; with `--zero`, its optimizer state sharded over the data axis."""
        model = self._build_replicas(source, config, context)
        if config.distribution.zero:
            model.shard_over_data_axis(config.distribution.zero)
        return model

    def _build_replicas(
        self, source: ModelSource, config: TrainConfig, context: BuildContext
    ) -> keras.Model:
        from tfmulti.hybrid import build_hybrid_model, build_hybrid_model_from_model

        mesh = self.mesh(config)
        schedule = configured_schedule(config, pipe=mesh.pipe)
        rows_per_step = mesh.data * config.pipeline.microbatches
        check_batch_splits(
            config.data.batch_size,
            rows_per_step,
            f"data={mesh.data} replicas x {config.pipeline.microbatches} micro-batches",
        )
        if not source.is_reference:
            return build_hybrid_model_from_model(
                source.model(),
                mesh,
                config.pipeline.microbatches,
                schedule,
                chunks=config.pipeline.chunks,
                partition=model_partition(config.pipeline.partition),
                remat=config.pipeline.remat,
                sample_input=context.sample_x[: config.data.batch_size // rows_per_step],
                cluster=context.cluster,
                communication=config.cluster.communication,
                collective_timeout=config.cluster.collective_timeout,
                cost_cache=partition_cost_cache(config),
                cross_host_axis=config.distribution.cross_host_axis,
            )
        boundaries = split_blocks(
            config,
            source.blocks(),
            mesh.pipe * config.pipeline.chunks,
            config.pipeline.microbatches,
            context.sample_x[: config.data.batch_size // rows_per_step],
            schedule,
        )
        return build_hybrid_model(
            source.blocks,
            mesh,
            config.pipeline.microbatches,
            schedule,
            chunks=config.pipeline.chunks,
            partition_boundaries=boundaries,
            remat=config.pipeline.remat,
            cluster=context.cluster,
            communication=config.cluster.communication,
            collective_timeout=config.cluster.collective_timeout,
            make_split_blocks=source.build_split_blocks,
            cross_host_axis=config.distribution.cross_host_axis,
        )

    def prepare(self, model: keras.Model, context: BuildContext) -> None:
        """Refuses, in one line, a stage on another worker that calls Python (each
        replica's stage s shares replica 0's worker); then builds every replica on one
        batch."""
        refuse_python_calls(model.replicas[0], context.sample_x)
        model(context.sample_x)

    def worker_rows(self, train: tf.data.Dataset, cluster: ClusterInfo) -> tf.data.Dataset:
        """This worker's rows of every global batch, with the data axis across workers
        (each worker still validates on the whole validation split, so all report the
        same)."""
        from tfmulti.hybrid import worker_rows

        return worker_rows(train, cluster)

    def one_copy(self, model: keras.Model) -> keras.Model:
        """One data replica: the others are its copies."""
        return model.replicas[0]

    def finish_callbacks(
        self, callbacks: list[keras.callbacks.Callback], cluster: ClusterInfo | None
    ) -> None:
        """Sends a non-chief worker's callbacks to scratch: no multi-worker strategy scope
        runs here, so the compat fix of Keras' callbacks does not redirect them."""
        if cluster is not None and not cluster.is_chief:
            worker_paths.redirect_to_scratch(callbacks, worker_paths.scratch_dir())


def _pipe_crosses_hosts(config: TrainConfig, cluster: ClusterInfo | None) -> bool:
    return cluster is not None and config.distribution.cross_host_axis == "pipe"
