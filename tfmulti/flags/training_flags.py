"""Flags of `scripts/train.py`, in groups, and their conversion to a `TrainConfig`."""

from __future__ import annotations

import ast
import os

from absl import flags

from tfmulti.config import (
    DTYPE_POLICIES,
    LR_SCHEDULE_NAMES,
    OPTIMIZER_NAMES,
    DistributionConfig,
    TrainConfig,
    flat_keys,
)
from tfmulti.flags.agreed_flags import agreed_flags
from tfmulti.flags.help import flag_group
from tfmulti.names import (
    ALL_REDUCE_NAMES,
    DATASET_NAMES,
    HYBRID_STRATEGY_NAME,
    KERAS_MODEL_PARALLEL_NAME,
    MODEL_NAMES,
    STRATEGY_FLAG_REASONS,
    STRATEGY_FLAGS,
    TENSOR_REDUCTION_NAMES,
    TRAIN_STRATEGY_NAMES,
)
from tfmulti.pipeline.schedules import SCHEDULE_NAMES, chunks_fit_schedule
from tfmulti.platform.launching.launcher import VIRTUAL_DEVICES_ENV
from tfmulti.user_code import is_function_reference

FLAGS = flags.FLAGS
PLACEMENT_POLICIES = ("auto", "params", "time", "memory")
# Any of these on the command line replaces the optimizer a user's model was compiled with.
OPTIMIZER_FLAGS = ("optimizer", "learning_rate", "lr_schedule", "warmup_steps")


def _parses_as_step_range(text: str | None) -> bool:
    from tfmulti.step_ranges import parse_step_range

    if text is None:
        return True
    try:
        parse_step_range(text)
    except ValueError:
        return False
    return True


def parse_model_option(text: str) -> tuple[str, object] | None:
    """Returns (name, value) of "NAME=VALUE", the value read as a Python literal if it is one."""
    name, separator, value = text.partition("=")
    if not separator or not name.strip().isidentifier():
        return None
    try:
        return name.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return name.strip(), value.strip()


@flag_group("devices")
def define_device_flags() -> None:
    """Strategy and device flags."""
    flags.DEFINE_enum("strategy", "mirrored", TRAIN_STRATEGY_NAMES, "How to spread training.")
    flags.DEFINE_integer(
        "virtual_devices",
        int(os.environ.get(VIRTUAL_DEVICES_ENV, "0")),
        "Split the first CPU (or GPU) into this many logical devices before TensorFlow "
        f"starts; 0 keeps the devices as they are. Defaults to ${VIRTUAL_DEVICES_ENV}.",
        lower_bound=0,
        # Each logical device costs memory and start-up time (8192: 1.7 GB, 37 s).
        upper_bound=1024,
    )
    flags.DEFINE_integer(
        "num_devices", 0, "Devices to use on this host; 0 means all.", lower_bound=0
    )
    flags.DEFINE_enum(
        "all_reduce", "auto", ALL_REDUCE_NAMES, "Cross-device all-reduce of `mirrored`."
    )
    flags.DEFINE_enum(
        "zero",
        "0",
        ["0", "1", "2", "3"],
        "ZeRO stage of mirrored, multi_worker or hybrid data parallelism: 0 replicates all "
        "state, 1 shards optimizer state over the data-parallel devices, 2 also gradients, "
        "3 also weights (under hybrid, by whole variables, with tensor > 1 by tensor shards: "
        "each held by one data replica, the others reading it there; not with --jit_compile).",
    )


