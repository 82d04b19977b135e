"""tfmulti: train Keras 3 models on many devices with TensorFlow.

Public names load lazily so that `tfmulti.pipeline`'s planning modules can be
imported without TensorFlow.
"""

import importlib

from tfmulti.compat import install_when_keras_loads

__version__ = "0.1.0"


def _hook_keras_distribution() -> None:
    """Loads `keras.distribution` on TensorFlow, which registers its hooks in compat."""
    importlib.import_module("tfmulti.keras_distribution.sharding")


# Keras 3 needs fixes to train under MultiWorkerMirroredStrategy; they apply as
# soon as Keras is imported, whichever of Keras and tfmulti comes first.

install_when_keras_loads(then=_hook_keras_distribution)

_LAZY_EXPORTS = {
    "configure_logical_devices": "tfmulti.platform.runtime.devices",
    "get_strategy": "tfmulti.platform.runtime.distribute_strategy",
    "per_replica_batch_size": "tfmulti.platform.runtime.distribute_strategy",
    "TrainConfig": "tfmulti.config",
    "train": "tfmulti.run.training",
    "TrainingError": "tfmulti.errors",
    "ThroughputLogger": "tfmulti.run.callbacks",
    "StopOnNonFiniteLoss": "tfmulti.run.callbacks",
    "EpochCheckpoint": "tfmulti.run.epoch_checkpoint",
    "latest_checkpoint": "tfmulti.run.epoch_checkpoint",
    "ProfileSteps": "tfmulti.run.profiling",
    "make_datasets": "tfmulti.data",
    "PipelineModel": "tfmulti.pipeline.runtime",
    "PipelineTimelineCallback": "tfmulti.pipeline.runtime",
    "place": "tfmulti.parallel",
    "ParallelMLP": "tfmulti.parallel",
    "ParallelSelfAttention": "tfmulti.parallel",
    "ColumnParallelDense": "tfmulti.parallel",
    "RowParallelDense": "tfmulti.parallel",
    "VocabParallelEmbedding": "tfmulti.parallel",
    "TensorParallelModel": "tfmulti.parallel",
    "unsplit_model": "tfmulti.parallel",
    "shard": "tfmulti.parallel",
    "variable_bytes_per_device": "tfmulti.parallel",
    "HybridPipelineModel": "tfmulti.hybrid",
    "parse_mesh": "tfmulti.platform.mesh",
    "ZeroDataParallel": "tfmulti.zero.zero_model",
}


def __getattr__(name):
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tfmulti' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY_EXPORTS))
