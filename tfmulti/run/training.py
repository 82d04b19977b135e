"""Runs a whole training job from a `TrainConfig`: data, model, strategy, callbacks, records."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence

import keras
from absl import logging

from tfmulti import data as data_lib
from tfmulti.compat import tf_profiler
from tfmulti.config import RunConfig, TrainConfig
from tfmulti.errors import IncompatibleCheckpoint, Preempted, TrainingError
from tfmulti.models import registry
from tfmulti.names import RESTART_COUNT_VARIABLE, SLURM_RESTART_COUNT_VARIABLE
from tfmulti.pipeline.stages.split_summary import split_summary
from tfmulti.platform.runtime.cluster import ClusterInfo, worker_output_dir
from tfmulti.platform.runtime.distribute_strategy import per_replica_batch_size
from tfmulti.platform.runtime.input_sharding import check_file_sharding
from tfmulti.run.callbacks import StopOnNonFiniteLoss, ThroughputLogger
from tfmulti.run.device_memory import job_memory
from tfmulti.run.epoch_checkpoint import EpochCheckpoint, latest_checkpoint
from tfmulti.run.model_export import save_trained_model
from tfmulti.run.model_setup import build_compiled_model
from tfmulti.run.preemption import SaveOnPreemption
from tfmulti.run.profiling import ProfileSteps
from tfmulti.run.run_record import (
    METRICS_FILE,
    RecordEpochs,
    RecordFirstStep,
    RunRecord,
    note_membership,
)
from tfmulti.run.step_checkpoint import (
    ResumePoint,
    ResumeRun,
    StepCheckpoint,
    find_resume_point,
)
from tfmulti.run.user_callbacks import load_callbacks
from tfmulti.strategies import get_training_strategy


def restarted_by_launcher() -> bool:
    """Whether `scripts/launch.py` (or a manager that sets the same variable) restarted
    us, or SLURM requeued our job: then the run resumes from its checkpoints by itself."""
    return any(
        int(os.environ.get(name, "0") or 0) > 0
        for name in (RESTART_COUNT_VARIABLE, SLURM_RESTART_COUNT_VARIABLE)
    )


def resume_directory(model_dir: str) -> str:
    """Where the chief keeps the run's step checkpoints, which every worker resumes from."""
    return os.path.join(model_dir, "backup")


def check_model_dir(model_dir: str, resume: bool, is_chief: bool = True) -> ResumePoint | None:
    """Returns the checkpoint a resumed run continues from (None for a fresh start).

    The chief refuses to reuse a directory that already holds a run unless
    `resume` is set, so nothing written before is overwritten by accident
    (other workers may see the chief's new files, so they do not check).
    """
    has_run = os.path.exists(os.path.join(model_dir, METRICS_FILE))
    if has_run and not resume and is_chief:
        raise ValueError(
            f"--model_dir={model_dir} already holds a run. Pass --resume to continue it "
            "or choose a new --model_dir."
        )
    if not resume:
        return None
    return find_resume_point(resume_directory(model_dir), report=logging.warning)


