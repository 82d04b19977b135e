"""Choosing a parallel layout: meshes, schedules, micro-batches and stage splits, by simulation.

Pure Python; `tfmulti.planner.measure` (TensorFlow) measures a model's block costs.
"""

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
from tfmulti.planner.scoring import Layout, score_layout
from tfmulti.planner.search import meshes, search_layouts
from tfmulti.planner.tensor_bytes import tensor_group_bytes

__all__ = [
    "AffineTime",
    "BlockCost",
    "Hardware",
    "Layout",
    "ModelCosts",
    "blocks_at",
    "load_costs",
    "meshes",
    "ring_allreduce_seconds",
    "save_costs",
    "score_layout",
    "search_layouts",
    "tensor_group_bytes",
]
