"""`--save_model`: the trained model as a plain single-device `.keras` file.

Every tfmulti model saves as the plain Keras model it trains (`WrappedModel.save`, the
unsplit model of tensor-parallel layers), so the file loads with
`keras.saving.load_model` on one device: without tfmulti for a model of Keras layers,
with the model's own module imported for custom layers. Only the chief writes it.
"""

from __future__ import annotations

import os

import keras

KERAS_SUFFIX = ".keras"


def save_trained_model(model: keras.Model, path: str) -> None:
    """Saves `model` to `path` whole or not at all: written beside it, then moved over it,
    so a crash mid-save leaves any earlier file as it was. (`--save_model`'s validator
    refuses a path that is not a `.keras` file before training starts.)"""
    if not path.endswith(KERAS_SUFFIX):
        raise ValueError(
            f"--save_model must name a .keras file, e.g. runs/model.keras. Received: {path!r}"
        )
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    partial = f"{path[: -len(KERAS_SUFFIX)]}.partial{KERAS_SUFFIX}"
    model.save(partial)
    os.replace(partial, path)