def _batch_hooks_idle(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Lets Keras run `callback`'s batch hooks off the step loop.

    Keras waits for each step's results whenever a callback without
    `async_safe` has a batch-end hook. TensorBoard writing per epoch does nothing
    in its, so the wait is pure loss.
    """
    callback.async_safe = True
    return callback


def standard_callbacks(
    config: TrainConfig,
    output_dir: str,
    record: RunRecord,
    steps_per_epoch: int,
    cluster: ClusterInfo | None = None,
    resume_point: ResumePoint | None = None,
    cluster_resolver=None,
    user_callbacks=(),
) -> tuple[list[keras.callbacks.Callback], StopOnNonFiniteLoss]:
    """Returns the callbacks every tfmulti run uses, and the NaN guard among them.

    tfmulti's own callbacks write to `output_dir` (a scratch directory on
    non-chief workers); Keras's get the user's `model_dir`, and the multi-worker
    compat fix sends non-chief workers' copies to scratch. A run resumed mid-epoch
    restores its checkpoint and first finishes that epoch's remaining steps (`ResumeRun`).
    On SIGTERM the group saves a step checkpoint at an agreed step and raises `Preempted`
    (`cluster_resolver`: the multi-worker strategy's, for the agreement).
    `user_callbacks` (`--callbacks`) run before tfmulti's records, so what they add to an
    epoch's logs (ReduceLROnPlateau's `learning_rate`) is recorded too.
    """
    logs_dir = os.path.join(output_dir, "logs")
    nan_guard = StopOnNonFiniteLoss()
    step_checkpoint = StepCheckpoint(
        resume_directory(output_dir),
        steps_per_epoch,
        every_steps=config.run.checkpoint_steps,
        start=resume_point,
    )
    callbacks = [ResumeRun(resume_point, steps_per_epoch)] if resume_point else []
    callbacks += [
        nan_guard,
        ThroughputLogger(
            config.data.batch_size,
            log_steps=config.run.log_steps,
            log_dir=os.path.join(logs_dir, "train"),
        ),
        RecordFirstStep(record),
        *user_callbacks,
        RecordEpochs(record),
        # After the epoch's record: a run killed between the two redoes the record on
        # resume (from the previous checkpoint) instead of resuming past a missing one.
        step_checkpoint,
        EpochCheckpoint(os.path.join(output_dir, "checkpoints"), keep=config.run.keep_checkpoints),
        _batch_hooks_idle(
            keras.callbacks.TensorBoard(os.path.join(config.run.model_dir, "logs"), profile_batch=0)
        ),
    ]
    if config.pipeline.trace_steps:
        from tfmulti.pipeline.runtime import PipelineTimelineCallback

        callbacks.append(PipelineTimelineCallback(logs_dir, steps=config.pipeline.trace_steps))
    if config.run.profile_steps:
        callbacks += _profile_callbacks(config, cluster)
    # Last: a preemption at an epoch's end waits for every record of that epoch.
    callbacks.append(SaveOnPreemption(step_checkpoint, cluster_resolver))
    return callbacks, nan_guard


def timing_callbacks(scratch_dir: str) -> list[keras.callbacks.Callback]:
    """The callbacks `standard_callbacks` gives a fresh run with the default flags, writing
    into a new directory under `scratch_dir`, less the checkpoints: with the default flags
    they save between epochs only, not in a step, and a benchmark model may not be built
    enough to save.

    The planner times its benchmarks and a model's one-device step with them
    (`machine_benchmarks.timed_with_callbacks`), so what they add to each step is in its
    predictions. Their preemption check has nothing to save: SIGTERM ends the timed
    `fit` with `Terminated`.
    """
    output_dir = tempfile.mkdtemp(dir=scratch_dir)
    config = TrainConfig(run=RunConfig(model_dir=output_dir))
    callbacks, _ = standard_callbacks(
        config, output_dir, RunRecord(output_dir, {}), steps_per_epoch=1000
    )
    return [
        SaveOnPreemption(None) if isinstance(callback, SaveOnPreemption) else callback
        for callback in callbacks
        if not isinstance(callback, (EpochCheckpoint, StepCheckpoint))
    ]


def _profile_callbacks(config: TrainConfig, cluster: ClusterInfo | None) -> list:
    """The profiler callback of this process, if its TensorFlow can profile it safely."""
    log_dir = os.path.join(config.run.model_dir, "logs", "train")
    if cluster is None:
        return [ProfileSteps(log_dir, config.run.profile_steps)]
    if not tf_profiler.host_profiler_is_safe(cluster.num_workers > 1, cluster.is_chief):
        logging.warning(tf_profiler.skipped_notice(cluster.task_index))
        return []
    # Each worker that traces writes into the chief's log directory, one host entry each.
    return [ProfileSteps(log_dir, config.run.profile_steps, f"worker{cluster.task_index}")]


def _shard_policy(
    config: TrainConfig, source: data_lib.ArrayData | data_lib.RecordData, cluster
) -> str | None:
    """The tf.data auto-shard policy for a multi-worker run (None on one host)."""
    if cluster is None:
        return None
    if config.data.shard_policy == "file":
        if not isinstance(source, data_lib.RecordData):
            raise ValueError(
                f"--shard_policy=file needs input files; --dataset={config.data.dataset} is held "
                "in memory. Use --shard_policy=data or auto."
            )
        check_file_sharding(len(source.files), cluster.num_workers)
    return config.data.shard_policy


# Marks the record `train` returns for a resumed run that had no epoch left to train.
NOTHING_LEFT_TO_TRAIN = "nothing_left_to_train"


def _nothing_left_to_train(config: TrainConfig, resume_point: ResumePoint) -> dict:
    """Says in one line that a resumed run trained every epoch asked for; returns its
    `metrics.json` record, marked `nothing_left_to_train`, leaving every file as it was."""
    logging.info(
        "Nothing left to train: --model_dir=%s has trained %d epoch(s) and --epochs=%d; "
        "pass a larger --epochs to train on.",
        config.run.model_dir,
        resume_point.epoch,
        config.run.epochs,
    )
    with open(os.path.join(config.run.model_dir, METRICS_FILE)) as handle:
        return {**json.load(handle), NOTHING_LEFT_TO_TRAIN: True}


# Marks the record `train` returns on a worker that lent its devices to the chief.
SERVED_CHIEF = "served_chief"


def train(config: TrainConfig, callbacks: Sequence[keras.callbacks.Callback] = ()) -> dict:
    """Trains the model described by `config` and returns the `metrics.json` record.

    The entry point of every training run, `tfmulti-train`'s included, on every worker:
    call it on each worker of a cluster (`TF_CONFIG`, `--worker_hosts` or SLURM). Where
    the chief drives the other workers' devices (`pipeline`, `hybrid` across workers),
    a non-chief worker serves the chief until it has gone and returns
    `{"served_chief": True}`. It runs on the main thread or off it (Ray Train): off it,
    `tfmulti.run.preemption.request_preemption` stands in for SIGTERM.

    Args:
        config: the run's settings.
        callbacks: Keras callbacks to train with, after `--callbacks`' own (e.g.
            `tfmulti.ray.ReportToRay`).

    Raises:
        ValueError: a setting is invalid (the message names it and the fix).
        TrainingError: training diverged; the last good checkpoint is kept.
        Preempted: SIGTERM (or `request_preemption`) stopped the run at a saved step.

    Example:
        >>> from tfmulti.config import TrainConfig
        >>> train(TrainConfig.from_flat(model="mlp", dataset="synthetic", epochs=1,
        ...                             steps_per_epoch=5, model_dir="runs/mlp"))
    """
    training_strategy = get_training_strategy(
        config.distribution.strategy, config.distribution.zero
    )
    cluster = training_strategy.resolve_cluster(config)
    if training_strategy.serves_chief(cluster):
        from tfmulti.platform.runtime.connected_cluster import serve_chief

        serve_chief(cluster, config.cluster.connect_timeout, config.cluster.agreed_flags)
        return {SERVED_CHIEF: True}
    keras.utils.set_random_seed(config.run.seed)
    keras.mixed_precision.set_dtype_policy(config.model.dtype)
    strategy = training_strategy.make_strategy(config, cluster)
    replicas = training_strategy.data_replicas(config, strategy)
    per_replica = per_replica_batch_size(config.data.batch_size, replicas)
    output_dir = (
        worker_output_dir(config.run.model_dir, cluster) if cluster else config.run.model_dir
    )
    resume_point = check_model_dir(
        config.run.model_dir,
        config.run.resume or restarted_by_launcher(),
        is_chief=cluster is None or cluster.is_chief,
    )
    if resume_point and resume_point.epoch >= config.run.epochs:
        return _nothing_left_to_train(config, resume_point)
    start_step = resume_point.global_step if resume_point else 0

    user_callbacks = [*load_callbacks(config.run.callbacks), *callbacks]
    registry.check_model_accepts(config.model.name, data_lib.dataset_task(config.data.dataset))
    source = data_lib.load_source(
        config.data.dataset, data_path=config.data.data_path, seed=config.run.seed
    )
    registry.check_model_accepts(config.model.name, source.info.task, source.info.input_shape)
    steps_per_epoch = (
        config.run.steps_per_epoch or source.info.num_train_examples // config.data.batch_size
    )
    data = data_lib.make_datasets_from_source(
        source,
        config.data.batch_size,
        seed=config.run.seed,
        steps_per_epoch=steps_per_epoch,
        start_step=start_step,
        total_steps=steps_per_epoch * config.run.epochs - start_step,
        shard_policy=(
            None if training_strategy.feeds_worker_rows else _shard_policy(config, source, cluster)
        ),
    )
    if training_strategy.feeds_worker_rows and cluster is not None:
        data = dataclasses.replace(data, train=training_strategy.worker_rows(data.train, cluster))
    model = build_compiled_model(
        config,
        data.info,
        strategy,
        data_lib.first_training_examples(source, config.data.batch_size)[0],
        cluster,
    )
    run = {
        **config.to_dict(),
        "num_replicas": replicas,
        "per_replica_batch_size": per_replica,
        "parameters": training_strategy.one_copy(model).count_params(),
    }
    if hasattr(model, "sharding_record"):
        run["sharding"] = model.sharding_record()
        logging.info("ZeRO sharding: %s", run["sharding"])
    split = split_summary(model)
    if split is not None:
        run["split"] = split.to_dict()
        if cluster is None or cluster.is_chief:
            logging.info("%s", split)
    record = RunRecord(
        output_dir, run, resume_from_epoch=resume_point.epoch if resume_point else None
    )
    if resume_point:
        record.add_resume(resume_point.epoch + 1, resume_point.step, resume_point.name, time.time())
        logging.info(
            "Resuming at epoch %d, step %d (from %s)",
            resume_point.epoch + 1,
            resume_point.step,
            resume_point.weights_path,
        )
    note_membership(
        record,
        cluster.num_workers if cluster else 1,
        epoch=resume_point.epoch + 1 if resume_point else 1,
        step=resume_point.step if resume_point else 0,
        global_step=start_step,
        log_dir=os.path.join(output_dir, "logs", "train"),
        is_chief=cluster is None or cluster.is_chief,
    )
    run_callbacks, nan_guard = standard_callbacks(
        config,
        output_dir,
        record,
        data.steps_per_epoch,
        cluster,
        resume_point,
        cluster_resolver=getattr(strategy, "cluster_resolver", None) if cluster else None,
        user_callbacks=user_callbacks,
    )
    training_strategy.finish_callbacks(run_callbacks, cluster)
    logging.info(
        "Training %s on %s: %s over %d replica(s), global batch %d (%d per replica).",
        config.model.name,
        config.data.dataset,
        config.distribution.strategy,
        replicas,
        config.data.batch_size,
        per_replica,
    )
    validation_steps = config.run.validation_steps or data.validation_steps
    try:
        model.fit(
            data.train,
            validation_data=data.validation,
            epochs=config.run.epochs,
            initial_epoch=resume_point.epoch if resume_point else 0,
            steps_per_epoch=data.steps_per_epoch,
            validation_steps=validation_steps,
            callbacks=run_callbacks,
            verbose=2,
        )
    except IncompatibleCheckpoint:
        record.put_back_previous()
        raise
    except Preempted as preempted:
        record.add_preemption(
            preempted.epoch + 1, preempted.step, os.path.basename(preempted.checkpoint), time.time()
        )
        raise
    finally:
        # Keras skips on_train_end when fit raises: give SIGTERM back, remove the scratch.
        for callback in run_callbacks:
            if isinstance(callback, SaveOnPreemption):
                callback.release()
    if nan_guard.failure:
        last_good = latest_checkpoint(os.path.join(output_dir, "checkpoints"))
        message = f"{nan_guard.failure}; last good checkpoint: {last_good or 'none yet'}"
        record.finish({}, failure=message)
        raise TrainingError(
            f"Training stopped: {message}. Lower --learning_rate or use --dtype=float32."
        )
    final = model.evaluate(data.validation, steps=validation_steps, verbose=0, return_dict=True)
    record.set_memory(
        job_memory(model, cluster, strategy, chief_drives=training_strategy.chief_drives_workers)
    )
    record.finish(final)
    if config.run.save_model and (cluster is None or cluster.is_chief):
        save_trained_model(model, config.run.save_model)
        logging.info("Saved the trained model: %s", config.run.save_model)
    logging.info("Finished. TensorBoard logs: %s", os.path.join(output_dir, "logs"))
    return record.record
