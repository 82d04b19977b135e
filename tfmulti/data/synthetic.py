"""Generated datasets: teacher-labelled features and Markov-chain token sequences."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfmulti.data.info import (
    CLASSIFICATION,
    LANGUAGE_MODEL,
    ArrayData,
    make_array_data,
    split_validation,
)

# The chance that a token is followed by its fixed successor; otherwise the next
# token is uniform. A model that learns the rule reaches this accuracy.
TOKEN_RULE_PROBABILITY = 0.9


def synthetic_classification(
    num_examples: int = 2048,
    input_shape: Sequence[int] = (8, 8, 1),
    num_classes: int = 10,
    seed: int = 0,
    validation_fraction: float = 0.2,
) -> ArrayData:
    """Makes Gaussian features labelled by a fixed random linear teacher.

    The labels are the argmax of a random linear map of x, so a linear model can
    learn them; the same arguments always give the same arrays.

    Args:
        num_examples: total examples, before the validation split.
        input_shape: shape of one example, e.g. (8, 8, 1) or (32,).
        num_classes: number of labels (>= 2).
        seed: seeds the features and the teacher.
        validation_fraction: share of examples held out for validation.

    Example:
        >>> data = synthetic_classification(num_examples=100, input_shape=(4,))
        >>> data.x_train.shape
        (80, 4)
    """
    input_shape = tuple(int(size) for size in input_shape)
    _check_positive(num_examples=num_examples)
    _check_positive(**{f"input_shape[{i}]": size for i, size in enumerate(input_shape)})
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2. Received: num_classes={num_classes}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_examples, *input_shape), dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(input_shape)), num_classes), dtype=np.float32)
    y = np.argmax(x.reshape(num_examples, -1) @ teacher, axis=1).astype(np.int32)
    return make_array_data(
        "synthetic", CLASSIFICATION, *split_validation(x, y, validation_fraction), num_classes
    )


def synthetic_tokens(
    num_examples: int = 2048,
    sequence_length: int = 32,
    vocab_size: int = 64,
    seed: int = 0,
    validation_fraction: float = 0.2,
) -> ArrayData:
    """Makes token sequences from a fixed random Markov chain, for language models.

    Each token is followed by its own fixed successor with probability
    TOKEN_RULE_PROBABILITY and by a uniform random token otherwise. x is a
    sequence and y the same sequence shifted left by one (the next tokens).

    Args:
        num_examples: total sequences, before the validation split.
        sequence_length: tokens in each x (and y).
        vocab_size: number of distinct tokens (>= 2).
        seed: seeds the successor table and the sampled sequences.
        validation_fraction: share of sequences held out for validation.

    Example:
        >>> data = synthetic_tokens(num_examples=10, sequence_length=8, vocab_size=16)
        >>> bool((data.x_train[:, 1:] == data.y_train[:, :-1]).all())
        True
    """
    _check_positive(num_examples=num_examples, sequence_length=sequence_length)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2. Received: vocab_size={vocab_size}")
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab_size)
    tokens = np.empty((num_examples, sequence_length + 1), dtype=np.int32)
    tokens[:, 0] = rng.integers(vocab_size, size=num_examples)
    for position in range(1, sequence_length + 1):
        follows_rule = rng.random(num_examples) < TOKEN_RULE_PROBABILITY
        random_tokens = rng.integers(vocab_size, size=num_examples)
        tokens[:, position] = np.where(
            follows_rule, successor[tokens[:, position - 1]], random_tokens
        )
    x, y = tokens[:, :-1], tokens[:, 1:]
    return make_array_data(
        "tokens", LANGUAGE_MODEL, *split_validation(x, y, validation_fraction), vocab_size
    )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1. Received: {name}={value}")
