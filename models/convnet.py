"""A small convnet: conv + max-pool blocks, a dense block, dense logits."""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfmulti.models.blocks import check_image_shape, derive_seed


def build_blocks(
    input_shape: Sequence[int],
    num_outputs: int,
    seed: int = 0,
    filters: Sequence[int] = (16, 32),
    hidden_units: int = 64,
) -> list[keras.layers.Layer]:
    """Builds the convnet as one block per conv layer, a dense block and a logits block.

    Each conv block is a 3x3 ReLU convolution and a 2x2 max-pool, so 8x8 digits
    become 4x4 and then 2x2.

    Args:
        input_shape: (height, width, channels) of one image.
        num_outputs: number of classes (logits).
        seed: seeds every weight (see `derive_seed`).
        filters: channels of each conv block.
        hidden_units: width of the dense block.

    Example:
        >>> len(build_blocks((8, 8, 1), 10))
        4
    """
    check_image_shape("convnet", input_shape)
    blocks = []
    for index, channels in enumerate(filters):
        conv = keras.layers.Conv2D(
            channels,
            3,
            padding="same",
            activation="relu",
            kernel_initializer=keras.initializers.HeNormal(derive_seed(seed, index)),
        )
        pool = keras.layers.MaxPooling2D(2, padding="same")
        blocks.append(keras.Sequential([conv, pool], name=f"convnet_conv_{index}"))
    dense = keras.layers.Dense(
        hidden_units,
        activation="relu",
        kernel_initializer=keras.initializers.HeNormal(derive_seed(seed, len(filters))),
    )
    blocks.append(keras.Sequential([keras.layers.Flatten(), dense], name="convnet_dense"))
    logits = keras.layers.Dense(
        num_outputs,
        kernel_initializer=keras.initializers.GlorotUniform(derive_seed(seed, len(filters) + 1)),
        # Logits stay float32 under mixed precision, the Keras convention.
        dtype="float32",
    )
    blocks.append(keras.Sequential([logits], name="convnet_head"))
    return blocks
