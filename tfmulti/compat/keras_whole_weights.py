"""Where a sharded layer's weight lists show its whole weights, as on JAX.

A weight tfmulti splits over devices is held by several variables (its shards); Keras'
`Layer.weights` lists a layer's variables, so `weights`, `get_weights()`,
`set_weights()` and `count_params()` would see the shards. On JAX Keras keeps one
variable per weight, laid out over the devices. Here `weights` (and so every list and
call built on it) shows one whole-shape view per split weight instead, in the place of
its first shard: the unsharded model's order and shapes.

`variables` and `trainable_variables` keep listing the shards: they are what optimizers
hold and what training differentiates. Keras' TensorFlow `train_step` differentiates
`trainable_weights`, which is the same list in plain Keras; while it runs (and when
`fit` hands the weights to an EMA optimizer at the end) the weight lists give the
shards, so training updates the real variables.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.layers.layer import Layer
from keras.src.optimizers.base_optimizer import BaseOptimizer

# On each shard variable: the whole-weight view it is part of.
_WHOLE_WEIGHT = "_tfmulti_whole_weight"
# Per thread: Keras' TensorFlow trainer runs each replica's step on its own thread.
_LISTING_VARIABLES = threading.local()


def stand_for(view, variables) -> None:
    """Makes `view` stand in the weight lists for `variables` (the shards it joins)."""
    for variable in variables:
        setattr(variable, _WHOLE_WEIGHT, view)


def whole_weight_of(variable):
    """The whole-weight view `variable` is a shard of, or None."""
    return getattr(variable, _WHOLE_WEIGHT, None)


@contextlib.contextmanager
def weights_as_variables():
    """While open (on this thread), `weights` lists the shards, as `variables` does."""
    depth = getattr(_LISTING_VARIABLES, "depth", 0)
    _LISTING_VARIABLES.depth = depth + 1
    try:
        yield
    finally:
        _LISTING_VARIABLES.depth = depth


def _whole_weights(variables: list) -> list:
    """`variables` with each run of shards replaced by their whole-weight view, once."""
    listed, seen = [], set()
    for variable in variables:
        view = whole_weight_of(variable)
        if view is None:
            listed.append(variable)
        elif id(view) not in seen:
            seen.add(id(view))
            listed.append(view)
    return listed


def _weights_listed_whole(original: property) -> property:
    @functools.wraps(original.fget)
    def weights(self):
        variables = original.fget(self)
        if getattr(_LISTING_VARIABLES, "depth", 0):
            return variables
        return _whole_weights(variables)

    return property(weights, doc=original.__doc__)


def _step_differentiates_variables(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(self, data):
        with weights_as_variables():
            return original(self, data)

    return train_step


def variables_holding(weight) -> list:
    """The variables holding `weight`: the shards of a whole-weight view, else itself."""
    variables = list(getattr(weight, "variables", ()))
    if variables and whole_weight_of(variables[0]) is weight:
        return variables
    return [weight]


def _finalize_on_variables(original: Callable) -> Callable:
    @functools.wraps(original)
    def finalize_variable_values(self, var_list):
        return original(self, [each for weight in var_list for each in variables_holding(weight)])

    return finalize_variable_values


# (name, owner, attribute, make_replacement) for `keras_distribution_tf.PATCHES`.
PATCH_SPECS = (
    ("weights_list_whole_weights", Layer, "weights", _weights_listed_whole),
    (
        "train_step_differentiates_shards",
        TensorFlowTrainer,
        "train_step",
        _step_differentiates_variables,
    ),
    (
        "ema_finalizes_shards",
        BaseOptimizer,
        "finalize_variable_values",
        _finalize_on_variables,
    ),
)
