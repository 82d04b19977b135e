"""scikit-learn's bundled 8x8 handwritten digits: real data that needs no download."""

from __future__ import annotations

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
    from sklearn.datasets import load_digits as sklearn_load_digits

    digits = sklearn_load_digits()
    # Pixel intensities in the bundled set run from 0 to 16.
    x = (digits.images / 16.0).astype(np.float32)[..., np.newaxis]
    y = digits.target.astype(np.int32)
    splits = split_validation(x, y, DIGITS_VALIDATION_FRACTION)
    return make_array_data("digits", CLASSIFICATION, *splits, num_classes=10)
