"""User datasets stored as a NumPy .npz file with `x` and `y` arrays."""

from __future__ import annotations

import os

import numpy as np

from tfmulti.data.info import (
    CLASSIFICATION,
    LANGUAGE_MODEL,
    ArrayData,
    check_arrays,
    make_array_data,
    split_validation,
)


def load_npz(
    path: str, num_classes: int | None = None, validation_fraction: float = 0.2
) -> ArrayData:
    """Loads a classification or language-model dataset from a .npz file.

    The file holds `x` and `y`, and optionally `x_val` and `y_val`; without
    them a fixed share of the examples is held out. With one integer label per
    example (`y` of shape (n,)) the task is classification and x is cast to
    float32; with integer `x` and `y` of the same shape (n, length) the task is
    language modelling (y is the next token of each position).

    Args:
        path: the .npz file.
        num_classes: number of labels or tokens; inferred as max label + 1 if None.
        validation_fraction: share held out when the file has no `x_val`/`y_val`.

    Example:
        >>> np.savez("data.npz", x=np.zeros((10, 4)), y=np.arange(10) % 2)
        >>> load_npz("data.npz").info.num_classes
        2
    """
    if not os.path.isfile(path):
        raise ValueError(f"No .npz file at data_path; pass an existing file. Received: {path!r}")
    with _open_npz(path) as arrays:
        missing = [key for key in ("x", "y") if key not in arrays.files]
        if missing:
            raise ValueError(
                f"The .npz file needs arrays named 'x' and 'y'; it lacks {missing}. "
                f"Received: data_path={path!r} with arrays {sorted(arrays.files)}"
            )
        has_validation = "x_val" in arrays.files and "y_val" in arrays.files
        if not has_validation and ("x_val" in arrays.files or "y_val" in arrays.files):
            raise ValueError(
                "The .npz file must hold both 'x_val' and 'y_val' or neither. "
                f"Received: data_path={path!r} with arrays {sorted(arrays.files)}"
            )
        x, y = arrays["x"], arrays["y"]
        check_arrays(x, y, where=path)
        if has_validation:
            splits = (x, y, arrays["x_val"], arrays["y_val"])
            check_arrays(splits[2], splits[3], where=f"{path} (x_val, y_val)")
        else:
            splits = split_validation(x, y, validation_fraction)

    task = _infer_task(x, y, path)
    x_dtype = np.float32 if task == CLASSIFICATION else np.int32
    x_train, y_train, x_val, y_val = (
        splits[0].astype(x_dtype),
        splits[1].astype(np.int32),
        splits[2].astype(x_dtype),
        splits[3].astype(np.int32),
    )
    if x_val.shape[1:] != x_train.shape[1:] or y_val.shape[1:] != y_train.shape[1:]:
        raise ValueError(
            "Validation examples must have the training examples' shape. "
            f"Received: x.shape={x_train.shape}, x_val.shape={x_val.shape}, "
            f"y.shape={y_train.shape}, y_val.shape={y_val.shape}"
        )
    label_arrays = [y_train, y_val] + ([x_train, x_val] if task == LANGUAGE_MODEL else [])
    num_classes = _check_labels(label_arrays, num_classes, path)
    return make_array_data("npz", task, x_train, y_train, x_val, y_val, num_classes)


def _infer_task(x: np.ndarray, y: np.ndarray, path: str) -> str:
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y must hold integer labels or tokens. Received: y.dtype={y.dtype}")
    if y.ndim == 1:
        return CLASSIFICATION
    if y.shape == x.shape and np.issubdtype(x.dtype, np.integer):
        return LANGUAGE_MODEL
    raise ValueError(
        "y must be one label per example, shape (n,), or next tokens with x's shape "
        f"and integer x. Received: x.shape={x.shape}, x.dtype={x.dtype}, y.shape={y.shape} "
        f"in {path!r}"
    )


def _check_labels(arrays: list[np.ndarray], num_classes: int | None, path: str) -> int:
    lowest = min(int(array.min()) for array in arrays)
    highest = max(int(array.max()) for array in arrays)
    if lowest < 0:
        raise ValueError(f"Labels and tokens must be >= 0. Received: minimum {lowest} in {path!r}")
    if num_classes is None:
        return highest + 1
    if highest >= num_classes:
        raise ValueError(
            f"Labels must be below num_classes; raise num_classes above {highest}. "
            f"Received: num_classes={num_classes}, largest label {highest} in {path!r}"
        )
    return num_classes


def _open_npz(path: str):
    """The arrays of the .npz file at `path`; a file of another kind is a one-line ValueError."""
    try:
        arrays = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"data_path is not a .npz file of arrays x and y (np.savez) ({first_line}). "
            f"Received: data_path={path!r}"
        ) from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ValueError(
            "data_path holds one array (a .npy file); save x and y with np.savez. "
            f"Received: data_path={path!r}"
        )
    return arrays
