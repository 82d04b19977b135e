"""Shared pieces of the reference models: derived seeds and chaining blocks into a model."""

from __future__ import annotations

from collections.abc import Sequence

import keras

# A large prime keeps seeds derived from neighbouring parents from colliding.
_SEED_STRIDE = 1_000_003


def derive_seed(seed: int, index: int) -> int:
    """Returns the seed of part `index` of something seeded with `seed`.

    Every weight of a reference model gets its own initializer seeded this way,
    so weights depend only on the model's seed: not on TensorFlow's global seed,
    on what was built before, or on whether a block is built alone or in a model.

    Example:
        >>> derive_seed(0, 1) != derive_seed(1, 0)
        True
    """
    return (seed * _SEED_STRIDE + index + 1) % (2**31 - 1)


def chain_blocks(
    blocks: Sequence[keras.layers.Layer],
    input_shape: Sequence[int],
    input_dtype: str = "float32",
    name: str | None = None,
) -> keras.Model:
    """Calls each block on the previous block's output and returns the functional model.

    The model's layers after its input layer are `blocks`, in order, so the
    model and the list share weights and a weight layout.

    Args:
        blocks: the layers to chain; block 0 takes the model input.
        input_shape: shape of one example, without the batch dimension.
        input_dtype: dtype of the model input, e.g. "int32" for tokens.
        name: the model's name.

    Example:
        >>> model = chain_blocks([keras.layers.Dense(4), keras.layers.Dense(2)], (3,))
        >>> model.output.shape
        (None, 2)
    """
    if not blocks:
        raise ValueError(f"chain_blocks needs at least one block. Received: blocks={blocks!r}")
    inputs = keras.Input(shape=tuple(input_shape), dtype=input_dtype)
    outputs = inputs
    for block in blocks:
        outputs = block(outputs)
    return keras.Model(inputs, outputs, name=name)


def check_image_shape(model_name: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    """Returns input_shape as (height, width, channels) or raises ValueError."""
    input_shape = tuple(int(size) for size in input_shape)
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ValueError(
            f"Model {model_name!r} takes images of shape (height, width, channels), "
            f"e.g. (8, 8, 1). Received: input_shape={input_shape}"
        )
    return input_shape
