"""Hybrid parallelism: copies of a pipelined model, one per data replica of `--mesh`."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.config import TrainConfig
from tfmulti.platform.cluster import ClusterInfo, build_multi_worker_strategy
from tfmulti.strategies.base import BuildContext, Spread, check_batch_splits
from tfmulti.strategies.model_source import ModelSource
from tfmulti.strategies.pipeline import model_partition, partition_cost_cache, split_blocks


class Hybrid(Spread):
    """`hybrid`: data x pipe over the devices of this host, or of every worker."""

    def resolve_cluster(self, config: TrainConfig) -> ClusterInfo | None:
        from tfmulti.hybrid import resolve_hybrid_cluster

        return resolve_hybrid_cluster(config.worker_hosts, config.task_index)

    def make_strategy(
        self, config: TrainConfig, cluster: ClusterInfo | None
    ) -> tf.distribute.Strategy:
        if cluster is None:
            return tf.distribute.get_strategy()
        # The strategy only starts the collective runtime; nothing runs in its scope.
        return build_multi_worker_strategy(
            cluster, config.communication, config.collective_timeout, config.connect_timeout
        )

    def data_replicas(self, config: TrainConfig, strategy: tf.distribute.Strategy) -> int:
        from tfmulti.platform.mesh import parse_mesh

        return parse_mesh(config.mesh).data

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        """A `HybridPipelineModel` over fresh copies of the model's blocks, or of the
        user's whole model."""
        from tfmulti.hybrid import build_hybrid_model, build_hybrid_model_from_model
        from tfmulti.platform.mesh import parse_mesh

        mesh = parse_mesh(config.mesh)
        rows_per_step = mesh.data * config.microbatches
        check_batch_splits(
            config.batch_size,
            rows_per_step,
            f"data={mesh.data} replicas x {config.microbatches} micro-batches",
        )
        if not source.is_reference:
            return build_hybrid_model_from_model(
                source.model(),
                mesh,
                config.microbatches,
                config.schedule,
                chunks=config.chunks,
                partition=model_partition(config.partition),
                remat=config.remat,
                sample_input=context.sample_x[: config.batch_size // rows_per_step],
                cluster=context.cluster,
                communication=config.communication,
                collective_timeout=config.collective_timeout,
                cost_cache=partition_cost_cache(config),
            )
        boundaries = split_blocks(
            config,
            source.blocks(),
            mesh.pipe * config.chunks,
            config.microbatches,
            context.sample_x[: config.batch_size // rows_per_step],
            config.schedule,
        )
        return build_hybrid_model(
            source.blocks,
            mesh,
            config.microbatches,
            config.schedule,
            chunks=config.chunks,
            partition_boundaries=boundaries,
            remat=config.remat,
            cluster=context.cluster,
            communication=config.communication,
            collective_timeout=config.collective_timeout,
            make_split_blocks=source.build_split_blocks,
        )

    def prepare(self, model: keras.Model, context: BuildContext) -> None:
        """Builds every replica on one batch."""
        model(context.sample_x)
