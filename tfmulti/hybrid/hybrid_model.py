"""HybridPipelineModel: data parallelism over copies of a pipelined model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmulti.collectives.worker_sums import WorkerCollectives
from tfmulti.compat.keras_internals import variable_device
from tfmulti.compat.keras_whole_weights import variables_holding
from tfmulti.hybrid.data_owners import (
    check_zero_stage,
    deal_owners,
    hold_owned_weights_only,
    same_storage,
)
from tfmulti.hybrid.shared_schedule import SharedForward, SharedSchedule
from tfmulti.pipeline.actions import Schedule
from tfmulti.pipeline.runtime.executor import add_gradients
from tfmulti.pipeline.runtime.loss_shares import BatchTotals, batch_totals
from tfmulti.pipeline.runtime.microbatches import (
    concat_microbatches,
    microbatch_sizes,
    split_microbatches,
    split_padded_microbatches,
)
from tfmulti.pipeline.runtime.pipeline_model import PipelineModel
from tfmulti.pipeline.runtime.scheduled_step import ScheduledStep, ScheduledTrainStep
from tfmulti.pipeline.runtime.shared_traces import distinct_storage
from tfmulti.pipeline.stages.split_summary import placement_table
from tfmulti.wrapped_model import WrappedModel


class HybridPipelineModel(WrappedModel, ScheduledTrainStep, keras.Model):
    """A pipelined model copied into data-parallel replicas that train as one model.

    Each local replica is a `PipelineModel` on its own devices. A training step splits the
    batch, of any size, into one part per local replica, differing by at most one row; each
    replica runs the pipeline schedule on its part in `num_microbatches` micro-batches,
    each micro-batch's loss weighted by its share of the rows of the whole step (summed
    over workers with `worker_collectives`); each variable's gradient is summed over the
    replicas (on replica 0's device for it, then over workers); the optimizer updates
    replica 0's variables, on their devices, and the other copies take the new values, so
    copies stay equal and the step equals one-device training on the whole batch. The
    optimizer, its slots and its traced update are one copy's, as on one device (and
    `global_clipnorm` sees one copy's gradients); `trainable_variables` are replica 0's.
    Float non-trainable state (BatchNorm statistics) is averaged over the replicas after
    each step. `evaluate`
    and `predict` split the batch over the local replicas. Weights, `count_params`, saving
    and `summary` are one copy's: the plain model's (see `WrappedModel`); weights set or
    loaded go into every copy.

    Args:
        make_stages: returns a new list of unbuilt stages, the same model at every call;
            called once per local replica. Replica 0's initial weights are copied into
            the others (and, across workers, the chief's into every worker's). None when
            `make_pipeline` makes the replicas.
        replica_devices: per local replica, the device of each of its p pipeline devices,
            e.g. from `HybridMesh.replica_devices`.
        num_microbatches: micro-batches each replica splits its part into per step (m).
        schedule: any `PipelineModel` schedule: "gpipe", "1f1b", "interleaved_1f1b",
            "zb_h1", "zb_h2", schedule text, or a `Schedule`.
        remat: recompute forwards in backwards, as for `PipelineModel`.
        worker_collectives: sums over workers when data replicas also live on other
            workers; None when every replica is on this host.
        make_pipeline: instead of `make_stages`: returns a new `PipelineModel` of the
            same model on the given devices (e.g. `PipelineModel.from_model` of a copy).
        **kwargs: passed to `keras.Model` (e.g. `name`).

    Example:
        >>> mesh = parse_mesh("data=2,pipe=2")
        >>> model = HybridPipelineModel(
        ...     lambda: [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)],
        ...     mesh.replica_devices(logical_device_names()), num_microbatches=4)
        >>> model.compile(optimizer="adam", loss="mse")
        >>> model.fit(x, y, batch_size=32)  # doctest: +SKIP
    """

    def __init__(
        self,
        make_stages: Callable[[], Sequence[keras.layers.Layer]] | None,
        replica_devices: Sequence[Sequence[str]],
        num_microbatches: int = 1,
        schedule: str | Schedule = "1f1b",
        remat: bool | Sequence[bool] = False,
        worker_collectives: WorkerCollectives | None = None,
        make_pipeline: Callable[[list[str]], PipelineModel] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        replica_devices = [list(devices) for devices in replica_devices]
        if not replica_devices:
            raise ValueError(
                "replica_devices needs at least one replica's device list. "
                f"Received: replica_devices={replica_devices!r}"
            )
        if (make_stages is None) == (make_pipeline is None):
            raise ValueError(
                "HybridPipelineModel makes its replicas from exactly one of make_stages and "
                "make_pipeline. Received: both or neither."
            )
        if make_pipeline is None:
            self.replicas = [
                PipelineModel(list(make_stages()), devices, num_microbatches, schedule, remat)
                for devices in replica_devices
            ]
        else:
            self.replicas = [make_pipeline(devices) for devices in replica_devices]
        # Every copy calls replica 0's traced stage functions on its own variables.
        for replica in self.replicas[1:]:
            replica.share_traces_of(self.replicas[0])
        self.num_microbatches = self.replicas[0].num_microbatches
        self.worker_collectives = worker_collectives
        num_workers = worker_collectives.num_workers if worker_collectives else 1
        self.num_data_replicas = len(self.replicas) * num_workers
        self._replicas_synced = False
        self._shared_schedule = SharedSchedule(self.replicas, loss_model=self)
        self._shared_forward = SharedForward(self.replicas)
        self.zero_stage = 0
        self._owner_of_variable: list[int] | None = None

    def _use_xla(self, enabled: bool) -> None:
        """`compile(jit_compile=True)` compiles each copy's stages with XLA, each for its
        own device (as `PipelineModel`); not under stage 3, whose stages read weights held
        on other devices."""
        if enabled and self.zero_stage == 3:
            raise ValueError(
                "XLA compiles a stage for one device, and under --zero=3 a stage reads "
                "weights its data replica's owners hold on other devices. Received: "
                "jit_compile=True; compile without it, or use --zero=2."
            )
        for replica in self.replicas:
            replica.compile_stages_with_xla(enabled)

    @property
    def trainable_variables(self) -> list:
        """What the optimizer updates and holds slots for: replica 0's trainable variables,
        or under `shard_over_data_axis` each variable's owner's copy (the other copies
        take their values after each update, or under stage 3 read the owner's)."""
        variables = self.replicas[0].trainable_variables
        if not self.zero_stage or not variables:
            return variables
        return [
            self.replicas[owner].trainable_variables[index]
            for index, owner in enumerate(self._owners())
        ]

    def shard_over_data_axis(self, stage: int) -> None:
        """ZeRO over the data axis: each variable's optimizer state and update live with one
        data replica, its owner, instead of all on replica 0's devices; under stage 3 its
        weights too.

        Owners are dealt out by size on each pipeline device, with tensor > 1 on each of
        a stage's tensor devices, shard by shard (`data_owners.deal_owners`), so every
        device of the mesh holds about 1/N of its place's state; a variable's gradient is
        summed on its owner's device. Stages 1 and 2 run alike here (each
        gradient is summed on its owner as soon as every replica has it), and the owner's
        new value is copied to the other replicas. Under stage 3 the owner holds the
        variable's only storage: the other replicas' copies read it where it lives (a
        stage's forward and backward on another replica receive it for that call and
        drop it after, as FSDP's gathers), so no device keeps weights it does not own
        (a tensor shard is read from the owner's device for the same stage and tensor
        rank). Call before the model's first call (which builds the replicas).

        Raises:
            ValueError: in one line, for a stage other than 1-3, a data axis across
                workers, or stage 3 once the replicas are built.
        """
        check_zero_stage(stage, data_axis_across_workers=self.worker_collectives is not None)
        if stage == 3 and self._replicas_synced:
            raise ValueError(
                "shard_over_data_axis(3) shares each weight's storage between the replicas "
                "as they are built, before any step is traced. Received: a model already "
                "called; shard it before its first call."
            )
        self.zero_stage = stage

    def _owners(self) -> list[int]:
        """The data replica owning each of replica 0's trainable variables, dealt out once
        (before stage 3 moves any copy's storage) on each of replica 0's devices."""
        if self._owner_of_variable is None:
            variables = self.replicas[0].trainable_variables
            self._owner_of_variable = deal_owners(
                [int(np.prod(v.shape or (1,))) for v in variables],
                [variable_device(v) for v in variables],
                len(self.replicas),
            )
        return self._owner_of_variable

    def weight_storage(self) -> list:
        """Every `tf.Variable` holding the replicas' weights, each once (under stage 3 a
        weight's copies share their owner's): what `metrics.json`'s memory section counts."""
        return distinct_storage(v for replica in self.replicas for v in replica.variables)

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        if self.zero_stage and self.optimizer is not None:
            finalize = self.optimizer.finalize_variable_values

            def finalize_owned(var_list):
                # `fit` ends by finalizing replica 0's weights; an EMA optimizer's averages
                # belong to each variable's owner.
                finalize(self.trainable_variables)
                self.after_update()

            object.__setattr__(self.optimizer, "finalize_variable_values", finalize_owned)

    def to_model(self) -> keras.Model:
        """Replica 0 as a plain single-device Keras model sharing its weights (every copy
        holds the same weights); see `PipelineModel.to_model`."""
        return self.replicas[0].to_model()

    def placement_table(self) -> str:
        """One line per block or layer call: its stage and each replica's device for it."""
        return placement_table(self)

    def _model_weights(self) -> list:
        return self.replicas[0].weights

    def _parts_built(self) -> bool:
        return self.replicas[0]._parts_built()

    def _weights_changed(self) -> None:
        """Copies replica 0's weights, just set or loaded, into the other copies."""
        if not all(replica._parts_built() for replica in self.replicas):
            return
        self._copy_first_replica()

    def fit(self, *args, **kwargs):
        history = super().fit(*args, **kwargs)
        # An EMA optimizer's final averages overwrite the trainable weights (one copy's).
        if self.optimizer is not None and self.optimizer.use_ema:
            self._weights_changed()
        return history

    def build(self, input_shape=None):
        # Replicas are built on their devices at the first call, once input dtypes are known.
        self.built = True

    def call(self, inputs, training=None):
        self._build_replicas(inputs)
        parts = split_microbatches(inputs, microbatch_sizes(inputs, len(self.replicas)))
        return concat_microbatches(
            [
                self._shared_forward.call(index, part, training=training)
                for index, part in enumerate(parts)
            ]
        )

    def run_scheduled_step(self, x, y, sample_weight) -> ScheduledStep:
        self._build_replicas(x)
        sizes = microbatch_sizes(x, len(self.replicas))
        # A replica left without rows runs on a padding row that counts for nothing.
        x_parts = split_padded_microbatches(x, sizes)
        y_parts = split_padded_microbatches(y, sizes)
        weight_parts = split_padded_microbatches(sample_weight, sizes)
        totals = self._step_totals(batch_totals(x, sample_weight))
        results = [
            self._shared_schedule.run(index, x_part, y_part, weight_part, totals, rows)
            for index, (x_part, y_part, weight_part, rows) in enumerate(
                zip(x_parts, y_parts, weight_parts, _each(sizes), strict=True)
            )
        ]
        gradients = self._summed_gradients(results)
        return ScheduledStep(
            loss=self._summed_loss(results),
            rows=totals.rows,
            gradients_and_variables=list(zip(gradients, self.trainable_variables, strict=True)),
            predictions=concat_microbatches([concat_microbatches(r.outputs) for r in results]),
        )

    def build_parts(self, x) -> None:
        self._build_replicas(x)

    def output_spec(self, x):
        return self.replicas[0].output_spec(x)

    def _build_replicas(self, inputs) -> None:
        """Builds every replica on its devices, then makes every copy equal replica 0's
        weights (and, across workers, the chief's)."""
        if self._replicas_synced:
            return
        first = self.replicas[0]
        first.build_stages(inputs)
        for replica in self.replicas[1:]:
            replica.build_stages_like(first, inputs)
        with tf.init_scope():
            source = _held_variables(self.replicas[0])
            if self.worker_collectives is not None:
                values = self.worker_collectives.broadcast_from_chief(
                    [v.value for v in source],
                    [variable_device(v) for v in source],
                    keys=range(1, len(source) + 1),
                )
                for variable, value in zip(source, values, strict=True):
                    variable.assign(value)
            self._copy_first_replica()
        if self.zero_stage == 3:
            hold_owned_weights_only(self.replicas, self._owners())
        self._replicas_synced = True

    def _copy_first_replica(self) -> None:
        source = _held_variables(self.replicas[0])
        for replica in self.replicas[1:]:
            for variable, reference in zip(_held_variables(replica), source, strict=True):
                if not same_storage(variable, reference):
                    variable.assign(reference.value)

    def _step_totals(self, local: BatchTotals) -> BatchTotals:
        """The rows (and sample-weight sum) of the step's batch on every worker together."""
        if self.worker_collectives is None:
            return local
        device = self.replicas[0].stage_devices[-1]
        with tf.device(device):
            weight_sum = tf.zeros([]) if local.weight_sum is None else local.weight_sum
            local_totals = tf.stack([local.rows, weight_sum])
        totals = self.worker_collectives.sum([local_totals], [device], [self._totals_key()])[0]
        return BatchTotals(totals[0], None if local.weight_sum is None else totals[1])

    def _summed_gradients(self, results) -> list:
        """Each variable's gradient summed over all data replicas, in the order of
        `replicas[0].trainable_variables`; each replica's is already weighted by its share
        of the step's rows."""
        per_replica = []
        for replica, result in zip(self.replicas, results, strict=True):
            by_variable = {
                id(v): g for v, g in zip(result.variables, result.gradients, strict=True)
            }
            per_replica.append([by_variable[id(v)] for v in replica.trainable_variables])
        devices = [variable_device(v) for v in self.trainable_variables]
        summed = []
        for device, replica_gradients in zip(devices, zip(*per_replica, strict=True), strict=True):
            with tf.device(device):
                total = replica_gradients[0]
                for gradient in replica_gradients[1:]:
                    total = add_gradients(total, gradient)
                if self.worker_collectives is not None:
                    total = tf.convert_to_tensor(total)
                summed.append(total)
        if self.worker_collectives is None:
            return summed
        # Instance keys after the ones _build_replicas used for the weights.
        first_key = len(_held_variables(self.replicas[0])) + 1
        return self.worker_collectives.sum(
            summed, devices, keys=range(first_key, first_key + len(summed))
        )

    def after_update(self) -> None:
        """Copies the updated trainable variables (replica 0's, or each one's owner's) into
        the other copies (none under stage 3: they read the owner's), then
        replaces each float non-trainable variable (e.g. BatchNorm's moving statistics),
        which each replica updated from its own rows, by its mean over all data replicas,
        so the copies stay identical."""
        updated = self.trainable_variables
        for replica in self.replicas:
            for variable, reference in zip(replica.trainable_variables, updated, strict=True):
                if variable is not reference and not same_storage(variable, reference):
                    variable.assign(reference)
        state = [
            [v for v in replica.non_trainable_variables if keras.backend.is_float_dtype(v.dtype)]
            for replica in self.replicas
        ]
        if not state[0]:
            return
        devices = [variable_device(v) for v in state[0]]
        means = []
        for device, copies in zip(devices, zip(*state, strict=True), strict=True):
            with tf.device(device):
                means.append(tf.add_n([v.value for v in copies]) / self.num_data_replicas)
        if self.worker_collectives is not None:
            first_key = self._loss_key() + 1
            means = self.worker_collectives.sum(
                means, devices, keys=range(first_key, first_key + len(means))
            )
        for copies, mean in zip(zip(*state, strict=True), means, strict=True):
            for variable in copies:
                variable.assign(mean)

    def _totals_key(self) -> int:
        """The cross-worker instance key of the step's totals: after the keys of the
        initial weights (1 to W) and of the gradients (W + 1 to W + T)."""
        return (
            len(_held_variables(self.replicas[0])) + len(self.replicas[0].trainable_variables) + 1
        )

    def _loss_key(self) -> int:
        """The cross-worker instance key of the loss, after the totals' key."""
        return self._totals_key() + 1

    def _summed_loss(self, results) -> tf.Tensor:
        """The step's loss: every micro-batch's share-weighted loss, over all replicas."""
        loss = tf.add_n([loss for result in results for loss in result.losses])
        if self.worker_collectives is None:
            return loss
        device = self.replicas[0].stage_devices[-1]
        return self.worker_collectives.sum([loss], [device], keys=[self._loss_key()])[0]


def _each(sizes) -> list:
    """The entries of a list or of a rank-1 tensor of static length."""
    return [
        sizes[index] for index in range(len(sizes) if isinstance(sizes, list) else sizes.shape[0])
    ]


def _held_variables(replica: keras.Model) -> list:
    """The variables behind a replica's weights, each split weight as its shards."""
    return [variable for weight in replica.weights for variable in variables_holding(weight)]