@flag_group("model and data")
def define_data_flags() -> None:
    """Model and data flags."""
    flags.DEFINE_string(
        "model",
        "mlp",
        f"Model to train: a reference model ({', '.join(MODEL_NAMES)}) or your own, "
        "package.module:function returning a keras.Model (called with --model_option).",
    )
    flags.register_validator(
        "model",
        lambda name: name in MODEL_NAMES or is_function_reference(name),
        message=f"--model must be one of {list(MODEL_NAMES)} or package.module:function",
    )
    flags.DEFINE_string(
        "dataset",
        "digits",
        f"Training data: a named dataset ({', '.join(DATASET_NAMES)}) or your own, "
        "package.module:function returning a tf.data.Dataset of (x, y) examples, a "
        "(train, validation) pair of them, (x, y) arrays or ((x, y), (x_val, y_val)).",
    )
    flags.register_validator(
        "dataset",
        lambda name: name in DATASET_NAMES or is_function_reference(name),
        message=f"--dataset must be one of {list(DATASET_NAMES)} or package.module:function",
    )
    flags.DEFINE_string("data_path", None, "File(s) for --dataset=npz or tfrecord.")
    flags.DEFINE_integer("seed", 0, "Seed of weights, data order and dropout.")
    flags.DEFINE_multi_string(
        "model_option",
        [],
        "A model option NAME=VALUE (a Python literal), repeatable, e.g. "
        "--model_option=num_layers=6 --model_option='hidden_units=(128, 128)'.",
    )
    flags.register_validator(
        "model_option",
        lambda options: all(parse_model_option(option) for option in options),
        message="--model_option must be NAME=VALUE, e.g. --model_option=num_layers=6",
    )


@flag_group("training loop")
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
    flags.DEFINE_enum(
        "optimizer",
        "adam",
        OPTIMIZER_NAMES,
        "Optimizer. A model your --model=module:function returns compiled keeps its own "
        "optimizer (schedule included) unless this, --learning_rate, --lr_schedule or "
        "--warmup_steps is given.",
    )
    flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate.", lower_bound=0.0)
    flags.DEFINE_enum(
        "lr_schedule",
        "constant",
        LR_SCHEDULE_NAMES,
        "Learning rate after the warm-up: constant, or cosine or linear decay to 0 at the "
        "run's last step (--epochs x steps per epoch).",
    )
    flags.DEFINE_integer(
        "warmup_steps",
        0,
        "Steps over which the learning rate climbs linearly from 0 to --learning_rate.",
        lower_bound=0,
    )
    flags.register_multi_flags_validator(
        ["warmup_steps", "steps_per_epoch", "epochs"],
        lambda values: (
            not values["steps_per_epoch"]
            or values["warmup_steps"] < values["steps_per_epoch"] * values["epochs"]
        ),
        message="--warmup_steps must leave steps after the warm-up: fewer than --epochs x "
        "--steps_per_epoch",
    )
    flags.DEFINE_string(
        "callbacks",
        None,
        "Your Keras callbacks: package.module:function returning a list of "
        "keras.callbacks.Callback (EarlyStopping, ReduceLROnPlateau, your own); they run "
        "next to tfmulti's under every strategy.",
    )
    flags.register_validator(
        "callbacks",
        lambda reference: reference is None or is_function_reference(reference),
        message="--callbacks must be package.module:function, e.g. "
        "--callbacks=my_project.hooks:callbacks",
    )
    flags.DEFINE_enum("dtype", "float32", DTYPE_POLICIES, "Keras dtype policy.")
    flags.DEFINE_boolean("jit_compile", False, "Compile train steps with XLA.")
    flags.DEFINE_integer(
        "steps_per_execution", 1, "Train steps run per call into TensorFlow.", lower_bound=1
    )


@flag_group("output")
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
        "resume",
        False,
        "Continue the run in --model_dir at the exact step of its newest complete checkpoint "
        "(implied when scripts/launch.py restarts the workers).",
    )
    flags.DEFINE_integer(
        "keep_checkpoints", 3, "How many epoch checkpoints to keep.", lower_bound=1
    )
    flags.DEFINE_integer(
        "checkpoint_steps",
        0,
        "Also save a resumable checkpoint every N steps (0: at epoch ends only).",
        lower_bound=0,
    )
    flags.DEFINE_string(
        "save_model",
        None,
        "At the end, the chief saves the trained model here as a plain single-device .keras "
        "file, which keras.saving.load_model loads on one device (a model of Keras layers "
        "without tfmulti; one with custom layers once their module is imported).",
    )
    flags.register_validator(
        "save_model",
        lambda path: path is None or path.endswith(".keras"),
        message="--save_model must name a .keras file, e.g. runs/model.keras",
    )


def _is_partition_spec(text: str) -> bool:
    from tfmulti.pipeline.balance import parse_partition_spec

    policy, _, names = text.partition(":")
    if policy == "layers":
        return all(name.strip() for name in names.split(","))
    try:
        parse_partition_spec(text)
    except ValueError:
        return False
    return True


