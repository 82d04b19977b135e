"""Builds a hybrid data x pipeline model from a block list and a mesh, on one host or many."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from tfmulti.collectives.worker_sums import WorkerCollectives
from tfmulti.compat import keras_internals
from tfmulti.costing.cost_cache import CostCache
from tfmulti.hybrid.hybrid_model import HybridPipelineModel
from tfmulti.pipeline.runtime.pipeline_model import PipelineModel
from tfmulti.pipeline.stages.block_partition import partition_blocks, stages_from_blocks
from tfmulti.platform.mesh import HybridMesh, MeshError, parse_mesh
from tfmulti.platform.runtime.cluster import ClusterInfo
from tfmulti.platform.runtime.connected_cluster import mesh_groups_across_workers
from tfmulti.platform.runtime.devices import logical_device_names

# The mesh axes that may be laid across workers (`--cross_host_axis`).
CROSS_HOST_AXES = ("data", "pipe")


def local_device_names(cluster: ClusterInfo | None = None) -> list[str]:
    """This worker's logical accelerator (or CPU) devices, in index order.

    Once the collective runtime runs, TensorFlow lists every worker's devices; only the
    ones of `cluster`'s own task are kept.
    """
    names = logical_device_names()
    if cluster is None:
        return names
    job, task = cluster.task()
    local = []
    for name in names:
        spec = tf.DeviceSpec.from_string(name)
        if spec.job is None or (spec.job == job and spec.task == task):
            local.append(name)
    return local


def build_hybrid_model(
    make_blocks: Callable[[], Sequence[keras.layers.Layer]],
    mesh: HybridMesh | str,
    num_microbatches: int,
    schedule: str = "1f1b",
    chunks: int = 1,
    partition_boundaries: Sequence[int] | None = None,
    remat: bool = False,
    devices: Sequence[str] | None = None,
    cluster: ClusterInfo | None = None,
    communication: str = "auto",
    collective_timeout: float | None = None,
    make_split_blocks: Callable[[list[str]], Sequence[keras.layers.Layer]] | None = None,
    cross_host_axis: str = "pipe",
) -> HybridPipelineModel:
    """Builds a `HybridPipelineModel`: pipe x chunks stages per replica, data replicas,
    and with tensor > 1 each stage's layers split over its group of tensor devices.

    Across workers, the data axis or the pipe axis crosses the hosts (`cross_host_axis`).
    With "data", build `tfmulti.platform.runtime.cluster.build_multi_worker_strategy(cluster, ...)`
    first (before any other TensorFlow work): it starts the collective runtime the gradient
    sums use, and each worker runs data / num_workers replicas on its own devices. With
    "pipe", the chief alone builds the model after
    `tfmulti.platform.runtime.connected_cluster.connect_to_workers(cluster)`: every replica's stages
    go over the workers' devices (`mesh_groups_across_workers`), in one program.

    Args:
        make_blocks: returns the model's unbuilt blocks in order, the same model at every
            call (e.g. a seeded `tfmulti.models.registry.build_blocks`); called once per replica.
        mesh: a `HybridMesh` or text like "data=2,pipe=2".
        num_microbatches: micro-batches per replica per step (m).
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "zb_h1" or "zb_h2".
        chunks: stages per device (v), for "interleaved_1f1b".
        partition_boundaries: first block of each stage after the first (pipe x chunks - 1
            of them), e.g. `partition_blocks(...).boundaries`; None splits evenly.
        remat: recompute each stage's forward in its backward.
        devices: this worker's devices; default all of its logical devices.
        cluster: the cluster when the mesh spans workers; None on one host.
        communication: collective implementation across workers: "auto", "ring", "nccl".
        collective_timeout: seconds before a stuck cross-worker sum fails; None waits.
        make_split_blocks: for tensor > 1: returns the same blocks with their layers split
            over the given devices (e.g. the reference Transformer's
            `tensor_parallel_devices`); each stage takes its own blocks from a call with
            its group of devices.
        cross_host_axis: the mesh axis laid across `cluster`'s workers: "data" or "pipe".

    Raises:
        MeshError: the mesh does not fit the devices, or asks for tensor > 1 without
            `make_split_blocks` or with chunks > 1.

    Example:
        >>> model = build_hybrid_model(
        ...     lambda: registry.build_blocks("mlp", (64,), 10, seed=0), "data=2,pipe=2",
        ...     num_microbatches=4, schedule="zb_h1")
    """
    mesh, groups, collectives = _hybrid_layout(
        mesh, devices, cluster, communication, collective_timeout, cross_host_axis
    )
    num_stages = mesh.pipe * chunks
    if partition_boundaries is None:
        partition_boundaries = partition_blocks(make_blocks(), num_stages).boundaries
    if len(partition_boundaries) != num_stages - 1:
        raise ValueError(
            f"Mesh pipe={mesh.pipe} x chunks={chunks} makes {num_stages} stages, which need "
            f"{num_stages - 1} boundaries. Received: partition_boundaries="
            f"{list(partition_boundaries)}"
        )
    replica_devices = [[group[0] for group in replica] for replica in groups]
    pipe_across_workers = cluster is not None and cross_host_axis == "pipe"
    if mesh.tensor == 1 and not pipe_across_workers:
        return HybridPipelineModel(
            lambda: stages_from_blocks(make_blocks(), partition_boundaries),
            replica_devices,
            num_microbatches,
            schedule,
            remat=remat,
            worker_collectives=collectives,
        )
    # A rolled step (a loop over rounds) whose stages are on different workers moved 36
    # to 40 times the stage-boundary bytes between the hosts per step: its loop state
    # (stashes, gradient sums) crosses hosts every round. Unrolled, 1.5 times, gRPC
    # framing included (scripts/benchmark_across_hosts.py, docs/guide/multi_worker.md).
    rolled = False if pipe_across_workers else None
    if mesh.tensor > 1:
        _check_tensor_split(mesh, make_split_blocks, chunks)

    def make_replica(index: int, stage_devices: list[str], first) -> PipelineModel:
        if mesh.tensor == 1:
            stages = stages_from_blocks(make_blocks(), partition_boundaries)
        else:
            # Stage s of replica `index`: the blocks of stage s, split over its group.
            stages = [
                stages_from_blocks(make_split_blocks(group), partition_boundaries)[stage]
                for stage, group in enumerate(groups[index])
            ]
        return PipelineModel(
            stages, stage_devices, num_microbatches, schedule, remat, rolled=rolled
        )

    return _hybrid_of_pipelines(
        make_replica, replica_devices, num_microbatches, schedule, remat, collectives
    )


def _check_tensor_split(mesh: HybridMesh, make_split_blocks, chunks: int) -> None:
    if make_split_blocks is None:
        raise MeshError(
            f"Mesh {mesh} splits each stage's layers over tensor={mesh.tensor} devices, which "
            "needs a model built from split layers (the reference transformer). Received: a "
            "model without them; use tensor=1."
        )
    if chunks > 1:
        raise MeshError(
            f"Mesh {mesh} with tensor > 1 runs one stage per device group. Received: "
            f"chunks={chunks}; use chunks=1 (--chunks) or tensor=1."
        )


def build_hybrid_model_from_model(
    model: keras.Model,
    mesh: HybridMesh | str,
    num_microbatches: int,
    schedule: str = "1f1b",
    chunks: int = 1,
    partition: str | Sequence[str] = "params",
    remat: bool = False,
    sample_input=None,
    devices: Sequence[str] | None = None,
    cluster: ClusterInfo | None = None,
    communication: str = "auto",
    collective_timeout: float | None = None,
    cost_cache: CostCache | str | os.PathLike | None = None,
    cross_host_axis: str = "pipe",
) -> HybridPipelineModel:
    """Builds a `HybridPipelineModel` whose replicas pipeline copies of a whole Keras model.

    Replica 0 is `PipelineModel.from_model(model, ...)`, cut by `partition`; every other
    replica pipelines a copy of `model` (`copy_model`), cut at the same calls, and starts
    from replica 0's weights. `to_model()` and `save` give back `model` with the trained
    weights. Arguments as for `build_hybrid_model` and `PipelineModel.from_model`.

    Example:
        >>> hybrid = build_hybrid_model_from_model(model, "data=2,pipe=2", 4, "1f1b")
    """
    mesh, groups, collectives = _hybrid_layout(
        mesh, devices, cluster, communication, collective_timeout, cross_host_axis
    )
    if mesh.tensor > 1:
        _check_tensor_split(mesh, None, chunks)  # a whole model has no split layers
    replica_devices = [[group[0] for group in replica] for replica in groups]
    # Unrolled across workers, as `build_hybrid_model`'s replicas (see there).
    pipe_across_workers = cluster is not None and cross_host_axis == "pipe"

    def make_replica(index: int, devices_of_replica: list[str], first) -> PipelineModel:
        # Replica 0 cuts the model; the copies are cut at the same calls.
        return PipelineModel.from_model(
            model if first is None else copy_model(model),
            devices_of_replica,
            num_microbatches,
            schedule,
            chunks=chunks,
            partition=partition if first is None else stage_boundaries(first.stages),
            remat=remat,
            sample_input=sample_input,
            cost_cache=cost_cache if first is None else None,
            rolled=False if pipe_across_workers else None,
        )

    return _hybrid_of_pipelines(
        make_replica, replica_devices, num_microbatches, schedule, remat, collectives
    )


def _hybrid_of_pipelines(
    make_replica: Callable[[int, list[str], PipelineModel | None], PipelineModel],
    replica_devices: list[list[str]],
    num_microbatches: int,
    schedule: str,
    remat: bool,
    collectives: WorkerCollectives | None,
) -> HybridPipelineModel:
    """A `HybridPipelineModel` whose replica r is `make_replica(r, its devices, replica 0)`
    (None for replica 0 itself)."""
    made: list[PipelineModel] = []

    def make_pipeline(devices: list[str]) -> PipelineModel:
        made.append(make_replica(len(made), devices, made[0] if made else None))
        return made[-1]

    return HybridPipelineModel(
        None,
        replica_devices,
        num_microbatches,
        schedule,
        remat=remat,
        worker_collectives=collectives,
        make_pipeline=make_pipeline,
    )


def copy_model(model: keras.Model) -> keras.Model:
    """A new model of the same architecture and layer names (weights not copied).

    Functional models and Sequentials are cloned layer by layer, nested models too, so a
    layer called both inside a nested model and outside it (a backbone's token embedding
    reused as the output projection) stays one layer; other models (KerasHub tasks) are
    rebuilt from their config.
    """
    if keras_internals.is_plain_functional(model) or type(model) is keras.Sequential:
        return keras.models.clone_model(model, recursive=True)
    return type(model).from_config(model.get_config())


def stage_boundaries(stages: Sequence[keras.layers.Layer]) -> list[int]:
    """Index of the first call of stages 1, 2, ... in their model's call graph."""
    ends = itertools.accumulate(len(stage.call_names) for stage in stages)
    return list(ends)[:-1]


def _hybrid_layout(
    mesh: HybridMesh | str,
    devices: Sequence[str] | None,
    cluster: ClusterInfo | None,
    communication: str,
    collective_timeout: float | None,
    cross_host_axis: str,
) -> tuple[HybridMesh, list[list[list[str]]], WorkerCollectives | None]:
    """The mesh, each local replica's stage device groups (`HybridMesh.stage_device_groups`),
    and the collectives across workers (None when the chief drives every worker's devices
    as its own)."""
    mesh = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    if cross_host_axis not in CROSS_HOST_AXES:
        raise ValueError(
            f"cross_host_axis must be one of {CROSS_HOST_AXES}. Received: "
            f"cross_host_axis={cross_host_axis!r}"
        )
    if cluster is not None and cross_host_axis == "pipe":
        return mesh, mesh_groups_across_workers(cluster, mesh), None
    devices = list(devices) if devices is not None else local_device_names(cluster)
    num_workers = cluster.num_workers if cluster is not None else 1
    groups = mesh.stage_device_groups(devices, num_workers)
    collectives = None
    if num_workers > 1:
        collectives = WorkerCollectives(
            num_workers, cluster.task_index, communication, collective_timeout
        )
    return mesh, groups, collectives
