"""ZeRO-style sharding of a Keras model's training state over the data-parallel devices.

The formulas and the block layout are pure Python; `ZeroDataParallel` (TensorFlow) loads
when first asked for, so the planner can cost ZeRO without TensorFlow.
"""

import importlib

from tfmulti.zero.formulas import ZERO_STAGES, StateBytes, zero_state_bytes, zero_step_traffic
from tfmulti.zero.layout import ShardLayout

__all__ = [
    "ZERO_STAGES",
    "ShardLayout",
    "StateBytes",
    "ZeroDataParallel",
    "zero_state_bytes",
    "zero_step_traffic",
]


def __getattr__(name):
    if name == "ZeroDataParallel":
        return importlib.import_module("tfmulti.zero.zero_model").ZeroDataParallel
    raise AttributeError(f"module 'tfmulti.zero' has no attribute {name!r}")
