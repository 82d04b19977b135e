"""A whole Keras variable replaced by shards on devices, and the view left in its place."""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat import keras_distribution_tf
from tfmulti.keras_distribution.mesh_layout import ShardPlan
from tfmulti.keras_distribution.row_split_shard import RowSplitShard, shard_variables
from tfmulti.tensor_parallel.sharded_layer import ShardedWeight, stand_for_shards


@dataclasses.dataclass(eq=False, repr=False)
class ShardedVariable(ShardedWeight):
    """Stands where a layer kept a whole variable that now lives as shards on devices.

    Reading it (`numpy()`, `np.asarray`, `value`) joins the shards; `assign` splits a
    whole value into them, so a layer's own weight saving and loading keeps the unsplit
    layout. It is listed in the layer's `weights` in the variable's place; training reads
    and updates the shards, which are the layer's `variables`.
    """

    devices: tuple[str, ...] = ()

    @property
    def value(self):
        """The whole value, joined on the first shard's device."""
        with tf.device(self.devices[0]):
            return keras.ops.concatenate([shard.value for shard in self.shards], self.axis)


def _variable_path_scope(path: str):
    """Makes variables created inside get paths under `path`, whatever scopes are open.

    Sharding runs after a layer's build, maybe inside its parent's build: the parent's name
    scope is open then, so the path is set absolutely (Keras' `override_parent`).
    """
    if not path:
        return contextlib.nullcontext()
    grandparent, _, parent = path.rpartition("/")
    return keras.name_scope(parent, override_parent=grandparent)


def split_variable(layer: keras.layers.Layer, variable, plan: ShardPlan) -> ShardedVariable:
    """Replaces `layer`'s own `variable` with shards per `plan`, in the same place of its weights.

    The shards are new variables named `<name>_shard_<k>` (paths `<path>_shard_<k>`), each
    created on its device, or with `plan.row_axis` `RowSplitShard`s of variables
    `<name>_shard_<k>_row_<r>`; the whole variable is dropped from the layer, so its memory is
    freed once nothing else holds it. Returns the view to keep where the layer held it.
    """
    with tf.init_scope():
        pieces = np.split(keras.ops.convert_to_numpy(variable.value), plan.num_shards, plan.axis)
        parent = variable.path.rpartition("/")[0]
        shards = []
        with _variable_path_scope(parent):
            for index, (device, piece) in enumerate(zip(plan.devices, pieces, strict=True)):
                name = f"{variable.name}_shard_{index}"
                if plan.row_axis is None:
                    shards.append(_new_variable(variable, piece, name, device))
                    continue
                row_pieces = np.split(piece, len(plan.row_devices[index]), plan.row_axis)
                shards.append(
                    RowSplitShard(
                        [
                            _new_variable(variable, row_piece, f"{name}_row_{row}", row_device)
                            for row, (row_device, row_piece) in enumerate(
                                zip(plan.row_devices[index], row_pieces, strict=True)
                            )
                        ],
                        plan.row_axis,
                    )
                )
    replacements = [held for shard in shards for held in shard_variables(shard)]
    keras_distribution_tf.replace_own_variable(layer, variable, replacements)
    return stand_for_shards(
        ShardedVariable(shards, plan.axis, path=variable.path, devices=plan.devices)
    )


def _new_variable(like, value: np.ndarray, name: str, device: str) -> keras.Variable:
    """A variable like `like` holding `value`, created on `device`, its optimizer state there."""
    with tf.device(device):
        created = keras.Variable(value, dtype=like.dtype, trainable=like.trainable, name=name)
    keras_distribution_tf.keep_optimizer_state_beside(created)
    return created
