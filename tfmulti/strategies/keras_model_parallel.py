"""`--strategy=keras_model_parallel`: the model built under `keras.distribution.ModelParallel`.

The layout map comes from the user's `package.module:function(device_mesh)` (e.g. a
KerasHub backbone's `get_layout_map`), over a `("batch", "model")` mesh of this host's
devices: `(1, K)`, or `(D, K)` with `--mesh=data=D,tensor=K` (each batch split over D
rows); `tfmulti.keras_distribution.sharding` shards the weights it names as each layer
builds.
"""

from __future__ import annotations

import keras
from absl import logging

from tfmulti.config import TrainConfig
from tfmulti.keras_distribution.layer_sharding import sharded_views
from tfmulti.parallel import variable_bytes_per_device
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import first_logical_devices, logical_device_names
from tfmulti.strategies.base import BuildContext, DevicePlacingStrategy
from tfmulti.strategies.model_source import ModelSource
from tfmulti.user_code import load_function

LAYOUT_MAP_FLAG = "--layout_map"


def mesh_shape_for(config: TrainConfig) -> tuple[int, int]:
    """(rows, model devices): from `--mesh=data=D,tensor=K`, else (1, all devices)."""
    if config.distribution.mesh is None:
        return 1, config.distribution.num_devices or len(logical_device_names())
    mesh = parse_mesh(config.distribution.mesh)
    if mesh.pipe != 1:
        raise ValueError(
            "--strategy=keras_model_parallel takes --mesh=data=D,tensor=K (a (batch, model) "
            "mesh); for pipelines use --strategy=hybrid. Received: "
            f"--mesh={config.distribution.mesh}"
        )
    return mesh.data, mesh.tensor


def layout_map_for(config: TrainConfig) -> keras.distribution.LayoutMap:
    """Calls the `--layout_map` function on the run's `("batch", "model")` mesh."""
    rows, columns = mesh_shape_for(config)
    purpose = (
        f"--mesh={config.distribution.mesh}"
        if config.distribution.mesh
        else "--strategy=keras_model_parallel"
    )
    devices = first_logical_devices(rows * columns, purpose)
    mesh = keras.distribution.DeviceMesh((rows, columns), ("batch", "model"), devices)
    layout_map = load_function(config.distribution.layout_map, LAYOUT_MAP_FLAG)(mesh)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise ValueError(
            f"{LAYOUT_MAP_FLAG} must name a function returning a keras.distribution.LayoutMap "
            f"for the mesh it is given. Received: {type(layout_map).__name__} from "
            f"{LAYOUT_MAP_FLAG}={config.distribution.layout_map}"
        )
    return layout_map


class KerasModelParallel(DevicePlacingStrategy):
    """Builds the model under `ModelParallel(layout_map)`: named weights sharded over K devices."""

    def build(self, source: ModelSource, config: TrainConfig, context: BuildContext) -> keras.Model:
        distribution = keras.distribution.ModelParallel(layout_map=layout_map_for(config))
        with distribution.scope():
            model = source.model()
            if not model.built:
                model(context.sample_x)  # layers build, and shard, inside the scope
        logging.info(
            "keras.distribution: %d weights sharded over %d devices, batch split over %d "
            "rows; variable bytes per device: %s",
            len(sharded_views(model)),
            distribution.device_mesh.devices.size,
            distribution.device_mesh.shape[0],
            variable_bytes_per_device(model),
        )
        return model
