"""Pipeline parallelism: schedules as data (pure Python) and their TensorFlow executor.

The planning modules never import TensorFlow; names that need it load lazily.
"""

import importlib

from tfmulti.pipeline.actions import ACTION_KINDS, Action, Schedule
from tfmulti.pipeline.balance import Block, Partition, balance, parse_partition_spec
from tfmulti.pipeline.dependencies import TimedAction
from tfmulti.pipeline.schedule_files import (
    read_schedule_csv,
    schedule_from_csv,
    schedule_from_lists,
    schedule_to_csv,
    write_schedule_csv,
)
from tfmulti.pipeline.schedules import (
    SCHEDULE_NAMES,
    build_schedule,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    interleaved_zb,
    one_f_one_b,
    zb_h1,
    zb_h2,
    zbv,
)
from tfmulti.pipeline.simulate import CostModel, SimulationResult, StageCost, simulate
from tfmulti.pipeline.text import schedule_from_text, schedule_grid, schedule_to_text
from tfmulti.pipeline.validate import ScheduleError, validate_schedule


def __getattr__(name):
    # The executor's names (PipelineModel, ...) import TensorFlow, so they load on first use.
    runtime = importlib.import_module("tfmulti.pipeline.runtime")
    if name not in runtime.__all__:
        raise AttributeError(f"module 'tfmulti.pipeline' has no attribute {name!r}")
    return getattr(runtime, name)


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
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zb",
    "one_f_one_b",
    "parse_partition_spec",
    "read_schedule_csv",
    "schedule_from_csv",
    "schedule_from_lists",
    "schedule_from_text",
    "schedule_grid",
    "schedule_to_csv",
    "schedule_to_text",
    "simulate",
    "validate_schedule",
    "write_schedule_csv",
    "zb_h1",
    "zb_h2",
    "zbv",
]
