"""The TensorFlow side of tfmulti.pipeline: executing schedules on devices.

Everything that imports TensorFlow lives in this subpackage.
"""

from tfmulti.costing.cost_cache import CostCache
from tfmulti.pipeline.runtime.measured import (
    bubble_fraction,
    order_deviations,
    peak_stashed_activations,
)
from tfmulti.pipeline.runtime.pipeline_model import PipelineModel
from tfmulti.pipeline.runtime.schedule_choice import MODEL_PARALLEL, model_parallel_schedule
from tfmulti.pipeline.runtime.timeline_report import (
    PipelineTimelineCallback,
    write_timeline_report,
)
from tfmulti.pipeline.stages.block_partition import (
    BlockStage,
    measure_blocks,
    partition_blocks,
    stages_from_blocks,
)
from tfmulti.pipeline.stages.export import chained_model
from tfmulti.pipeline.stages.graph_partition import GRAPH_PARTITION_POLICIES, choose_boundaries
from tfmulti.pipeline.stages.graph_stages import GraphStage, graph_stages
from tfmulti.pipeline.stages.model_stages import stages_from_model

__all__ = [
    "BlockStage",
    "CostCache",
    "GRAPH_PARTITION_POLICIES",
    "GraphStage",
    "MODEL_PARALLEL",
    "PipelineModel",
    "PipelineTimelineCallback",
    "bubble_fraction",
    "chained_model",
    "choose_boundaries",
    "graph_stages",
    "measure_blocks",
    "model_parallel_schedule",
    "order_deviations",
    "partition_blocks",
    "peak_stashed_activations",
    "stages_from_blocks",
    "stages_from_model",
    "write_timeline_report",
]
