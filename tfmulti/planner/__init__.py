"""Choosing a parallel layout: meshes, schedules, micro-batches and stage splits, by simulation.

Pure Python; `tfmulti.planner.measure` (TensorFlow) measures a model's block costs and
`tfmulti.planner.machine_benchmarks` (TensorFlow) the machine's own per-step costs.
"""

from tfmulti.planner.accuracy import Accuracy, accuracy
from tfmulti.planner.costs import (
    AffineTime,
    BlockCost,
    Hardware,
    ModelCosts,
    blocks_at,
    load_costs,
    ring_allreduce_seconds,
    save_costs,
)
from tfmulti.planner.hosts import cross_host_axes
from tfmulti.planner.machine import MachineCosts
from tfmulti.planner.scoring import Layout, score_layout
from tfmulti.planner.search import meshes, search_layouts
from tfmulti.planner.tensor_bytes import tensor_group_bytes

__all__ = [
    "Accuracy",
    "AffineTime",
    "BlockCost",
    "Hardware",
    "Layout",
    "MachineCosts",
    "ModelCosts",
    "accuracy",
    "blocks_at",
    "cross_host_axes",
    "load_costs",
    "meshes",
    "ring_allreduce_seconds",
    "save_costs",
    "score_layout",
    "search_layouts",
    "tensor_group_bytes",
]
