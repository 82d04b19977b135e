"""Hybrid parallelism: data-parallel copies of a pipelined model, on one host or many."""

from tfmulti.collectives.worker_sums import WorkerCollectives
from tfmulti.hybrid.build import (
    build_hybrid_model,
    build_hybrid_model_from_model,
    copy_model,
    local_device_names,
)
from tfmulti.hybrid.hybrid_model import HybridPipelineModel
from tfmulti.hybrid.worker_input import worker_rows

__all__ = [
    "HybridPipelineModel",
    "WorkerCollectives",
    "build_hybrid_model",
    "build_hybrid_model_from_model",
    "copy_model",
    "local_device_names",
    "worker_rows",
]
