"""Pipeline parallelism: schedules as data (pure Python) and their TensorFlow executor.

The planning modules never import TensorFlow; names that need it load lazily.
"""

import importlib

from tfmulti.pipeline.actions import ACTION_KINDS, Action, Schedule
from tfmulti.pipeline.balance import Block, Partition, balance, parse_partition_spec
from tfmulti.pipeline.dependencies import TimedAction
from tfmulti.pipeline.schedules import (
    SCHEDULE_NAMES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zb_h2,
)
from tfmulti.pipeline.simulate import CostModel, SimulationResult, StageCost, simulate
from tfmulti.pipeline.text import schedule_from_text, schedule_grid, schedule_to_text
from tfmulti.pipeline.validate import ScheduleError, validate_schedule

# The executor imports TensorFlow, so its names load on first use.
_RUNTIME_EXPORTS = (
    "BlockStage",
    "MODEL_PARALLEL",
    "PipelineModel",
    "PipelineTimelineCallback",
    "bubble_fraction",
    "measure_blocks",
    "model_parallel_schedule",
    "order_deviations",
    "partition_blocks",
    "peak_stashed_activations",
    "stages_from_blocks",
    "write_timeline_report",
)


def __getattr__(name):
    if name not in _RUNTIME_EXPORTS:
        raise AttributeError(f"module 'tfmulti.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module("tfmulti.pipeline.runtime"), name)


def __dir__():
    return sorted(list(globals()) + list(_RUNTIME_EXPORTS))


__all__ = [
    "ACTION_KINDS",
    "Action",
    "Block",
    "CostModel",
    "Partition",
    "SCHEDULE_NAMES",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "StageCost",
    "TimedAction",
    "balance",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_partition_spec",
    "schedule_from_text",
    "schedule_grid",
    "schedule_to_text",
    "simulate",
    "validate_schedule",
    "zb_h1",
    "zb_h2",
]