def _parsed_mesh(text: str):
    """The mesh `text` names, or None when it does not parse (`_is_mesh` reports that)."""
    from tfmulti.platform.mesh import MeshError, parse_mesh, resolve_data_axis

    try:
        return parse_mesh(resolve_data_axis(text, None))
    except MeshError:
        return None


def _is_schedule(value: str) -> bool:
    return value in SCHEDULE_NAMES or (value.endswith(".csv") and os.path.isfile(value))


def _chunks_fit_schedule(schedule: str, chunks: int) -> bool:
    return schedule not in SCHEDULE_NAMES or chunks_fit_schedule(schedule, chunks)


def _is_mesh(text: str | None) -> bool:
    return text is None or _parsed_mesh(text) is not None


@flag_group("pipeline, model, tensor and hybrid parallelism")
def define_pipeline_flags() -> None:
    """Flags of --strategy=pipeline and --strategy=model_parallel."""
    flags.DEFINE_integer(
        "num_stages", 2, "Pipeline depth: devices the stages are spread over.", lower_bound=1
    )
    flags.DEFINE_integer(
        "microbatches", 4, "Micro-batches per step; each needs at least one row.", lower_bound=1
    )
    flags.DEFINE_string(
        "schedule",
        "1f1b",
        f"Pipeline schedule: one of {', '.join(SCHEDULE_NAMES)}, or a .csv file of actions "
        "per device in PyTorch's compute_only format (0F0,1I0,1W0,...; one row per device).",
    )
    flags.register_validator(
        "schedule",
        _is_schedule,
        message=f"--schedule must be one of {', '.join(SCHEDULE_NAMES)} or an existing .csv "
        "schedule file",
    )
    flags.DEFINE_integer(
        "chunks",
        1,
        "Model chunks per device: >= 2 with interleaved_1f1b and interleaved_zb, 2 with zbv "
        "and dualpipev, as in the file with a .csv schedule.",
        lower_bound=1,
    )
    flags.DEFINE_string(
        "partition",
        "uniform",
        "Stage split: uniform, params, time, manual:3,6,9 (first block of each later stage "
        "of a reference model) or layers:NAME,NAME (layers where later stages of your "
        "--model=module:function begin).",
    )
    flags.register_validator(
        "partition",
        _is_partition_spec,
        message="--partition must be uniform, params, time, manual:B1,B2,... "
        "(first block of each later stage) or layers:NAME,NAME,...",
    )
    flags.DEFINE_boolean(
        "remeasure_partition",
        False,
        "With --partition=time (and layer placement): time the blocks again instead of "
        "reusing the timings kept "
        "in --model_dir/partition_costs.json (not when resuming: the checkpoint holds "
        "the stages those timings cut).",
    )
    flags.DEFINE_boolean("remat", False, "Recompute each stage's forward in its backward.")
    flags.DEFINE_boolean(
        "rolled",
        True,
        "With --strategy=pipeline: run the schedule as one loop of rounds, warm-up and "
        "cool-down included (GPipe: two loops), so start-up does not grow with "
        "--microbatches or stages; each round costs some loop control; --norolled traces "
        "every action.",
    )
    flags.DEFINE_string(
        "placement",
        None,
        "With --strategy=model_parallel: put each layer of the model on a device by "
        "auto|params|time|memory balancing, or by a JSON file "
        '{"layer name or regex": device index or name}.',
    )
    flags.register_validator(
        "placement",
        lambda placement: (
            placement is None or placement in PLACEMENT_POLICIES or os.path.isfile(placement)
        ),
        message="--placement must be auto, params, time, memory or an existing JSON file",
    )
    flags.DEFINE_string(
        "trace_steps", None, "Record the measured pipeline timeline of steps FIRST,LAST."
    )
    flags.register_validator(
        "trace_steps",
        _parses_as_step_range,
        message="--trace_steps must be FIRST,LAST with 1 <= FIRST <= LAST, e.g. 3,4",
    )
    flags.DEFINE_integer(
        "tensor_parallel",
        1,
        "Split the Transformer's attention heads, MLP hidden units and vocabulary over K "
        "devices (Megatron-style); with --strategy=model_parallel --model=transformer.",
        lower_bound=1,
    )
    flags.DEFINE_enum(
        "tensor_reduce",
        "ring",
        TENSOR_REDUCTION_NAMES,
        "All-reduce of tensor-parallel layers (--tensor_parallel, --mesh=...,tensor=K): ring "
        "(placed ring ops) or collective (TensorFlow's collective ops, NCCL on GPUs).",
    )
    flags.DEFINE_string(
        "layout_map",
        None,
        "With --strategy=keras_model_parallel: package.module:function taking a "
        "keras.distribution.DeviceMesh with axes (batch, model), of shape (1, devices) or "
        "(data, tensor) of --mesh, and returning a keras.distribution.LayoutMap (e.g. a "
        "KerasHub backbone's get_layout_map).",
    )
    flags.DEFINE_string(
        "mesh",
        None,
        "Device mesh of --strategy=hybrid, e.g. data=2,pipe=2: data x pipe = devices per "
        "host x workers; each data replica pipelines over pipe devices of one host. With "
        "--strategy=keras_model_parallel, data=D,tensor=K: the (batch, model) mesh's shape.",
    )
    flags.register_validator(
        "mesh", _is_mesh, message="--mesh must be like data=2,pipe=2 (or data=auto,pipe=2)"
    )
    flags.DEFINE_enum(
        "cross_host_axis",
        DistributionConfig.cross_host_axis,
        ("data", "pipe"),
        "With --strategy=hybrid across workers, the --mesh axis laid across the workers: pipe "
        "(each replica's stages on different workers, the chief drives them all; only "
        "activations and their gradients cross hosts; pipe must be a multiple of the "
        "workers) or data (each worker holds whole pipelines; gradients are summed between "
        "workers; the axis an elastic job resizes).",
    )
    flags.register_multi_flags_validator(
        ["strategy", "mesh"],
        lambda values: values["strategy"] != HYBRID_STRATEGY_NAME or values["mesh"] is not None,
        message="--strategy=hybrid needs --mesh, e.g. --mesh=data=2,pipe=2",
    )
    flags.register_multi_flags_validator(
        ["schedule", "chunks"],
        lambda values: _chunks_fit_schedule(values["schedule"], values["chunks"]),
        message="--chunks must fit --schedule: >= 2 with interleaved_1f1b and interleaved_zb, "
        "2 with zbv and dualpipev, 1 with the others (a .csv schedule is checked against its "
        "file)",
    )


