"""A model whose layer sums over a group of two devices that only one device joins: its
collective waits for the missing peer until the timeout (tests of the one-line report)."""

import keras
from tensorflow.python.ops import collective_ops


class LonelySum(keras.layers.Layer):
    """All-reduces its input over a group of two that no other device ever joins."""

    def call(self, inputs):
        return collective_ops.all_reduce_v2(
            inputs, group_size=2, group_key=77, instance_key=77, timeout=1.0
        )


def stalled_mlp() -> keras.Model:
    """A classifier of the 8x8 digits (10 classes) with a stalled sum."""
    inputs = keras.Input((8, 8))
    # On the input, before any weight: no gradient flows through the sum.
    hidden = keras.layers.Dense(8)(LonelySum()(keras.layers.Flatten()(inputs)))
    return keras.Model(inputs, keras.layers.Dense(10)(hidden))
