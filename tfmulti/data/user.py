"""Your own data, from `--dataset=package.module:function`: tf.data datasets or numpy arrays.

The function takes no arguments and returns unbatched (x, y) examples in one of these
forms; tfmulti batches them with the global batch, shuffles, repeats and shards them as
it does its own data:
- a `tf.data.Dataset` of (x, y) (the first tenth, in the dataset's order, validates),
- a `(train, validation)` pair of such datasets,
- numpy arrays `(x, y)` (a fixed tenth validates) or `((x, y), (x_val, y_val))`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfmulti.data.info import (
    CLASSIFICATION,
    LANGUAGE_MODEL,
    ArrayData,
    DataInfo,
    check_arrays,
    make_array_data,
    split_validation,
)
from tfmulti.user_code import load_function

USER_VALIDATION_FRACTION = 0.1
# The task of targets that are neither class labels nor next tokens.
REGRESSION = "regression"
_FORMS = (
    "a tf.data.Dataset of (x, y), a (train, validation) pair of them, numpy (x, y) "
    "or ((x, y), (x_val, y_val))"
)


@dataclasses.dataclass(frozen=True)
class StreamData:
    """A user's unbatched (x, y) datasets and the DataInfo read from them.

    Args:
        train: (x, y) examples of the training split.
        validation: (x, y) examples of the validation split.
        info: shapes and sizes found by reading both splits once.
    """

    train: tf.data.Dataset
    validation: tf.data.Dataset
    info: DataInfo


def load_user_dataset(reference: str) -> ArrayData | StreamData:
    """Calls the `package.module:function` of `--dataset` and describes what it returns.

    Raises:
        ValueError: the function cannot be found or returns none of the accepted forms.

    Example:
        >>> source = load_user_dataset("my_data:load")
        >>> source.info.input_shape
        (8, 8, 1)
    """
    returned = load_function(reference, "--dataset")()
    if isinstance(returned, tf.data.Dataset):
        return _stream_data(reference, *_split_stream(reference, returned))
    if isinstance(returned, (tuple, list)) and len(returned) == 2:
        first, second = returned
        if isinstance(first, tf.data.Dataset) and isinstance(second, tf.data.Dataset):
            return _stream_data(reference, first, second)
        if _is_array_pair(first) and _is_array_pair(second):
            return _array_data(reference, *first, *second)
        if _is_array_pair(returned):
            x, y = (np.asarray(each) for each in returned)
            check_arrays(x, y, f"--dataset={reference}")
            return _array_data(reference, *split_validation(x, y, USER_VALIDATION_FRACTION))
    raise ValueError(f"--dataset={reference} must return {_FORMS}. Received: {_describe(returned)}")


def _is_array_pair(value) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(each, np.ndarray) for each in value)
    )


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(each).__name__ for each in value)})"
    return type(value).__name__


def _task(x_dtype, y_shape: tuple, x_shape: tuple, y_is_integer: bool) -> str:
    """Class labels, next tokens (integer y shaped like x) or anything else (regression)."""
    if not y_is_integer:
        return REGRESSION
    if len(y_shape) == 0:
        return CLASSIFICATION
    if y_shape == x_shape and np.issubdtype(x_dtype, np.integer):
        return LANGUAGE_MODEL
    return REGRESSION


def _array_data(reference, x_train, y_train, x_validation, y_validation) -> ArrayData:
    check_arrays(x_train, y_train, f"--dataset={reference} (train)")
    check_arrays(x_validation, y_validation, f"--dataset={reference} (validation)")
    is_integer = np.issubdtype(y_train.dtype, np.integer)
    task = _task(x_train.dtype, y_train.shape[1:], x_train.shape[1:], is_integer)
    labels = [y_train, y_validation] + ([x_train, x_validation] if task == LANGUAGE_MODEL else [])
    num_classes = max(int(each.max()) for each in labels) + 1 if is_integer else 0
    return make_array_data(
        reference, task, x_train, y_train, x_validation, y_validation, num_classes
    )


def _split_stream(reference, dataset: tf.data.Dataset):
    num_examples = _count_and_top_label(reference, dataset)[0]
    num_validation = max(1, round(num_examples * USER_VALIDATION_FRACTION))
    if num_validation >= num_examples:
        raise ValueError(
            f"--dataset={reference} gave {num_examples} examples, too few to hold out a "
            "validation split; return more or a (train, validation) pair. "
            f"Received: num_examples={num_examples}"
        )
    return dataset.skip(num_validation), dataset.take(num_validation)


def _count_and_top_label(reference, dataset: tf.data.Dataset) -> tuple[int, int]:
    """Reads the dataset once: its number of examples and its largest integer target."""
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ValueError(
            f"--dataset={reference} must give unbatched (x, y) examples. "
            f"Received: element_spec={spec}"
        )
    y_spec = spec[1]
    if not y_spec.dtype.is_integer:
        return int(dataset.reduce(np.int64(0), lambda count, _: count + 1)), -1
    count, top = dataset.reduce(
        (np.int64(0), np.int64(-1)),
        lambda state, example: (
            state[0] + 1,
            tf.maximum(state[1], tf.reduce_max(tf.cast(example[1], tf.int64))),
        ),
    )
    return int(count), int(top)


def _stream_data(reference, train, validation) -> StreamData:
    num_train, top_train = _count_and_top_label(reference, train)
    num_validation, top_validation = _count_and_top_label(reference, validation)
    x_spec, y_spec = train.element_spec
    x_shape, y_shape = tuple(x_spec.shape), tuple(y_spec.shape)
    if None in x_shape:
        raise ValueError(
            f"--dataset={reference} must give examples of one fixed shape. "
            f"Received: x shape={x_shape}"
        )
    is_integer = y_spec.dtype.is_integer
    task = _task(x_spec.dtype.as_numpy_dtype, y_shape, x_shape, is_integer)
    info = DataInfo(
        name=reference,
        task=task,
        input_shape=x_shape,
        num_classes=max(top_train, top_validation) + 1 if is_integer else 0,
        num_train_examples=num_train,
        num_validation_examples=num_validation,
        x_dtype=x_spec.dtype.name,
    )
    return StreamData(train, validation, info)
