"""A pipeline's stages as one plain Keras model, to save, load and serve on one device."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmulti.pipeline.stages.block_partition import BlockStage


def input_spec(inputs):
    """The nest of `keras.KerasTensor`s (any batch size) that `inputs`, one batch, matches."""
    return tf.nest.map_structure(
        lambda t: keras.KerasTensor(
            (None, *t.shape[1:]), dtype=keras.backend.standardize_dtype(t.dtype)
        ),
        inputs,
    )


def chained_model(stages: Sequence[keras.layers.Layer], spec, name: str) -> keras.Model:
    """A functional model calling `stages` one after the other on inputs like `spec`.

    A `BlockStage` is chained block by block, so the saved model needs only the blocks'
    own classes to load.

    Args:
        stages: built stages, in order.
        spec: the input nest, as made by `input_spec`.
        name: the model's name.

    Example:
        >>> model = chained_model(pipe.stages, input_spec(x[:1]), "chained")
    """
    inputs = tf.nest.map_structure(lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype), spec)
    outputs = inputs
    for stage in stages:
        for layer in stage.blocks if isinstance(stage, BlockStage) else [stage]:
            outputs = layer(outputs)
    return keras.Model(inputs, outputs, name=name)
