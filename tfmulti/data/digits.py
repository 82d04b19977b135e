"""scikit-learn's bundled 8x8 handwritten digits: real data that needs no download."""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np

from tfmulti.data.info import CLASSIFICATION, ArrayData, make_array_data, split_validation

DIGITS_VALIDATION_FRACTION = 0.2


def load_digits() -> ArrayData:
    """Loads the 1797 digits as (8, 8, 1) float32 images in [0, 1] with 10 classes.

    The validation split (20%) is fixed: it is the same on every call and does
    not depend on any training seed.

    Example:
        >>> data = load_digits()
        >>> data.x_train.shape, data.info.num_classes
        ((1438, 8, 8, 1), 10)
    """
    images, target = bundled_digits()
    # Pixel intensities in the bundled set run from 0 to 16.
    x = (images / 16.0).astype(np.float32)[..., np.newaxis]
    y = target.astype(np.int32)
    splits = split_validation(x, y, DIGITS_VALIDATION_FRACTION)
    return make_array_data("digits", CLASSIFICATION, *splits, num_classes=10)


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8), labels (1797,)) as `sklearn.datasets.load_digits` gives them.

    Read from the file scikit-learn ships, without importing scikit-learn: that import
    (with SciPy) costs a training process 1.5-2 s of start-up here.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("--dataset=digits needs scikit-learn: pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
