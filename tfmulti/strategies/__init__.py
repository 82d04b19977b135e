"""Where a Keras model meets a way of spreading it over devices, one module per way.

Each way is a `Spread` answering the same few questions (its cluster, strategy, data
replicas, scope, and `build`: the run's model in, a model `compile`/`fit` train out).
Scripts pick one by its `--strategy` name from `SPREADS`.

Example:
    >>> spread = get_spread("model_parallel")
    >>> model = spread.build(model_source(config, info), config, BuildContext(x, strategy))
"""

from tfmulti.strategies.base import BuildContext, DeviceSpread, Spread, check_batch_splits
from tfmulti.strategies.data_parallel import DataParallel, MultiWorkerDataParallel
from tfmulti.strategies.hybrid import Hybrid
from tfmulti.strategies.keras_model_parallel import KerasModelParallel
from tfmulti.strategies.model_parallel import ModelParallel
from tfmulti.strategies.model_source import ModelSource, default_loss_and_metrics, model_source
from tfmulti.strategies.pipeline import Pipeline
from tfmulti.strategies.placement import Placement
from tfmulti.strategies.tensor_parallel import TensorParallel

SPREADS: dict[str, Spread] = {
    "one_device": DataParallel(),
    "mirrored": DataParallel(),
    "multi_worker": MultiWorkerDataParallel(),
    "pipeline": Pipeline(),
    "model_parallel": ModelParallel(),
    "hybrid": Hybrid(),
    "keras_model_parallel": KerasModelParallel(),
}


def get_spread(name: str) -> Spread:
    """Returns the way of spreading a model named by `--strategy`.

    Example:
        >>> type(get_spread("pipeline")).__name__
        'Pipeline'
    """
    if name not in SPREADS:
        raise ValueError(f"Unknown strategy; use one of {list(SPREADS)}. Received: {name!r}")
    return SPREADS[name]


__all__ = [
    "SPREADS",
    "BuildContext",
    "DataParallel",
    "DeviceSpread",
    "Hybrid",
    "KerasModelParallel",
    "ModelParallel",
    "ModelSource",
    "MultiWorkerDataParallel",
    "Pipeline",
    "Placement",
    "Spread",
    "TensorParallel",
    "check_batch_splits",
    "default_loss_and_metrics",
    "get_spread",
    "model_source",
]
