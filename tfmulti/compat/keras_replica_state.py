"""Non-trainable state under tf.distribute: Keras 3 lets each replica's copy drift apart.

Keras 3 creates a layer's non-trainable weights, such as BatchNorm's moving mean and
variance, with aggregation "none". Under `MirroredStrategy` (tfmulti's `mirrored`
strategy, `keras.distribution.DataParallel`) and `MultiWorkerMirroredStrategy`, TensorFlow
then updates each replica's copy with that replica's own value. The copies drift apart,
and what is read, saved and checkpointed is the first replica's: statistics of 1/N of the
data. A resumed run, whose copies all start from the first one's, leaves the
uninterrupted run's path. Keras 2 kept such weights on-read with mean aggregation.

The fix gives a layer's non-trainable float weights aggregation "mean" when the layer
creates them under a strategy's scope and asks for no aggregation. Each update then
assigns the replicas' mean to every copy. The copies stay equal, a moving mean follows
the whole batch's statistics as on one device, and a resumed run continues exactly. The
cost is one all-reduce per such weight per step. `tests/test_compat_replica_state.py`
tells when upstream stops creating them with aggregation "none".
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import keras
import tensorflow as tf
from keras.src.layers.layer import Layer

from tfmulti.compat.fixes import Fix, FixSet


def _mean_aggregation_under_strategies(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def add_weight(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if (
            tf.distribute.has_strategy()
            and not arguments["trainable"]
            and arguments["aggregation"] == "none"
            and keras.backend.is_float_dtype(arguments["dtype"] or self.variable_dtype)
        ):
            arguments["aggregation"] = "mean"
        return original(*bound.args, **bound.kwargs)

    return add_weight


FIXES = (
    Fix(
        name="mean_aggregated_layer_state_under_strategies",
        owner=Layer,
        attribute="add_weight",
        make_replacement=_mean_aggregation_under_strategies,
    ),
)

FIX_SET = FixSet(FIXES)


def original_add_weight() -> Callable:
    """Keras' own `Layer.add_weight`, to check whether upstream still needs the fix."""
    return FIX_SET.original(FIXES[0].name)
