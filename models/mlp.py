"""A multilayer perceptron: flatten, dense ReLU layers, dense logits."""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfmulti.models.blocks import derive_seed


def build_blocks(
    input_shape: Sequence[int],
    num_outputs: int,
    seed: int = 0,
    hidden_units: Sequence[int] = (64, 64, 64),
    activation: str = "relu",
) -> list[keras.layers.Layer]:
    """Builds the MLP as one block per dense layer; the last block gives float32 logits.

    Args:
        input_shape: shape of one example; it is flattened first.
        num_outputs: number of classes (logits).
        seed: seeds every weight (see `derive_seed`).
        hidden_units: width of each hidden layer, one block each.
        activation: activation of the hidden layers.

    Example:
        >>> [block.name for block in build_blocks((8, 8, 1), 10, hidden_units=(32,))]
        ['mlp_hidden_0', 'mlp_head']
    """
    blocks = []
    for index, units in enumerate(hidden_units):
        layers = [keras.layers.Flatten()] if index == 0 else []
        layers.append(
            keras.layers.Dense(
                units,
                activation=activation,
                kernel_initializer=keras.initializers.GlorotUniform(derive_seed(seed, index)),
            )
        )
        blocks.append(keras.Sequential(layers, name=f"mlp_hidden_{index}"))
    head = [] if hidden_units else [keras.layers.Flatten()]
    head.append(
        keras.layers.Dense(
            num_outputs,
            kernel_initializer=keras.initializers.GlorotUniform(
                derive_seed(seed, len(hidden_units))
            ),
            # Logits stay float32 under mixed precision, the Keras convention.
            dtype="float32",
        )
    )
    blocks.append(keras.Sequential(head, name="mlp_head"))
    return blocks
