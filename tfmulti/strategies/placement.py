"""Layer placement: each layer of the model on a device, run one after another."""

from __future__ import annotations

import keras
from absl import logging

from tfmulti.config import TrainConfig
from tfmulti.platform.runtime.devices import first_logical_devices
from tfmulti.strategies.base import BuildContext, DevicePlacingStrategy
from tfmulti.strategies.model_source import ModelSource
from tfmulti.strategies.pipeline import kept_costs

# Without --placement, balance by time measured on the sample batch.
DEFAULT_PLACEMENT = "auto"


class Placement(DevicePlacingStrategy):
    """Any functional model through `tfmulti.parallel.place`, by `--placement`."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        """The model's layers placed over `--num_stages` devices (a `PlacedModel`)."""
        from tfmulti.parallel import place_reference_model

        placed, _ = place_reference_model(
            source.model(),
            first_logical_devices(
                config.pipeline.num_stages, f"--num_stages={config.pipeline.num_stages}"
            ),
            config.distribution.placement or DEFAULT_PLACEMENT,
            sample_input=context.sample_x,
            print_fn=logging.info,
            cost_cache=kept_costs(config),
        )
        return placed
