"""Pipeline parallelism: schedules as data (pure Python) and their TensorFlow executor.

The planning modules never import TensorFlow; names that need it load lazily.
"""

from tfmulti.pipeline.actions import ACTION_KINDS, Action, Schedule

__all__ = ["ACTION_KINDS", "Action", "Schedule"]