@flag_group("cluster (multi-worker)")
def define_cluster_flags() -> None:
    """Flags of --strategy=multi_worker (else TF_CONFIG or SLURM describe the cluster)."""
    flags.DEFINE_list(
        "worker_hosts", None, "Every worker's host:port, in rank order (else TF_CONFIG, SLURM)."
    )
    flags.DEFINE_integer(
        "task_index", None, "This worker's rank in --worker_hosts; 0 is the chief.", lower_bound=0
    )
    flags.register_multi_flags_validator(
        ["worker_hosts", "task_index"],
        lambda values: (values["worker_hosts"] is None) == (values["task_index"] is None),
        message="--worker_hosts and --task_index go together: give both or neither",
    )
    flags.DEFINE_enum(
        "communication", "auto", ("auto", "ring", "nccl"), "Collective implementation."
    )
    flags.DEFINE_float(
        "collective_timeout",
        None,
        "Seconds before a stuck collective fails instead of hanging (at least 1).",
        lower_bound=1.0,
    )
    flags.DEFINE_float(
        "connect_timeout",
        None,
        "Seconds to wait for every worker to join before giving up with a message.",
        lower_bound=0.001,
    )
    flags.DEFINE_enum(
        "shard_policy",
        "auto",
        ("auto", "file", "data", "off"),
        "How workers split the input: by file, by batch (data), auto (file, else data), off.",
    )


STRATEGY_ONLY_FLAGS = sorted({name for names in STRATEGY_FLAGS.values() for name in names})


