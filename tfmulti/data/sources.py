"""The named datasets and the options each accepts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfmulti.data.digits import load_digits
from tfmulti.data.info import CLASSIFICATION, LANGUAGE_MODEL, ArrayData
from tfmulti.data.npz import load_npz
from tfmulti.data.synthetic import synthetic_classification, synthetic_tokens
from tfmulti.data.tfrecord import RecordData, load_tfrecord
from tfmulti.data.user import StreamData, load_user_dataset
from tfmulti.user_code import is_function_reference

DATASET_NAMES = ("synthetic", "digits", "npz", "tfrecord", "tokens")

# The task each dataset gives; None where the file's contents decide.
_DATASET_TASKS = {
    "synthetic": CLASSIFICATION,
    "digits": CLASSIFICATION,
    "npz": None,
    "tfrecord": CLASSIFICATION,
    "tokens": LANGUAGE_MODEL,
}

_DATASET_OPTIONS = {
    "synthetic": ("num_examples", "input_shape", "num_classes"),
    "digits": (),
    "npz": ("data_path", "num_classes"),
    "tfrecord": ("data_path", "num_classes"),
    "tokens": ("num_examples", "sequence_length", "vocab_size"),
}


def dataset_task(name: str) -> str | None:
    """Returns "classification" or "language_model" for a dataset, None where the data
    decides (npz, and a user's `package.module:function`).

    Example:
        >>> dataset_task("tokens")
        'language_model'
    """
    check_dataset_name(name)
    return _DATASET_TASKS.get(name)


def check_dataset_name(name: str) -> None:
    """Raises ValueError unless `name` is one of DATASET_NAMES or package.module:function."""
    if name not in DATASET_NAMES and not is_function_reference(name):
        raise ValueError(
            f"Unknown dataset; use one of {list(DATASET_NAMES)} or package.module:function. "
            f"Received: {name!r}"
        )


def load_source(
    name: str,
    *,
    data_path: str | None = None,
    seed: int = 0,
    num_examples: int | None = None,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    sequence_length: int | None = None,
    vocab_size: int | None = None,
) -> ArrayData | RecordData | StreamData:
    """Loads a dataset: ArrayData for named ones but tfrecord, which gives RecordData.

    A `package.module:function` name calls the user's function (see `tfmulti.data.user`):
    ArrayData for arrays, StreamData for tf.data datasets.

    Options left as None take the dataset's defaults; an option the dataset does
    not use (e.g. vocab_size for digits) is an error rather than silently ignored.

    Args:
        name: one of DATASET_NAMES, or package.module:function.
        data_path: the user file (npz) or glob / comma list of files (tfrecord).
        seed: seeds generated data (synthetic, tokens); file splits are fixed.
        num_examples: examples to generate (synthetic, tokens).
        input_shape: shape of one generated example (synthetic).
        num_classes: number of labels (synthetic; npz and tfrecord infer it if None).
        sequence_length: tokens per sequence (tokens).
        vocab_size: number of distinct tokens (tokens).

    Example:
        >>> load_source("tokens", sequence_length=16, vocab_size=32).info.input_shape
        (16,)
    """
    check_dataset_name(name)
    given = {
        "data_path": data_path,
        "num_examples": num_examples,
        "input_shape": input_shape,
        "num_classes": num_classes,
        "sequence_length": sequence_length,
        "vocab_size": vocab_size,
    }
    options = {key: value for key, value in given.items() if value is not None}
    unused = sorted(set(options) - set(_DATASET_OPTIONS.get(name, ())))
    if unused:
        accepted = list(_DATASET_OPTIONS.get(name, ())) or "no options"
        raise ValueError(
            f"Dataset {name!r} does not use {unused}; it accepts {accepted}. "
            f"Received: {', '.join(f'{key}={options[key]!r}' for key in unused)}"
        )
    if is_function_reference(name):
        return load_user_dataset(name)
    if name in ("npz", "tfrecord") and data_path is None:
        raise ValueError(f"Dataset {name!r} reads a user file; pass data_path. Received: None")

    if name == "synthetic":
        return synthetic_classification(seed=seed, **options)
    if name == "tokens":
        return synthetic_tokens(seed=seed, **options)
    if name == "digits":
        return load_digits()
    if name == "npz":
        return load_npz(data_path, num_classes=num_classes)
    return load_tfrecord(data_path, num_classes=num_classes)


def first_training_examples(
    source: ArrayData | RecordData | StreamData, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` training examples of a loaded source (fewer if it has fewer), as
    numpy (x, y): what `scripts/train.py` builds a model with and the planner times it on.

    Every form `load_source` returns: arrays, TFRecord files and a user's tf.data datasets.

    Example:
        >>> x, y = first_training_examples(load_source("digits"), 8)
        >>> x.shape, y.shape
        ((8, 8, 8, 1), (8,))
    """
    if isinstance(source, ArrayData):
        return source.x_train[:count], source.y_train[:count]
    for x, y in source.train.batch(count).take(1):
        return x.numpy(), y.numpy()
    raise ValueError(f"Dataset {source.info.name!r} has no training examples. Received: none")
