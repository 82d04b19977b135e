"""Flags of `scripts/train.py`, in groups, and their conversion to a `TrainConfig`."""

from __future__ import annotations

import os

from absl import flags

from tfmulti.config import DTYPE_POLICIES, OPTIMIZER_NAMES, TrainConfig
from tfmulti.names import ALL_REDUCE_NAMES, DATASET_NAMES, MODEL_NAMES, STRATEGY_NAMES

FLAGS = flags.FLAGS
VIRTUAL_DEVICES_ENV = "TFMULTI_VIRTUAL_DEVICES"


def _parses_as_step_range(text: str | None) -> bool:
    from tfmulti.step_ranges import parse_step_range

    if text is None:
        return True
    try:
        parse_step_range(text)
    except ValueError:
        return False
    return True


def define_device_flags() -> None:
    """Strategy and device flags."""
    flags.DEFINE_enum("strategy", "mirrored", STRATEGY_NAMES, "How to spread training.")
    flags.DEFINE_integer(
        "virtual_devices",
        int(os.environ.get(VIRTUAL_DEVICES_ENV, "0")),
        "Split the first CPU (or GPU) into this many logical devices before TensorFlow "
        f"starts; 0 keeps the devices as they are. Defaults to ${VIRTUAL_DEVICES_ENV}.",
        lower_bound=0,
    )
    flags.DEFINE_integer(
        "num_devices", 0, "Devices to use on this host; 0 means all.", lower_bound=0
    )
    flags.DEFINE_enum(
        "all_reduce", "auto", ALL_REDUCE_NAMES, "Cross-device all-reduce of `mirrored`."
    )


def define_data_flags() -> None:
    """Model and data flags."""
    flags.DEFINE_enum("model", "mlp", MODEL_NAMES, "Reference model to train.")
    flags.DEFINE_enum("dataset", "digits", DATASET_NAMES, "Training data.")
    flags.DEFINE_string("data_path", None, "File(s) for --dataset=npz or tfrecord.")
    flags.DEFINE_integer("seed", 0, "Seed of weights, data order and dropout.")


def define_loop_flags() -> None:
    """Optimisation and training-loop flags."""
    flags.DEFINE_integer(
        "batch_size", 64, "GLOBAL batch size, split evenly over replicas.", lower_bound=1
    )
    flags.DEFINE_integer("epochs", 5, "Epochs to train.", lower_bound=1)
    flags.DEFINE_integer(
        "steps_per_epoch", 0, "Steps per epoch; 0 means one pass over the data.", lower_bound=0
    )
    flags.DEFINE_integer(
        "validation_steps", 0, "Validation steps; 0 means the whole set.", lower_bound=0
    )
    flags.DEFINE_enum("optimizer", "adam", OPTIMIZER_NAMES, "Optimizer.")
    flags.DEFINE_float("learning_rate", 1e-3, "Learning rate.", lower_bound=0.0)
    flags.DEFINE_enum("dtype", "float32", DTYPE_POLICIES, "Keras dtype policy.")
    flags.DEFINE_boolean("jit_compile", False, "Compile train steps with XLA.")
    flags.DEFINE_integer(
        "steps_per_execution", 1, "Train steps run per call into TensorFlow.", lower_bound=1
    )


def define_output_flags() -> None:
    """Output, logging and profiling flags."""
    flags.DEFINE_string("model_dir", "runs/default", "Where logs, checkpoints and metrics go.")
    flags.DEFINE_integer(
        "log_steps", 50, "Log examples/sec every this many steps; 0: per epoch.", lower_bound=0
    )
    flags.DEFINE_string(
        "profile_steps", None, "Profile training steps FIRST,LAST (1-based), e.g. 3,5."
    )
    flags.register_validator(
        "profile_steps",
        _parses_as_step_range,
        message="--profile_steps must be FIRST,LAST with 1 <= FIRST <= LAST, e.g. 3,5",
    )
    flags.DEFINE_boolean(
        "resume", False, "Continue the run in --model_dir from its last completed epoch."
    )
    flags.DEFINE_integer(
        "keep_checkpoints", 3, "How many epoch checkpoints to keep.", lower_bound=1
    )


def define_train_flags() -> None:
    """Defines every flag of `scripts/train.py`."""
    define_device_flags()
    define_data_flags()
    define_loop_flags()
    define_output_flags()


def config_from_flags() -> TrainConfig:
    """Builds a `TrainConfig` from the parsed flags."""
    from tfmulti.step_ranges import parse_step_range

    return TrainConfig(
        strategy=FLAGS.strategy,
        num_devices=FLAGS.num_devices or None,
        all_reduce=FLAGS.all_reduce,
        model=FLAGS.model,
        dataset=FLAGS.dataset,
        data_path=FLAGS.data_path,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps_per_epoch or None,
        validation_steps=FLAGS.validation_steps or None,
        optimizer=FLAGS.optimizer,
        learning_rate=FLAGS.learning_rate,
        seed=FLAGS.seed,
        model_dir=FLAGS.model_dir,
        dtype=FLAGS.dtype,
        jit_compile=FLAGS.jit_compile,
        steps_per_execution=FLAGS.steps_per_execution,
        profile_steps=parse_step_range(FLAGS.profile_steps) if FLAGS.profile_steps else None,
        log_steps=FLAGS.log_steps,
        resume=FLAGS.resume,
        keep_checkpoints=FLAGS.keep_checkpoints,
    )
