"""`TrainConfig`: every setting of a training run, as plain values in named groups.

Scripts build one from flags (`tfmulti.flags.training_flags.config_from_flags`); library
code never reads flags. Each setting is a field of one group, named as its flag (`key`
metadata names the flag where the field's own name is shorter, as `model.name` for
`--model`), so flags become a config, and a config becomes a flat run record, without a
table copied by hand.

Example:
    >>> config = TrainConfig(model=ModelConfig("mlp"), data=DataConfig(batch_size=32))
    >>> config.model.name, config.data.batch_size
    ('mlp', 32)
    >>> TrainConfig.from_flat(model="mlp", batch_size=32) == config
    True
"""

from __future__ import annotations

import dataclasses

DTYPE_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop")
LR_SCHEDULE_NAMES = ("constant", "cosine", "linear")


def _keyed(key: str, default=dataclasses.MISSING, **kwargs):
    """A field whose flat key (flag and run-record name) is `key`, not the field's name."""
    return dataclasses.field(default=default, metadata={"key": key}, **kwargs)


@dataclasses.dataclass
class ModelConfig:
    """What model trains, and in which precision."""

    name: str = _keyed("model", "mlp")
    options: dict = _keyed("model_options", default_factory=dict)
    dtype: str = "float32"
    jit_compile: bool = False


@dataclasses.dataclass
class DataConfig:
    """Where the examples come from, how they batch and how workers split them."""

    dataset: str = "digits"
    data_path: str | None = None
    batch_size: int = 64
    shard_policy: str = "auto"


@dataclasses.dataclass
class OptimizerConfig:
    """The optimizer and its learning rate."""

    name: str = _keyed("optimizer", "adam")
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # A model the user's function returns compiled trains with its own optimizer unless
    # this is False (scripts: one of --optimizer, --learning_rate, --lr_schedule,
    # --warmup_steps is given); the four settings above then choose it.
    keep_compiled: bool = _keyed("keep_compiled_optimizer", True)


@dataclasses.dataclass
class RunConfig:
    """The training job: its length, outputs, checkpoints, logs and profiles."""

    epochs: int = 5
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    steps_per_execution: int = 1
    callbacks: str | None = None
    seed: int = 0
    model_dir: str = "runs/default"
    log_steps: int = 50
    profile_steps: tuple[int, int] | None = None
    resume: bool = False
    keep_checkpoints: int = 3
    checkpoint_steps: int = 0
    save_model: str | None = None


@dataclasses.dataclass
class DistributionConfig:
    """How the model is spread over devices: `strategy` and the settings of each one."""

    strategy: str = "mirrored"
    num_devices: int | None = None
    all_reduce: str = "auto"
    # ZeRO stage of data parallelism: 0 replicates all state, 1 shards optimizer state,
    # 2 also gradients, 3 also weights (`tfmulti.zero`).
    zero: int = 0
    placement: str | None = None
    mesh: str | None = None
    tensor_parallel: int = 1
    layout_map: str | None = None
    # Across workers the pipe axis crosses hosts, as DeepSpeed and Megatron lay it: only
    # activations at stage boundaries go over the network, not gradient sums.
    cross_host_axis: str = "pipe"


@dataclasses.dataclass
class ClusterConfig:
    """The workers of a multi-worker run and their collectives."""

    worker_hosts: list[str] | None = None
    task_index: int | None = None
    communication: str = "auto"
    collective_timeout: float | None = None
    connect_timeout: float | None = None
    # What every worker of a chief-driven run must hold alike, {"--name": value}: the
    # script's command line (`tfmulti.flags.agreed_flags`). It records where the config
    # came from rather than choosing anything, so configs compare without it.
    agreed_flags: dict = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass
class PipelineConfig:
    """Stages, micro-batches and schedule of a pipelined (or staged) model."""

    num_stages: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    chunks: int = 1
    partition: str = "uniform"
    remeasure_partition: bool = False
    remat: bool = False
    rolled: bool = True
    trace_steps: tuple[int, int] | None = None


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run; see `scripts/train.py --help` for each."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    distribution: DistributionConfig = dataclasses.field(default_factory=DistributionConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """A config from flat keys (`flat_keys()`), each routed to its group.

        Raises:
            TypeError: a key names no setting.
        """
        unknown = set(values) - set(flat_keys())
        if unknown:
            raise TypeError(f"Unknown settings {sorted(unknown)}; known: {flat_keys()}")
        groups = {}
        for group in dataclasses.fields(cls):
            group_class = group.default_factory
            groups[group.name] = group_class(
                **{
                    field.name: values[_flat_key(field)]
                    for field in dataclasses.fields(group_class)
                    if _flat_key(field) in values
                }
            )
        return cls(**groups)

    def to_dict(self) -> dict:
        """Every setting under its flat key, as a run record stores it."""
        return {
            _flat_key(field): getattr(getattr(self, group.name), field.name)
            for group in dataclasses.fields(self)
            for field in dataclasses.fields(getattr(self, group.name))
        }


def _flat_key(field: dataclasses.Field) -> str:
    return field.metadata.get("key", field.name)


def flat_keys() -> list[str]:
    """Every setting's flat key, in group order."""
    return list(TrainConfig().to_dict())
