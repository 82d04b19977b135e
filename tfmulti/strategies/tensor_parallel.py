"""Tensor parallelism: attention heads, MLP units and vocabulary split over devices."""

from __future__ import annotations

import keras

from tfmulti.config import TrainConfig
from tfmulti.strategies.base import BuildContext, DevicePlacingStrategy
from tfmulti.strategies.model_source import ModelSource


class TensorParallel(DevicePlacingStrategy):
    """The reference Transformer built from split layers over `--tensor_parallel` devices."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        if not source.is_reference:
            raise ValueError(
                "--tensor_parallel builds the reference Transformer from split layers; build "
                "your model from tfmulti.parallel's split layers and train it with "
                f"--strategy=model_parallel instead. Received: --model={source.name}"
            )
        return source.split_model(config.distribution.tensor_parallel)
