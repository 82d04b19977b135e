"""`TrainConfig`: every setting of a training run, as plain values.

Scripts build one from flags; library code never reads flags.
"""

from __future__ import annotations

import dataclasses

DTYPE_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop")
LR_SCHEDULE_NAMES = ("constant", "cosine", "linear")


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run; see `scripts/train.py --help` for each."""

    strategy: str = "mirrored"
    num_devices: int | None = None
    all_reduce: str = "auto"
    model: str = "mlp"
    model_options: dict = dataclasses.field(default_factory=dict)
    dataset: str = "digits"
    data_path: str | None = None
    batch_size: int = 64
    epochs: int = 5
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # A model the user's function returns compiled trains with its own optimizer unless
    # this is False (scripts: one of --optimizer, --learning_rate, --lr_schedule,
    # --warmup_steps is given); the four settings above then choose it.
    keep_compiled_optimizer: bool = True
    callbacks: str | None = None
    seed: int = 0
    model_dir: str = "runs/default"
    dtype: str = "float32"
    jit_compile: bool = False
    steps_per_execution: int = 1
    profile_steps: tuple[int, int] | None = None
    log_steps: int = 50
    resume: bool = False
    keep_checkpoints: int = 3
    checkpoint_steps: int = 0
    worker_hosts: list[str] | None = None
    task_index: int | None = None
    communication: str = "auto"
    collective_timeout: float | None = None
    connect_timeout: float | None = None
    shard_policy: str = "auto"
    num_stages: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    chunks: int = 1
    partition: str = "uniform"
    remeasure_partition: bool = False
    remat: bool = False
    rolled: bool = True
    trace_steps: tuple[int, int] | None = None
    placement: str | None = None
    mesh: str | None = None
    tensor_parallel: int = 1
    layout_map: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
