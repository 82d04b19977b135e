"""ZeRO-style sharding of a Keras model's training state over the data-parallel devices."""

from tfmulti.zero.formulas import ZERO_STAGES, StateBytes, zero_state_bytes, zero_step_traffic
from tfmulti.zero.layout import ShardLayout
from tfmulti.zero.zero_model import ZeroDataParallel

__all__ = [
    "ZERO_STAGES",
    "ShardLayout",
    "StateBytes",
    "ZeroDataParallel",
    "zero_state_bytes",
    "zero_step_traffic",
]
