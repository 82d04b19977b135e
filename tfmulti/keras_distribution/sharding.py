"""`keras.distribution` on TensorFlow: layers sharded as a `ModelParallel` layout says.

Under `keras.distribution.ModelParallel(...).scope()` (or `set_distribution`), each layer
built is split by `layer_sharding.shard_layer` right after its `build`: this module
registers its hooks with `tfmulti.compat.keras_distribution_tf` when it loads. `shard`
does the same for a model built earlier. `DataParallel` runs on a
`tf.distribute.MirroredStrategy` over the mesh's devices (`follow_data_parallel`).

Example:
    >>> mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"), devices)
    >>> layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    >>> with keras.distribution.ModelParallel(layout_map=layout_map).scope():
    ...     model = keras_hub.models.LlamaCausalLM(backbone=...)
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat import keras_distribution_tf, keras_internals
from tfmulti.keras_distribution.layer_sharding import shard_layer
from tfmulti.keras_distribution.mesh_layout import check_model_axes, mesh_device_names
from tfmulti.keras_distribution.mesh_rows import MeshRows, mark_mesh_rows
from tfmulti.keras_distribution.row_split_steps import split_step_over_rows
from tfmulti.platform.runtime.distribute_strategy import cross_device_ops

_STRATEGIES: dict[int, tuple] = {}
# The strategy set globally for the current DataParallel distribution, if any.
_FOLLOWED: list = [None]
# Layers built inside a symbolic call, with the distribution they were built under.
_DEFERRED: list[tuple] = []


def shard_under_current_distribution(layer: keras.layers.Layer) -> bool:
    """Splits a just-built `layer`'s weights as the current `ModelParallel` says.

    Returns whether any weight was split; False outside a `ModelParallel` distribution.
    A layer built inside a symbolic call has no variable values yet: it is split once
    Keras creates them (`shard_deferred_layers`).
    """
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.ModelParallel):
        return False
    if keras_distribution_tf.variables_deferred():
        _DEFERRED.append((layer, distribution))
        return False
    return _shard_with(layer, distribution)


def shard_deferred_layers() -> None:
    """Splits the layers built while their variables were deferred, now that they exist."""
    while _DEFERRED:
        _shard_with(*_DEFERRED.pop(0))


def _shard_with(layer: keras.layers.Layer, distribution) -> bool:
    device_mesh, batch_dim_name = distribution.device_mesh, distribution.batch_dim_name
    check_model_axes(device_mesh, batch_dim_name)
    mark_mesh_rows(layer, MeshRows.of_device_mesh(device_mesh, batch_dim_name))
    return shard_layer(layer, distribution.get_variable_layout, device_mesh, batch_dim_name)


def shard(
    model: keras.Model, layout_map: keras.distribution.LayoutMap, batch_dim_name: str = "batch"
) -> keras.Model:
    """Moves a built model's weights into shards on devices as `layout_map` says.

    The values are kept (loaded weights stay loaded); weights the map does not name, and
    layers other than Dense, EinsumDense, Embedding and ReversibleEmbedding, stay whole
    where they are (the latter with a `LayoutNotHonouredWarning`). Call it before
    training: an optimizer that already holds state for the whole weights is refused.

    Args:
        model: a built Keras model.
        layout_map: a `keras.distribution.LayoutMap` (its `device_mesh` names the devices).
        batch_dim_name: the mesh axis of the batch; with size > 1, `fit`, `evaluate` and
            `predict` split each batch over its rows (`mesh_rows`).

    Returns:
        `model`, sharded in place.

    Example:
        >>> model.load_weights("llama.weights.h5")
        >>> shard(model, LlamaBackbone.get_layout_map(mesh))
    """
    if not model.built:
        raise ValueError(
            f"shard() needs a built model (call it on data or build it first). Received: "
            f"model {model.name!r} with built=False"
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        raise ValueError(
            f"shard() must run before training: the optimizer of model {model.name!r} already "
            "holds state for the whole weights. Shard first, then compile and fit."
        )
    device_mesh = layout_map.device_mesh
    check_model_axes(device_mesh, batch_dim_name)
    rows = MeshRows.of_device_mesh(device_mesh, batch_dim_name)
    mark_mesh_rows(model, rows)

    def layout_of(variable):
        return layout_map[variable.path]

    sharded = False
    for layer in keras_internals.layers_within(model):
        sharded = shard_layer(layer, layout_of, device_mesh, batch_dim_name) or sharded
    if sharded or rows.num_rows > 1:
        # Traced steps read the whole weights; retrace, and without XLA (one device only).
        model.train_function = model.test_function = model.predict_function = None
        if model.compiled:
            model.jit_compile = False
    return model


def strategy_for_data_parallel(distribution) -> tf.distribute.Strategy | None:
    """The `MirroredStrategy` over a `DataParallel` distribution's devices (None for one)."""
    devices = tuple(np.ravel(mesh_device_names(distribution.device_mesh)))
    if len(devices) < 2:
        return None
    key = id(distribution)
    if key not in _STRATEGIES or _STRATEGIES[key][0] is not distribution:
        device_type = tf.DeviceSpec.from_string(devices[0]).device_type
        strategy = tf.distribute.MirroredStrategy(
            devices=list(devices), cross_device_ops=cross_device_ops("auto", device_type)
        )
        # The distribution is kept with its strategy, so its id is never reused meanwhile.
        _STRATEGIES[key] = (distribution, strategy)
    return _STRATEGIES[key][1]


def follow_data_parallel(distribution) -> None:
    """Makes the global tf.distribute strategy follow the Keras distribution just set.

    A `DataParallel` over several devices sets its `MirroredStrategy` (models built then
    mirror their variables, and `fit` splits each batch); anything else clears a strategy
    set here before. A strategy the user set is left alone.
    """
    wanted = None
    if isinstance(distribution, keras.distribution.DataParallel):
        wanted = strategy_for_data_parallel(distribution)
    if wanted is _FOLLOWED[0]:
        return
    tf.distribute.experimental_set_strategy(wanted)
    _FOLLOWED[0] = wanted


keras_distribution_tf.register_sharding_hooks(
    keras_distribution_tf.ShardingHooks(
        after_build=shard_under_current_distribution,
        after_distribution_set=follow_data_parallel,
        after_deferred_variables=shard_deferred_layers,
        wrap_step=split_step_over_rows,
    )
)
