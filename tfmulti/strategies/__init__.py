"""Where a Keras model meets a way of spreading it over devices, one module per way.

Each way is a `TrainingStrategy` answering the same few questions (its cluster, strategy, data
replicas, scope, and `build`: the run's model in, a model `compile`/`fit` train out).
Scripts pick one by its `--strategy` name from `TRAINING_STRATEGIES`.

Example:
    >>> training_strategy = get_training_strategy("model_parallel")
    >>> source = model_source(config, info)
    >>> model = training_strategy.build(source, config, BuildContext(x, strategy))
"""

from tfmulti.strategies.base import (
    BuildContext,
    DevicePlacingStrategy,
    TrainingStrategy,
    check_batch_splits,
)
from tfmulti.strategies.data_parallel import DataParallel, MultiWorkerDataParallel
from tfmulti.strategies.hybrid import Hybrid
from tfmulti.strategies.keras_model_parallel import KerasModelParallel
from tfmulti.strategies.model_parallel import ModelParallel
from tfmulti.strategies.model_source import ModelSource, default_loss_and_metrics, model_source
from tfmulti.strategies.pipeline import Pipeline
from tfmulti.strategies.placement import Placement
from tfmulti.strategies.tensor_parallel import TensorParallel
from tfmulti.strategies.zero_data_parallel import ZeroDataParallelStrategy

TRAINING_STRATEGIES: dict[str, TrainingStrategy] = {
    "one_device": DataParallel(),
    "mirrored": DataParallel(),
    "multi_worker": MultiWorkerDataParallel(),
    "pipeline": Pipeline(),
    "model_parallel": ModelParallel(),
    "hybrid": Hybrid(),
    "keras_model_parallel": KerasModelParallel(),
}


# `--zero` > 0 under these strategies shards data parallelism's state (`tfmulti.zero`).
ZERO_STRATEGIES: dict[str, TrainingStrategy] = {
    "mirrored": ZeroDataParallelStrategy(across_workers=False),
    "multi_worker": ZeroDataParallelStrategy(across_workers=True),
}


def get_training_strategy(name: str, zero: int = 0) -> TrainingStrategy:
    """Returns the way of spreading a model named by `--strategy` (and `--zero`).

    Example:
        >>> type(get_training_strategy("pipeline")).__name__
        'Pipeline'
    """
    if name not in TRAINING_STRATEGIES:
        raise ValueError(
            f"Unknown strategy; use one of {list(TRAINING_STRATEGIES)}. Received: {name!r}"
        )
    if zero and name != "hybrid":  # a hybrid mesh shards its data axis's state itself
        if name not in ZERO_STRATEGIES:
            raise ValueError(
                f"--zero shards the state of data parallelism: use it with --strategy="
                f"{' or '.join([*ZERO_STRATEGIES, 'hybrid'])}, or drop it. Received: "
                f"--strategy={name} --zero={zero}"
            )
        return ZERO_STRATEGIES[name]
    return TRAINING_STRATEGIES[name]


__all__ = [
    "TRAINING_STRATEGIES",
    "BuildContext",
    "DataParallel",
    "DevicePlacingStrategy",
    "Hybrid",
    "KerasModelParallel",
    "ModelParallel",
    "ModelSource",
    "MultiWorkerDataParallel",
    "Pipeline",
    "Placement",
    "TrainingStrategy",
    "TensorParallel",
    "ZERO_STRATEGIES",
    "ZeroDataParallelStrategy",
    "check_batch_splits",
    "default_loss_and_metrics",
    "get_training_strategy",
    "model_source",
]