def _strategy_takes_its_flags(values: dict) -> bool:
    """Validates that every strategy-only flag set away from its default is one the chosen
    `--strategy` takes (`tfmulti.names.STRATEGY_FLAGS`); raises the one-line refusal."""
    strategy = values["strategy"]
    for name in STRATEGY_ONLY_FLAGS:
        if values[name] == FLAGS[name].default or name in STRATEGY_FLAGS[strategy]:
            continue
        takers = " or ".join(sorted(s for s, names in STRATEGY_FLAGS.items() if name in names))
        given = f"--no{name}" if values[name] is False else f"--{name}"
        reason = STRATEGY_FLAG_REASONS.get(name)
        raise flags.ValidationError(
            f"{given} goes only with --strategy={takers}, not --strategy={strategy}"
            + (f" ({reason})" if reason else "")
            + "; drop it, or change --strategy"
        )
    return True


def define_train_flags() -> None:
    """Defines every flag of `scripts/train.py`."""
    define_device_flags()
    define_data_flags()
    define_pipeline_flags()
    define_cluster_flags()
    define_loop_flags()
    define_output_flags()
    flags.register_multi_flags_validator(
        ["strategy", "layout_map"],
        lambda values: (
            values["strategy"] != KERAS_MODEL_PARALLEL_NAME
            or (values["layout_map"] is not None and is_function_reference(values["layout_map"]))
        ),
        message="--strategy=keras_model_parallel needs --layout_map=package.module:function",
    )
    flags.register_multi_flags_validator(
        ["strategy", *STRATEGY_ONLY_FLAGS], _strategy_takes_its_flags, message=""
    )
    flags.register_multi_flags_validator(
        ["tensor_parallel", "model", "jit_compile"],
        lambda values: (
            values["tensor_parallel"] == 1
            or (values["model"] == "transformer" and not values["jit_compile"])
        ),
        message="--tensor_parallel > 1 splits the reference Transformer: use "
        "--model=transformer, without --jit_compile (a split layer spans several devices)",
    )
    flags.register_multi_flags_validator(
        ["mesh", "jit_compile"],
        lambda values: (
            not values["jit_compile"]
            or values["mesh"] is None
            or getattr(_parsed_mesh(values["mesh"]), "tensor", 1) == 1
        ),
        message="--jit_compile does not go with a --mesh of tensor > 1 (XLA compiles a stage "
        "for one device, a tensor group spans several); drop --jit_compile or use tensor=1",
    )
    flags.register_multi_flags_validator(
        ["strategy", "zero", "jit_compile"],
        lambda values: (
            not values["jit_compile"]
            or values["strategy"] != HYBRID_STRATEGY_NAME
            or values["zero"] != "3"
        ),
        message="--zero=3 under --strategy=hybrid does not go with --jit_compile (XLA compiles "
        "a stage for one device, and a stage reads weights their owner data replicas hold on "
        "other devices); drop --jit_compile or use --zero=2",
    )
    flags.register_multi_flags_validator(
        ["tensor_reduce", "jit_compile"],
        lambda values: values["tensor_reduce"] == "ring" or not values["jit_compile"],
        message="--tensor_reduce=collective does not go with --jit_compile (XLA compiles a "
        "stage for one device); use --tensor_reduce=ring",
    )


def _step_range_or_none(text: str | None) -> tuple[int, int] | None:
    from tfmulti.step_ranges import parse_step_range

    return parse_step_range(text) if text else None


def _zero_is_none(value: int) -> int | None:
    return value or None


# How a flag's value becomes its setting, where it is not the value itself.
_SETTING_FROM_FLAG = {
    "num_devices": _zero_is_none,
    "zero": int,
    "steps_per_epoch": _zero_is_none,
    "validation_steps": _zero_is_none,
    "profile_steps": _step_range_or_none,
    "trace_steps": _step_range_or_none,
}
# Settings no single flag gives, from all of them.
_DERIVED_SETTINGS = {
    "model_options": lambda: dict(parse_model_option(option) for option in FLAGS.model_option),
    "keep_compiled_optimizer": lambda: not any(FLAGS[name].present for name in OPTIMIZER_FLAGS),
    "agreed_flags": agreed_flags,
}


def config_from_flags() -> TrainConfig:
    """Builds a `TrainConfig` from the parsed flags: each setting from the flag of its key."""
    values = {}
    for key in flat_keys():
        if key in _DERIVED_SETTINGS:
            values[key] = _DERIVED_SETTINGS[key]()
        else:
            values[key] = _SETTING_FROM_FLAG.get(key, lambda value: value)(FLAGS[key].value)
    return TrainConfig.from_flat(**values)
