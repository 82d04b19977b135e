"""What a dataset is: its task, shapes and sizes, and its arrays when it fits in memory."""

from __future__ import annotations

import dataclasses

import numpy as np

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"
TASKS = (CLASSIFICATION, LANGUAGE_MODEL)

# Validation splits do not move with the training seed, so runs with different
# seeds are scored on the same held-out examples.
SPLIT_SEED = 0


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """Describes one dataset for the model builder and the training script.

    Args:
        name: the dataset's name, e.g. "digits".
        task: "classification" (y is one label per example) or "language_model"
            (y is x shifted by one token).
        input_shape: shape of one example of x, without the batch dimension.
        num_classes: number of labels, or the vocabulary size for language models.
        num_train_examples: examples in the training split.
        num_validation_examples: examples in the validation split.
        x_dtype: dtype of x: "float32" for features, "int32" for tokens.
    """

    name: str
    task: str
    input_shape: tuple[int, ...]
    num_classes: int
    num_train_examples: int
    num_validation_examples: int
    x_dtype: str


@dataclasses.dataclass(frozen=True)
class ArrayData:
    """A dataset held in memory: training and validation arrays plus its DataInfo."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_validation: np.ndarray
    y_validation: np.ndarray
    info: DataInfo


def split_validation(
    x: np.ndarray, y: np.ndarray, validation_fraction: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Splits arrays into (x_train, y_train, x_val, y_val) by a fixed permutation.

    Args:
        x: examples, first axis is the example axis.
        y: targets, same length as x.
        validation_fraction: share of examples held out, in (0, 1).

    Returns:
        The four arrays; the split is the same on every call.
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(
            "validation_fraction must be between 0 and 1 (exclusive). "
            f"Received: validation_fraction={validation_fraction}"
        )
    num_validation = max(1, int(round(len(x) * validation_fraction)))
    if num_validation >= len(x):
        raise ValueError(
            f"{len(x)} examples are too few to hold out {validation_fraction:.0%} for "
            f"validation; provide more examples. Received: num_examples={len(x)}"
        )
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    validation, train = order[:num_validation], order[num_validation:]
    return x[train], y[train], x[validation], y[validation]


def check_arrays(x: np.ndarray, y: np.ndarray, where: str) -> None:
    """Raises ValueError when x and y do not describe the same examples."""
    if x.ndim < 1 or len(x) == 0:
        raise ValueError(f"{where}: x must hold at least one example. Received: x.shape={x.shape}")
    if len(x) != len(y):
        raise ValueError(
            f"{where}: x and y must have the same number of examples. "
            f"Received: x.shape={x.shape}, y.shape={y.shape}"
        )


def make_array_data(
    name: str,
    task: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_validation: np.ndarray,
    y_validation: np.ndarray,
    num_classes: int,
) -> ArrayData:
    """Bundles split arrays with the DataInfo that describes them."""
    info = DataInfo(
        name=name,
        task=task,
        input_shape=tuple(int(size) for size in x_train.shape[1:]),
        num_classes=int(num_classes),
        num_train_examples=len(x_train),
        num_validation_examples=len(x_validation),
        x_dtype=str(x_train.dtype),
    )
    return ArrayData(x_train, y_train, x_validation, y_validation, info)
