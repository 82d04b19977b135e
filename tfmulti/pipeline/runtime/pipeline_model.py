"""PipelineModel: a Keras 3 model whose stages live on different devices and train in a pipeline."""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat import keras_internals
from tfmulti.costing.cost_cache import CostCache, as_cost_cache
from tfmulti.pipeline.actions import BACKWARD, WEIGHT_GRAD, Schedule
from tfmulti.pipeline.dependencies import TimedAction
from tfmulti.pipeline.runtime.executor import ScheduleExecutor, StepResult
from tfmulti.pipeline.runtime.looped_forward import forward_microbatches
from tfmulti.pipeline.runtime.loss_shares import (
    BatchTotals,
    batch_totals,
    loss_reduction,
    loss_share,
)
from tfmulti.pipeline.runtime.microbatches import (
    MicrobatchParts,
    batch_rows,
    concat_microbatches,
    even_sizes,
    microbatch_sizes,
    trim_microbatches,
)
from tfmulti.pipeline.runtime.schedule_choice import resolve_schedule
from tfmulti.pipeline.runtime.scheduled_step import ScheduledStep, ScheduledTrainStep
from tfmulti.pipeline.stages.export import chained_model, input_spec
from tfmulti.pipeline.stages.model_stages import stages_from_model
from tfmulti.pipeline.stages.split_summary import placement_table
from tfmulti.pipeline.stages.stage_devices import (
    build_from_build_configs,
    build_stages_on_devices,
    check_stage_placement,
    move_built_stages,
    resolve_devices,
)
from tfmulti.platform.runtime.devices import on_another_worker
from tfmulti.wrapped_model import WrappedModel


