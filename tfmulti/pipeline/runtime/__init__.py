"""The TensorFlow side of tfmulti.pipeline: executing schedules on devices.

Everything that imports TensorFlow lives in this subpackage.
"""

from tfmulti.pipeline.runtime.pipeline_model import PipelineModel
from tfmulti.pipeline.runtime.schedule_choice import MODEL_PARALLEL, model_parallel_schedule

__all__ = ["MODEL_PARALLEL", "PipelineModel", "model_parallel_schedule"]
