"""tfmulti: train Keras 3 models on many devices with TensorFlow.

Public names load lazily so that `tfmulti.pipeline`'s planning modules can be
imported without TensorFlow.
"""

import importlib

from tfmulti.compat import install_when_keras_loads

__version__ = "0.1.0"

# Keras 3 needs fixes to train under MultiWorkerMirroredStrategy; they apply as
# soon as Keras is imported, whichever of Keras and tfmulti comes first.
install_when_keras_loads()

_LAZY_EXPORTS = {
    "configure_logical_devices": "tfmulti.devices",
    "get_strategy": "tfmulti.strategy",
    "per_replica_batch_size": "tfmulti.strategy",
    "TrainConfig": "tfmulti.config",
    "train": "tfmulti.training",
    "TrainingError": "tfmulti.errors",
    "ThroughputLogger": "tfmulti.callbacks",
    "StopOnNonFiniteLoss": "tfmulti.callbacks",
    "EpochCheckpoint": "tfmulti.checkpointing",
    "latest_checkpoint": "tfmulti.checkpointing",
    "ProfileSteps": "tfmulti.profiling",
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
    "parse_mesh": "tfmulti.mesh",
}


def __getattr__(name):
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tfmulti' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY_EXPORTS))
