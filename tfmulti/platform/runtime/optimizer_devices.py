"""Keeps a Keras optimizer's slots and update math on the device of the variable they serve.

Without a distribution strategy, Keras creates slot variables and update ops wherever the
current device scope points, which is the first device; a pipeline wants stage s's optimizer
state on stage s's device, like its weights.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.compat.keras_internals import variable_device

_PLACED_MARK = "_tfmulti_placed_on_variable_devices"


def beside(variable) -> tf.device:
    """The device scope for optimizer state and updates of `variable`: its storage's device.

    The one rule for both ways tfmulti keeps slots beside their variables: per optimizer
    (`place_optimizer_on_variable_devices`) and per variable (a split weight's shards, see
    `tfmulti.compat.keras_distribution_tf.keep_optimizer_state_beside`).
    """
    return tf.device(variable_device(variable))


def place_optimizer_on_variable_devices(optimizer: keras.optimizers.Optimizer) -> None:
    """Makes `optimizer` create each slot, and run each update, on its variable's device.

    Wraps the optimizer instance's `add_variable_from_reference` and `update_step`; a
    `LossScaleOptimizer`'s inner optimizer is the one wrapped. Calling it twice is harmless.

    Example:
        >>> optimizer = keras.optimizers.Adam()
        >>> place_optimizer_on_variable_devices(optimizer)
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(optimizer, _PLACED_MARK, False):
        return
    add_slot = optimizer.add_variable_from_reference
    update_step = optimizer.update_step

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.init_scope(), beside(reference_variable):
            return add_slot(reference_variable, *args, **kwargs)

    def placed_update_step(gradient, variable, learning_rate):
        with beside(variable):
            return update_step(gradient, variable, learning_rate)

    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    object.__setattr__(optimizer, "update_step", placed_update_step)
    object.__setattr__(optimizer, _PLACED_MARK, True)