class PipelineModel(WrappedModel, ScheduledTrainStep, keras.Model):
    """A Keras model made of stages on several devices, trained by a pipeline schedule.

    Each training step splits the batch, of any size, into `num_microbatches` micro-batches
    differing by at most one row (with fewer rows than micro-batches, the last ones are
    empty) and runs the schedule's forward and backward actions, each device in the
    schedule's order, in one traced function; each micro-batch's loss is weighted by its
    share of the batch's rows (or sample weights, for "mean_with_sample_weight" losses), so
    the summed gradients and the loss equal the full batch's. Each stage's variables and
    optimizer slots live on its device. `evaluate` and `predict` run the stages in turn on
    each micro-batch. Layers that update state from batch statistics (BatchNorm) see every
    micro-batch, so an empty one gives them NaN statistics. Weights, `count_params`,
    saving and `summary` are those of `to_model()`, the plain model (see `WrappedModel`).

    Args:
        stages: Keras layers, one per stage; with p devices and v chunks per device, pass
            p·v stages (stage i runs on device i mod p). A built stage's variables are
            moved to its device; an unbuilt one is built there. To cut a whole model into
            stages, use `PipelineModel.from_model`.
        devices: the p device names, e.g. ["/device:CPU:0", "/device:CPU:1"].
        num_microbatches: micro-batches per training step (m); any batch size works.
            Must be 1 for "model_parallel".
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "model_parallel"
            (no micro-batching, one device busy at a time), schedule text, or a `Schedule`.
        remat: recompute each stage's forward in its backward instead of keeping its
            intermediate tensors; a bool for all stages or one per stage.
        rolled: run the schedule's repeating steady state as a loop over rounds traced
            once, so tracing and start-up do not grow with micro-batches (1F1B,
            interleaved, ZB-H1/H2 from a few micro-batches per device on; GPipe, and
            batches that do not split into equal micro-batches, stay unrolled). None:
            whenever possible; False: never (one traced copy of every action).
        **kwargs: passed to `keras.Model` (e.g. `name`).

    Example:
        >>> stages = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        >>> model = PipelineModel(stages, ["/device:CPU:0", "/device:CPU:1"], 4, "1f1b")
        >>> model.compile(optimizer="adam", loss="mse")
        >>> model.fit(x, y, batch_size=32)  # doctest: +SKIP
    """

    def __init__(
        self,
        stages: Sequence[keras.layers.Layer],
        devices: Sequence[str],
        num_microbatches: int = 1,
        schedule: str | Schedule = "1f1b",
        remat: bool | Sequence[bool] = False,
        rolled: bool | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        stages = list(stages)
        if not stages or not all(isinstance(s, keras.layers.Layer) for s in stages):
            raise ValueError(
                f"stages must be a non-empty list of Keras layers. Received: stages={stages!r}"
            )
        if isinstance(num_microbatches, bool) or int(num_microbatches) < 1:
            raise ValueError(
                f"num_microbatches must be an integer >= 1. Received: {num_microbatches!r}"
            )
        self.num_microbatches = int(num_microbatches)
        self.devices = resolve_devices(devices)
        self.schedule = resolve_schedule(
            schedule, len(stages), len(self.devices), self.num_microbatches
        )
        self.stage_devices = [self.devices[d] for d in self.schedule.stage_devices]
        self.remat = _per_stage(remat, len(stages))
        self.stages = stages
        move_built_stages(stages, self.stage_devices)
        self._executor = ScheduleExecutor(
            stages, self.stage_devices, self.schedule, self.remat, rolled=rolled
        )
        self._trace_actions = [a for actions in self.schedule.device_actions for a in actions]
        self._tracing = False
        self._train_functions = {}
        self._traced_calls = {}  # training flag -> `call` as a tf.function
        # A plain holder: Keras would track a variable attribute as model state.
        self._stamp_holder = types.SimpleNamespace(buffer=None)
        # The model `from_model` cut (None for a stage list), the input spec seen first and
        # the stages chained into a model once that spec is known.
        self._export = types.SimpleNamespace(model=None, input_spec=None, chained=None)
        self._output_spec = None

    def _use_xla(self, enabled: bool) -> None:
        """`compile(jit_compile=True)` compiles each stage's functions with XLA for the
        stage's own device; the step around them (the schedule, transfers, the optimizer)
        stays a TensorFlow graph. "auto" means no XLA."""
        self.compile_stages_with_xla(enabled)

    def compile_stages_with_xla(self, jit_compile: bool) -> None:
        """Compiles each stage's functions with XLA from the next trace on (or stops)."""
        self._train_functions = {}
        self._executor.set_jit_compile(jit_compile)

    def make_train_function(self, force=False):
        # Optimizer slots made during the first trace make tf.function trace the whole
        # step twice; once the stages are built, the optimizer can be built beforehand
        # (for input `fit` could not read shapes from: see `build_ahead_of_tracing`).
        optimizer = self.optimizer
        if optimizer is not None and not optimizer.built and self._stages_built():
            optimizer.build(self.optimizer_variable_order())
        return super().make_train_function(force=force)

    def _stages_built(self) -> bool:
        return all(stage.built for stage in self.stages)

    def build_parts(self, x) -> None:
        self.build_stages(x)

    def build(self, input_shape=None):
        # Stages are built on their devices at the first call, once input dtypes are known.
        self.built = True

    def call(self, inputs, training=None):
        self.build_stages(inputs)
        if tf.executing_eagerly() and self._on_other_workers():
            # TensorFlow cannot run an XLA-compiled function (Keras' grouped convolutions
            # on CPU, any jit_compile layer) eagerly on another worker's device; a traced
            # function placed there runs it, as the training step does.
            return self._traced_call(training)(inputs)

        def through_stages(part):
            for functions, device in zip(
                self._executor.stage_functions, self.stage_devices, strict=True
            ):
                with tf.device(device):
                    part = functions.call(part, training=training)
            return part

        sizes = microbatch_sizes(inputs, self.num_microbatches)
        return forward_microbatches(inputs, sizes, through_stages)

    def _on_other_workers(self) -> bool:
        """Whether a stage runs on another worker's device (this process drives them)."""
        return any(on_another_worker(device) for device in self.stage_devices)

    def _traced_call(self, training) -> tf.types.experimental.PolymorphicFunction:
        """`call` for one `training` flag, as a tf.function."""
        if training not in self._traced_calls:
            self._traced_calls[training] = tf.function(
                lambda inputs: self.call(inputs, training=training), autograph=False
            )
        return self._traced_calls[training]

    def run_scheduled_step(self, x, y, sample_weight) -> ScheduledStep:
        result = self.run_schedule(x, y, sample_weight)
        if self._tracing:
            self._stamp_holder.buffer.assign(
                tf.stack([tf.stack(result.stamps[action]) for action in self._trace_actions])
            )
        return ScheduledStep(
            loss=tf.add_n(result.losses),
            rows=batch_rows(x),
            gradients_and_variables=zip(result.gradients, result.variables, strict=True),
            predictions=concat_microbatches(result.outputs),
        )

    def run_schedule(
        self,
        x,
        y,
        sample_weight=None,
        loss_model: keras.Model | None = None,
        totals: BatchTotals | None = None,
        rows=None,
    ) -> StepResult:
        """Runs the schedule's forwards and backwards on one batch; applies nothing.

        Args:
            x, y, sample_weight: the batch, of any size; it splits into `num_microbatches`
                parts differing by at most one row.
            loss_model: the compiled model whose loss and optimizer loss scaling each
                micro-batch uses; default this model. A model that holds several
                pipelines and applies their gradients itself passes itself.
            totals: the rows (and sample-weight sum) of the whole batch this one is part
                of, e.g. over several pipelines; default this batch's.
            rows: how many leading rows of the batch are real (an int or int32 scalar
                tensor), when the rest is padding; default all of them.

        Returns:
            A `StepResult`: `losses` are each micro-batch's loss times its share of the
            whole batch (they sum to its loss), gradients their gradients summed over
            micro-batches (times the optimizer's loss scale, if any).
        """
        loss_model = self if loss_model is None else loss_model
        totals = batch_totals(x, sample_weight) if totals is None else totals
        reduction = loss_reduction(loss_model)
        self.build_stages(x)
        if rows is None:
            sizes = microbatch_sizes(x, self.num_microbatches)
        else:
            sizes = even_sizes(rows, self.num_microbatches)
        # Fewer rows than micro-batches leaves some with none: they run on a padding row.
        x_parts = MicrobatchParts(x, sizes)
        y_parts = MicrobatchParts(y, sizes)
        weight_parts = MicrobatchParts(sample_weight, sizes)

        def microbatch_loss(microbatch, y_pred):
            loss = keras_internals.compute_loss(
                loss_model,
                x=x_parts[microbatch],
                y=y_parts[microbatch],
                y_pred=y_pred,
                sample_weight=weight_parts[microbatch],
                training=True,
            )
            rows = x_parts.rows(microbatch)
            share = loss_share(reduction, rows, weight_parts[microbatch], totals)
            # A padded micro-batch (no real rows) counts for nothing.
            has_rows = rows > 0
            loss = tf.where(has_rows, loss * tf.cast(share, loss.dtype), tf.zeros_like(loss))
            differentiated = loss
            if loss_model.optimizer is not None:
                differentiated = loss_model.optimizer.scale_loss(differentiated)
            return loss, differentiated

        result = self._executor.run(x_parts, microbatch_loss, trace=self._tracing)
        return dataclasses.replace(result, outputs=trim_microbatches(result.outputs, sizes))

    def share_traces_of(self, first: PipelineModel) -> None:
        """Traces no stage functions of its own where `first` (a copy of this pipeline:
        copies of its stages, the same schedule and remat) has them: calls `first`'s on
        its own variables (`shared_traces.ReplicaTracedStage`), so copies share one trace
        per stage and input signature.
        """
        if self.remat != first.remat or len(self.stages) != len(first.stages):
            raise ValueError(
                "share_traces_of needs a copy of this pipeline. Received: a pipeline of "
                f"{len(first.stages)} stages, remat={first.remat}; this one has "
                f"{len(self.stages)}, remat={self.remat}."
            )
        own_functions = self._executor.stage_functions
        for own, functions in zip(own_functions, first._executor.stage_functions, strict=True):
            own.share_traces_of(functions)

    def set_step_tracing(self, enabled: bool) -> None:
        """Makes the following training steps record when each action starts and ends.

        Tracing steps run a separately traced function with timestamp ops; both functions
        are kept, so switching back and forth does not trace again. Read the times of the
        latest traced step with `measured_actions()`.
        """
        enabled = bool(enabled)
        if enabled == self._tracing:
            return
        if enabled and self._stamp_holder.buffer is None:
            self._stamp_holder.buffer = tf.Variable(
                tf.zeros([len(self._trace_actions), 2], tf.float64), trainable=False
            )
        if self.train_function is not None:
            self._train_functions[self._tracing] = self.train_function
        self._tracing = enabled
        self.train_function = self._train_functions.get(enabled)
        if self.train_function is None:
            self.make_train_function(force=True)

    def measured_actions(self) -> list[TimedAction]:
        """Start and end, in seconds from the step's first start, of each action of the latest
        traced training step, in start order (see `set_step_tracing`)."""
        if self._stamp_holder.buffer is None:
            raise ValueError(
                "No training step has been traced. Call set_step_tracing(True) before a "
                "training step, or use PipelineTimelineCallback."
            )
        stamps = np.asarray(self._stamp_holder.buffer.numpy())
        origin = stamps[:, 0].min()
        device_of = {
            action: device
            for device, actions in enumerate(self.schedule.device_actions)
            for action in actions
        }
        records = [
            TimedAction(device_of[action], action, float(start - origin), float(end - origin))
            for action, (start, end) in zip(self._trace_actions, stamps, strict=True)
        ]
        return sorted(records, key=lambda record: (record.start, record.device))

    @classmethod
    def from_model(
        cls,
        model: keras.Model,
        devices: Sequence[str],
        num_microbatches: int = 1,
        schedule: str | Schedule = "1f1b",
        chunks: int = 1,
        partition: str | Sequence[str] = "params",
        remat: bool | Sequence[bool] = False,
        sample_input=None,
        cost_cache: CostCache | str | os.PathLike | None = None,
        **kwargs,
    ) -> PipelineModel:
        """Pipelines a whole functional or Sequential Keras model, cut into p·chunks stages.

        The model's call graph (nested models, such as a KerasHub backbone inside its
        task, opened) is cut into contiguous stages; whatever a cut crosses travels to the
        next stage: several tensors, residual streams skipping stages, and integer masks
        or token ids (which get no gradient). The stages share the model's layers, whose
        variables move to their stage's device; a weight used by two stages (a tied
        embedding) stays with the first, gets both stages' gradients summed and is
        updated once. `to_model()` gives the model back holding the trained weights.

        Args:
            model: a functional model (KerasHub tasks included) or a Sequential, built
                or not (an unbuilt Sequential needs `sample_input`).
            devices: the p device names.
            num_microbatches: micro-batches per training step.
            schedule: as for `PipelineModel`; with chunks > 1, "interleaved_1f1b".
            chunks: stages per device (v).
            partition: "uniform", "params", "time", "memory" (the last two measure on
                `sample_input`), or the names of the layers where stages 1.. begin.
            remat: as for `PipelineModel`.
            sample_input: one micro-batch of model input, for "time" and "memory"; if
                None, made from the model's input specs (needs every input axis but the
                batch known).
            cost_cache: with "time", where the measured seconds are kept for the next cut
                of the same model: a JSON file's path or a `CostCache` (whose
                `remeasure=True` times again). Calls that cost the same (equal layers on
                equal shapes) are timed once either way.
            **kwargs: passed to `keras.Model` (e.g. `name`).

        Example:
            >>> pipe = PipelineModel.from_model(model, ["/gpu:0", "/gpu:1"], 8, "1f1b")
            >>> pipe.compile(optimizer="adam", loss="mse")
            >>> pipe.fit(x, y, batch_size=64)  # doctest: +SKIP
            >>> pipe.save("model.keras")  # the plain model, loadable without tfmulti
            >>> PipelineModel.from_model(  # times only what costs.json does not hold
            ...     model, devices, 8, partition="time", sample_input=x[:8], cost_cache="costs.json"
            ... )  # doctest: +SKIP
        """
        cost_cache = as_cost_cache(cost_cache)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1. Received: chunks={chunks!r}")
        stages = stages_from_model(
            model,
            len(devices) * chunks,
            partition,
            num_microbatches,
            schedule,
            sample_input,
            cost_cache,
        )
        kwargs.setdefault("name", f"{model.name}_pipeline")
        pipe = cls(stages, devices, num_microbatches, schedule, remat, **kwargs)
        pipe._export.model = model
        return pipe

    def to_model(self) -> keras.Model:
        """The pipeline as a plain single-device Keras model sharing its weights.

        For `from_model`, the model passed in (its weights are the ones trained, in its
        own order); for a stage list, the stages chained as a functional model. Save it,
        or load it elsewhere, to serve on one device; `save`, `save_weights` and
        `load_weights` use it.

        Example:
            >>> pipe.to_model().predict(x)  # doctest: +SKIP
        """
        if self._export.model is not None:
            return self._export.model
        if self._export.input_spec is None:
            raise ValueError(
                f"{self.name!r} has not seen an input yet, so its stages cannot be chained "
                "into a model. Call it on one batch (or build_stages(x)) first."
            )
        if self._export.chained is None:
            self._export.chained = chained_model(
                self.stages, self._export.input_spec, name=f"{self.name}_chained"
            )
        return self._export.chained

    def placement_table(self) -> str:
        """One line per block or layer call: its stage and device."""
        return placement_table(self)

    def _model_weights(self) -> list:
        if self._export.model is not None:
            return self._export.model.weights
        # Chained, the stages list their weights in this order too.
        weights, seen = [], set()
        for weight in (w for stage in self.stages for w in stage.weights):
            if id(weight) not in seen:
                seen.add(id(weight))
                weights.append(weight)
        return weights

    def _parts_built(self) -> bool:
        return self._stages_built()

    def optimizer_variable_order(self) -> list:
        """The trainable variables in the order training steps hand them to the optimizer.

        The executor accumulates gradients stage by stage as the schedule's backwards run,
        so the optimizer's slots follow that order; restoring saved optimizer state into
        a fresh optimizer needs it built in the same order.
        """
        seen, ordered = set(), []
        for action in self._executor.order:
            if action.kind not in (BACKWARD, WEIGHT_GRAD):
                continue
            for variable in self.stages[action.stage].trainable_variables:
                if id(variable) not in seen:
                    seen.add(id(variable))
                    ordered.append(variable)
        return ordered

    def stage_of_variable(self, variable) -> int:
        """Index of the stage that owns `variable`."""
        for index, stage in enumerate(self.stages):
            if any(v is variable for v in stage.variables):
                return index
        raise ValueError(f"Variable {variable.path!r} belongs to no stage of this model.")

    def build_stages(self, inputs) -> None:
        """Builds every unbuilt stage on its device for batches like `inputs` (a nest of
        tensors); the first call, fit or run_schedule does it otherwise."""
        if self._export.input_spec is None:
            self._export.input_spec = input_spec(inputs)
        if not all(stage.built for stage in self.stages):
            outputs = build_stages_on_devices(self.stages, self.stage_devices, inputs)
            self._output_spec = input_spec(outputs)
            check_stage_placement(self.stages, self.stage_devices)
        self.built = True

    def output_spec(self, x):
        """KerasTensors (any batch size) like the model's outputs, once `build_stages`
        built the stages; else None."""
        return self._output_spec

    def build_stages_like(self, first: PipelineModel, inputs) -> None:
        """Builds this copy of `first` (built) on its own devices from `first`'s layers'
        build configs, without tracing a call through the stages; calls them as
        `build_stages` does where a layer keeps no build config."""
        if not all(stage.built for stage in self.stages):
            build_from_build_configs(self.stages, first.stages, self.stage_devices)
        self.build_stages(inputs)


def _per_stage(remat: bool | Sequence[bool], num_stages: int) -> list[bool]:
    if isinstance(remat, bool):
        return [remat] * num_stages
    remat = [bool(flag) for flag in remat]
    if len(remat) != num_stages:
        raise ValueError(
            f"remat needs one flag per stage ({num_stages}). Received: {len(remat)} flags"
        )
    return remat
