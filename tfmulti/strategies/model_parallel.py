"""`--strategy=model_parallel`: tensor parallelism, layer placement or stages without a pipeline."""

from __future__ import annotations

import keras

from tfmulti.config import TrainConfig
from tfmulti.strategies.base import BuildContext, DevicePlacingStrategy
from tfmulti.strategies.model_source import ModelSource
from tfmulti.strategies.pipeline import build_staged_model
from tfmulti.strategies.placement import Placement
from tfmulti.strategies.tensor_parallel import TensorParallel


class ModelParallel(DevicePlacingStrategy):
    """Splits layers with `--tensor_parallel` > 1, places layers with `--placement` (and
    always for a user's model), else runs a reference model's block stages in turn."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        if config.distribution.tensor_parallel > 1:
            return TensorParallel().build(source, config, context)
        if config.distribution.placement or not source.is_reference:
            return Placement().build(source, config, context)
        return build_staged_model(source, config, context.sample_x, pipelined=False)
