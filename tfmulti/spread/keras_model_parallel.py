"""`--strategy=keras_model_parallel`: the model built under `keras.distribution.ModelParallel`.

The layout map comes from the user's `package.module:function(device_mesh)` (e.g. a
KerasHub backbone's `get_layout_map`), over a `(1, K)` mesh of this host's devices;
`tfmulti.parallel.keras_distribution` shards the weights it names as each layer builds.
"""

from __future__ import annotations

import keras
from absl import logging

from tfmulti.config import TrainConfig
from tfmulti.devices import first_logical_devices, logical_device_names
from tfmulti.parallel import variable_bytes_per_device
from tfmulti.parallel.layer_sharding import sharded_views
from tfmulti.spread.base import BuildContext, DeviceSpread
from tfmulti.spread.model_source import ModelSource
from tfmulti.user_code import load_function

LAYOUT_MAP_FLAG = "--layout_map"


def layout_map_for(config: TrainConfig) -> keras.distribution.LayoutMap:
    """Calls the `--layout_map` function on a `("batch", "model")` mesh of shape (1, K)."""
    devices = first_logical_devices(
        config.num_devices or len(logical_device_names()), "--strategy=keras_model_parallel"
    )
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ("batch", "model"), devices)
    layout_map = load_function(config.layout_map, LAYOUT_MAP_FLAG)(mesh)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise ValueError(
            f"{LAYOUT_MAP_FLAG} must name a function returning a keras.distribution.LayoutMap "
            f"for the mesh it is given. Received: {type(layout_map).__name__} from "
            f"{LAYOUT_MAP_FLAG}={config.layout_map}"
        )
    return layout_map


class KerasModelParallel(DeviceSpread):
    """Builds the model under `ModelParallel(layout_map)`: named weights sharded over K devices."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        distribution = keras.distribution.ModelParallel(layout_map=layout_map_for(config))
        with distribution.scope():
            model = source.model()
            if not model.built:
                model(context.sample_x)  # layers build, and shard, inside the scope
        logging.info(
            "keras.distribution: %d weights sharded over %d devices; variable bytes per device: %s",
            len(sharded_views(model)),
            distribution.device_mesh.devices.size,
            variable_bytes_per_device(model),
        )
        return model
